import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a module that serves the app on tiny models (see ``tiny_app.one_thread``)."""
    import tiny_app

    with tiny_app.one_thread():
        yield
