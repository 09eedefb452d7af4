"""One generator advances two decoders fairly (FastChat arena style).

It always steps the side that has used less compute time so far. Each decoder times only its own work, so the
panes fill at the speed each would have alone and the faster one finishes first by the true ratio.
"""

from __future__ import annotations

from typing import Iterator

from ..core.events import RoundEvent


def race(plain: Iterator[RoundEvent], spec: Iterator[RoundEvent]) -> Iterator[RoundEvent]:
    """Yield events from both decoders, interleaved by compute time used; ends when both have finished."""
    sides: dict[str, Iterator[RoundEvent]] = {"plain": plain, "spec": spec}
    used = {"plain": 0.0, "spec": 0.0}
    running = ["plain", "spec"]
    try:
        while running:
            side = min(running, key=used.__getitem__)
            event = next(sides[side], None)
            if event is None:
                running.remove(side)
                continue
            used[side] = event.counters.seconds
            yield event
            if event.finished:
                running.remove(side)
    finally:
        for generator in sides.values():
            close = getattr(generator, "close", None)
            if close is not None:
                close()
