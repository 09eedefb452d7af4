"""Clocks for timing device work. The decoding loop takes any callable returning seconds, so a simulator can run
the same loop on simulated time (see :class:`SimulatedClock`)."""

from __future__ import annotations

import logging
import time
from fractions import Fraction
from typing import Callable

import torch

logger = logging.getLogger(__name__)

#: what the decoding loop reads the time from: seconds, any origin (only differences count)
Clock = Callable[[], float]


def now(device: torch.device) -> float:
    """Wall clock for timing device work; on CUDA waits for queued kernels first."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()
    return time.perf_counter()


def device_clock(device: torch.device) -> Clock:
    """The wall clock of :func:`now` for ``device``."""
    return lambda: now(device)


class Instant(float):
    """A reading of a :class:`SimulatedClock`: a float whose difference with another reading is the exact
    simulated time between them (no rounding from the time accumulated before)."""

    exact: Fraction

    def __new__(cls, exact: Fraction) -> "Instant":
        instant = super().__new__(cls, float(exact))
        instant.exact = exact
        return instant

    def __sub__(self, other: float) -> float:  # type: ignore[override]
        if isinstance(other, Instant):
            return float(self.exact - other.exact)
        return float(self) - other


class SimulatedClock:
    """Simulated time: it moves only when :meth:`advance` is called (by a stub model, for each pass it "runs")."""

    def __init__(self) -> None:
        self._time = Fraction(0)

    def advance(self, seconds: float) -> None:
        self._time += Fraction(seconds)

    def __call__(self) -> Instant:
        return Instant(self._time)
