"""The process's resident memory, and handing freed heap pages back to the system."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import logging
from pathlib import Path

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=1)
def _malloc_trim() -> ctypes._CFuncPtr | None:
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        return ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


def return_free_memory(collect: bool = True) -> None:
    """Collect garbage (unless ``collect`` is False: a full collection takes about half a second in a process
    with Gradio loaded), then let glibc give freed heap pages back to the system, so resident memory falls too.

    Large tensors freed by PyTorch on a CPU often stay in malloc's arenas (the process keeps them resident); a
    trim after freeing models, after the float copy behind an int8 draft, or after a race, returns them.
    """
    if collect:
        gc.collect()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def resident_gb() -> float | None:
    """This process's resident memory (VmRSS) in GB, or None where /proc is not available."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024**2
    except (OSError, ValueError, IndexError):
        pass
    return None
