"""The bench's report: per-mode aggregates of its per-prompt rows, the table, the verify costs, the chart.

:func:`aggregate` sums each mode's rows (tokens/s, speedup over plain, acceptance and what the cost model
expected); :func:`format_table`, :func:`format_verify_costs` and :func:`plot` show the result.
"""

from __future__ import annotations

import logging
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .backends.loading import LoadedModel
from .core.events import Counters
from .core.metrics import compare, decode_rate, decode_speedup, run_metrics, verify_cost_by_size
from .methods import METHODS

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------------------------
# modes run in several variants (``--compile on,off``)

#: between a mode and its variant in a mode's name: ``draft@on`` is draft mode with ``--compile on``
VARIANT_MARK = "@"


def split_mode(name: str) -> tuple[str, str]:
    """(mode, variant) of a bench mode's name: ``("draft", "on")`` for ``draft@on``, ``("draft", "")`` for
    ``draft``."""
    mode, _, variant = name.partition(VARIANT_MARK)
    return mode, variant


def with_variant(mode: str, variant: str) -> str:
    return f"{mode}{VARIANT_MARK}{variant}" if variant else mode


def plain_of(name: str, modes: list[str]) -> str:
    """The plain run a mode is set against: plain decoding of its own variant (for transformers' modes, which run
    once, the first plain run of the bench)."""
    mode, variant = split_mode(name)
    if variant:
        return with_variant("plain", variant)
    return "plain" if "plain" in modes else next((m for m in modes if split_mode(m)[0] == "plain"), "plain")


def is_plain(name: str) -> bool:
    return split_mode(name)[0] == "plain"


# ----------------------------------------------------------------------------------------------------------------
# aggregation


@dataclass
class _Plain:
    """Plain decoding's figures, every other mode's reference (unset until plain's rows are summed)."""

    rate: float | None = None
    decode_rate: float | None = None
    repeat_rates: list[float] = field(default_factory=list)
    counters: Counters | None = None


def repeat_rates(rows: list[dict]) -> list[float]:
    """Tokens per second of each repeat over all ``rows`` (repeat i of every prompt together), so the spread of a
    speedup between repeats shows beside its median."""
    per_repeat = zip(zip(*(r["new_tokens_all_repeats"] for r in rows)), zip(*(r["seconds_all_repeats"] for r in rows)))
    return [sum(tokens) / sum(seconds) if sum(seconds) > 0 else 0.0 for tokens, seconds in per_repeat]


def plain_step_seconds(results: list[dict], plain: str | None = None) -> float | None:
    """Seconds per plain decoding step over a run's rows of the plain mode ``plain`` (default: the bench's first
    plain run), the prompt pass and its first token left out."""
    plain = plain or plain_of("plain", list(dict.fromkeys(r["mode"] for r in results)))
    rows = [r for r in results if r["mode"] == plain and r.get("prefill_seconds") is not None]
    steps = sum(len(r["new_token_ids"]) - 1 for r in rows)
    seconds = sum(r["seconds"] - r["prefill_seconds"] for r in rows)
    return seconds / steps if steps > 0 and seconds > 0 else None


def _totals(rows: list[dict]) -> tuple[dict[str, Any], float | None, float | None]:
    """A mode's entry with its totals over ``rows`` (the other figures None), its prompt passes' seconds and its
    rate after them (both None where the runs do not time their prompt pass)."""
    tokens = sum(len(r["new_token_ids"]) for r in rows)
    seconds = sum(r["seconds"] for r in rows)
    # the engine's runs time their prompt pass; generate()'s (the hf-* modes) do not
    timed = all(r.get("prefill_seconds") is not None for r in rows)
    prefill_seconds = sum(r["prefill_seconds"] for r in rows) if timed else None
    rate_after_prefill = None
    if prefill_seconds is not None:
        rate_after_prefill = decode_rate(tokens, seconds, prefill_seconds, runs=len(rows))
    entry: dict[str, Any] = {
        "prompts": len(rows),
        "new_tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
        "speedup": None,
        "decode_speedup": None,
        "acceptance_rate": None,
        "mean_accepted_length": None,
        "alpha": None,
        "expected_speedup": None,
        "fraction_of_expected": None,
        "identical": sum(1 for r in rows if r["identical"]),  # prompts whose output is plain's
        "per_prompt_speedup_min": None,
        "speedup_by_repeat": None,
    }
    return entry, prefill_seconds, rate_after_prefill


