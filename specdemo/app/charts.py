"""The app's charts as the data frames Gradio plots: the race, tokens per pass, acceptance by position, the cost
of a pass on this machine."""

from __future__ import annotations

import logging
from typing import Any

import gradio as gr
import pandas as pd

from ..core.economics import CostCurve
from ..core.events import Counters
from ..session.racer import Prepared
from ..session.state import RaceState

logger = logging.getLogger(__name__)

SIDE_LABELS = {"plain": "plain", "spec": "speculative"}
SIDE_COLOURS = {"plain": "#9ca3af", "speculative": "#16a34a"}
COST_COLOURS = {"one-token pass (plain decoding)": "#9ca3af", "can pay": "#16a34a", "cannot pay": "#dc2626"}


def race_frame(state: RaceState) -> pd.DataFrame:
    """Tokens over own compute time, both sides: the race."""
    rows = [
        {"seconds": seconds, "tokens": tokens, "side": SIDE_LABELS[pane.side]}
        for pane in (state.plain, state.spec)
        for seconds, tokens in pane.points
    ]
    return pd.DataFrame(rows, columns=["seconds", "tokens", "side"])


def accepted_length_frame(counters: Counters) -> pd.DataFrame:
    """How many rounds produced 1, 2, 3, ... tokens per target pass (bonus/correction included)."""
    lengths = counters.accepted_lengths
    if not lengths:
        return pd.DataFrame({"tokens per pass": pd.Series(dtype=str), "rounds": pd.Series(dtype=int)})
    top = max(lengths)
    counts = [sum(1 for n in lengths if n == k) for k in range(1, top + 1)]
    return pd.DataFrame({"tokens per pass": [str(k) for k in range(1, top + 1)], "rounds": counts})


def acceptance_position_frame(counters: Counters) -> pd.DataFrame:
    """Acceptance rate of the draft token at position 1, 2, ... of a round."""
    rates = [a / d if d else 0.0 for a, d in zip(counters.accepted_at, counters.drafted_at)]
    return pd.DataFrame(
        {
            "draft position": [str(i + 1) for i in range(len(rates))],
            "acceptance rate": rates,
            "drafted": list(counters.drafted_at),
        }
    )


def cost_frame(curve: CostCurve, draft_cost: float | None = None) -> pd.DataFrame:
    """One bar per measured pass length k: its cost in one-token passes, and whether a round of k − 1 drafts (a
    verify pass over k tokens) can beat plain decoding, with the acceptance rate it needs."""
    rows = []
    for k, relative in zip(curve.lengths, curve.relative):
        if k == 1:
            verdict, needed = "one-token pass (plain decoding)", "–"
        else:
            alpha = curve.break_even_acceptance(k - 1, draft_cost)
            verdict = "cannot pay" if alpha is None else "can pay"
            needed = "never" if alpha is None else f"{alpha:.0%} of drafts accepted"
        rows.append({"tokens in the pass": str(k), "cost (one-token passes)": round(relative, 2),
                     "speculation": verdict, "break-even": needed})
    return pd.DataFrame(rows)


def cost_plot_update(prepared: Prepared) -> Any:
    """The cost chart for a race: the machine's curve, titled with the hardware (hidden without a curve)."""
    curve = prepared.calibration
    if curve is None:
        return gr.update(value=None, visible=False)
    draft_cost = 0.0 if prepared.spec.method.drafts_for_free else None  # no draft model runs: drafting is free
    title = f"On this machine a pass over k tokens costs this much of a one-token pass ({curve.hardware.describe()}, " \
        f"{curve.dtype})"
    floor = curve.floor_seconds
    if floor is not None:
        title += (f"; a one-token pass takes {curve.seconds[0] * 1000:.0f} ms, {curve.seconds[0] / floor:.1f}x its floor "
                  f"of {floor * 1000:.0f} ms ({curve.weight_bytes / 1e9:.2f} GB of weights at "
                  f"{curve.bandwidth_bytes_per_s / 1e9:.0f} GB/s)")
    if not curve.reliable:
        title += f" - UNRELIABLE, this race only: {curve.problem}"
    return gr.update(value=cost_frame(curve, draft_cost), visible=True, title=title)
