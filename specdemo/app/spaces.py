"""Hugging Face ZeroGPU support: ``spaces.GPU`` when the ``spaces`` package is installed, a no-op otherwise.

Import this module before anything touches CUDA (``app.py`` imports it first): ZeroGPU requires ``import spaces``
to come before CUDA is initialised. Outside a Space, ``spaces`` is usually absent and :func:`gpu` changes nothing.
"""

import logging
import os
from typing import Any, Callable, TypeVar

logger = logging.getLogger(__name__)

try:  # must run before CUDA is initialised
    import spaces  # type: ignore[import-not-found]
except ImportError:  # the usual case outside Hugging Face Spaces
    spaces = None

F = TypeVar("F", bound=Callable[..., Any])

#: True when running on a ZeroGPU Space (the GPU is attached only inside ``@gpu`` functions)
ZERO_GPU: bool = spaces is not None and os.environ.get("SPACES_ZERO_GPU", "").strip().lower() in {"1", "true"}
#: True when running on any Hugging Face Space
ON_SPACES: bool = bool(os.environ.get("SPACE_ID"))


def gpu(fn: F | None = None, *, duration: int | None = None) -> Any:
    """``spaces.GPU`` (optionally with a ``duration`` in seconds) when available, else return ``fn`` unchanged.

    Works as ``@gpu``, ``@gpu(duration=120)`` and ``gpu(fn, duration=120)``; generator functions are supported.
    """

    def wrap(function: F) -> F:
        if spaces is None:
            return function
        decorator = spaces.GPU(duration=duration) if duration else spaces.GPU
        return decorator(function)

    return wrap(fn) if fn is not None else wrap