def _add_speedups(
    entry: dict[str, Any], mode: str, rows: list[dict], rate_after_prefill: float | None, rates: list[float],
    plain: _Plain,
) -> None:
    """The mode's speedups over plain: overall, after the prompt pass, its slowest prompt's and per repeat."""
    entry["speedup"] = entry["tokens_per_s"] / plain.rate
    entry["decode_speedup"] = decode_speedup(rate_after_prefill, plain.decode_rate)
    per_prompt = [r["speedup"] for r in rows if r.get("speedup") is not None]
    entry["per_prompt_speedup_min"] = min(per_prompt) if per_prompt else None
    if not is_plain(mode):  # repeat i of this mode ran beside repeat i of plain (the same prompts, interleaved)
        entry["speedup_by_repeat"] = [
            rate_i / plain_i if plain_i > 0 else None for rate_i, plain_i in zip(rates, plain.repeat_rates)
        ]


def _add_drafting(entry: dict[str, Any], mode: str, total: Counters, plain_counters: Counters | None) -> None:
    """A speculative mode's drafting figures from its counters, and against plain's what the cost model expected."""
    metrics = run_metrics(total)
    entry["acceptance_rate"] = metrics.acceptance_rate
    entry["mean_accepted_length"] = metrics.mean_accepted_length
    entry["alpha"] = metrics.alpha
    entry["acceptance_by_position"] = metrics.acceptance_by_position
    entry["mean_draft_length"] = metrics.mean_draft_length  # for a tree: its nodes per round
    entry["tokens_per_target_pass"] = total.new_tokens / total.target_passes if total.target_passes else None
    if total.accepted_by_source:  # a drafter with several parts (EAGLE's head and its lookup branch)
        entry["accepted_by_source"] = dict(sorted(total.accepted_by_source.items()))
    if METHODS[split_mode(mode)[0]].needs_hidden_states:  # heads on the target: head k's acceptance, given the heads before
        entry["per_head_acceptance"] = metrics.conditional_acceptance
    if plain_counters is None:
        return
    plain_metrics = run_metrics(plain_counters)
    comparison = compare(metrics, plain_metrics)
    entry["expected_speedup"] = comparison.expected_speedup
    entry["expected_decode_speedup"] = comparison.expected_decode_speedup
    entry["expected_decode_speedup_iid"] = comparison.expected_decode_speedup_iid
    entry["conditional_acceptance"] = metrics.conditional_acceptance
    entry["draft_cost"] = comparison.draft_cost
    entry["verify_cost"] = comparison.verify_cost
    by_size = verify_cost_by_size(total, plain_metrics.seconds_per_round)
    entry["verify_cost_by_size"] = {str(size): cost for size, (cost, _) in by_size.items()}
    entry["verify_passes_by_size"] = {str(size): passes for size, (_, passes) in by_size.items()}
    if entry["speedup"] and comparison.expected_speedup:
        entry["fraction_of_expected"] = entry["speedup"] / comparison.expected_speedup


def aggregate(results: list[dict], modes: list[str], counters: dict[tuple[str, str], Counters]) -> dict[str, dict]:
    """Per mode: tokens/s over all its prompts, speedup against plain (and per repeat), acceptance, accepted
    length. Modes run in several variants are each set against their own variant's plain run, and every mode's
    ``speedup_vs`` gives its rate over each variant's plain rate too."""
    summary: dict[str, dict] = {}
    plains: dict[str, _Plain] = {}
    for mode in sorted(modes, key=lambda name: not is_plain(name)):  # every plain first: the others' reference
        rows = [r for r in results if r["mode"] == mode]
        if not rows:
            continue
        entry, prefill_seconds, rate_after_prefill = _totals(rows)
        rates = repeat_rates(rows)
        mode_counters = [counters[(r["id"], mode)] for r in rows if (r["id"], mode) in counters]
        if is_plain(mode):
            plain_counters = Counters.total(mode_counters) if mode_counters else None
            plains[mode] = _Plain(entry["tokens_per_s"], rate_after_prefill, rates, plain_counters)
            entry["mean_accepted_length"] = 1.0
            seconds = entry["seconds"]
            entry["prefill_share"] = prefill_seconds / seconds if prefill_seconds is not None and seconds > 0 else None
        plain = plains.get(plain_of(mode, modes), _Plain())
        if plain.rate:
            _add_speedups(entry, mode, rows, rate_after_prefill, rates, plain)
        if mode_counters and not is_plain(mode):
            _add_drafting(entry, mode, Counters.total(mode_counters), plain.counters)
        summary[mode] = entry
    if len(plains) > 1:  # modes in several variants: each mode's rate over every variant's plain rate
        for entry in summary.values():
            entry["speedup_vs"] = {name: entry["tokens_per_s"] / plain.rate for name, plain in plains.items()
                                   if plain.rate}
    return {mode: summary[mode] for mode in modes if mode in summary}


