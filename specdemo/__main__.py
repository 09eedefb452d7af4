"""``python -m specdemo`` runs the benchmark CLI (same as ``python -m specdemo.bench``)."""

import sys

from .bench import main

sys.exit(main())