def environment(target: LoadedModel) -> dict[str, Any]:
    """The versions, machine and time a report was measured with."""
    import transformers

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": str(target.device),
        "dtype": target.format,
        "cpu_threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


# ----------------------------------------------------------------------------------------------------------------
# showing it


def _fmt(value: Any, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _spread(speedups: list[float | None] | None) -> str:
    """The lowest and highest speedup among repeats ("0.91-1.02x"); "-" for a single repeat or none."""
    values = [v for v in speedups or () if v is not None]
    if len(values) < 2:
        return "-"
    return f"{min(values):.2f}-{max(values):.2f}x"


def _table_row(category: str, mode: str, e: dict) -> str:
    return (
        f"{category:<16} {mode:<12} {_fmt(e['tokens_per_s'], '.2f'):>7} {_fmt(e['speedup'], '.2f', 'x'):>8} "
        f"{_spread(e.get('speedup_by_repeat')):>11} "
        f"{_fmt(e.get('decode_speedup'), '.2f', 'x'):>7} {_fmt(e.get('mean_draft_length'), '.1f'):>7} "
        f"{_fmt(e['acceptance_rate'], '.0%'):>7} {_fmt(e['mean_accepted_length'], '.2f'):>7} "
        f"{_fmt(e['expected_speedup'], '.2f', 'x'):>7} {e['identical']:>3}/{e['prompts']:<2}"
    )


def format_table(summary: dict[str, dict], by_category: dict[str, dict[str, dict]]) -> str:
    """One line per category and mode, then one per mode over all prompts ("ALL")."""
    header = (
        f"{'category':<16} {'mode':<12} {'tok/s':>7} {'speedup':>8} {'repeats':>11} {'decode':>7} {'drafted':>7} "
        f"{'accept':>7} {'acc.len':>7} {'expect':>7} {'same':>6}"
    )
    lines = [header, "-" * len(header)]
    for category, modes in by_category.items():
        for mode, entry in modes.items():
            lines.append(_table_row(category, mode, entry))
    lines.append("-" * len(header))
    for mode, entry in summary.items():
        lines.append(_table_row("ALL", mode, entry))
    return "\n".join(lines)


def format_verify_costs(summary: dict[str, dict], calibration: dict | None) -> str:
    """What a verify pass over n tokens cost in plain steps, per speculative mode as its run met it, under the
    calibrated curve the drafters started from (empty when no mode has the figures)."""
    lines = []
    for mode, entry in summary.items():
        costs, passes = entry.get("verify_cost_by_size"), entry.get("verify_passes_by_size") or {}
        if costs:
            figures = ", ".join(f"{size}: {cost:.2f} ({passes.get(size, 0)})" for size, cost in costs.items())
            lines.append(f"  {mode:<12} {figures}")
    if not lines:
        return ""
    if calibration and calibration.get("relative"):
        pairs = zip(calibration["lengths"], calibration["relative"])
        figures = ", ".join(f"{size}: {cost:.2f}" for size, cost in pairs)
        lines.append(f"  {'calibrated':<12} {figures} (after {calibration.get('prefix_tokens')} tokens)")
    return "verify pass cost in plain steps, by tokens in the pass (number of passes):\n" + "\n".join(lines)


def plot(summary: dict[str, dict], by_category: dict[str, dict[str, dict]], path: Path) -> None:
    """A PNG of speedup and acceptance per category and mode (plain left out), written atomically to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m in summary if not is_plain(m)]
    categories = list(by_category) + ["ALL"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(1, len(modes))
    for i, mode in enumerate(modes):
        values = [summary.get(mode) if c == "ALL" else by_category[c].get(mode) for c in categories]
        speedups = [(v or {}).get("speedup") or 0.0 for v in values]
        xs = [j + i * width for j in range(len(categories))]
        axes[0].bar(xs, speedups, width, label=mode)
        acceptance = [(v or {}).get("acceptance_rate") or 0.0 for v in values]
        axes[1].bar(xs, acceptance, width, label=mode)
    for ax, title in zip(axes, ["speedup over plain (tokens/s ratio)", "acceptance rate"]):
        ax.set_xticks([j + width * (len(modes) - 1) / 2 for j in range(len(categories))])
        ax.set_xticklabels(categories, rotation=30, ha="right")
        ax.set_title(title)
        ax.legend(fontsize=8)
    axes[0].axhline(1.0, color="black", linewidth=0.8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(temp, dpi=110)
    plt.close(fig)
    os.replace(temp, path)
