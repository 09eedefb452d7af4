"""``python -m specdemo.bench``: measure plain vs speculative decoding on a prompt set, fairly.

Every mode runs on every prompt with the same settings, modes interleaved per prompt (their order rotates), after
a warm-up; each side is timed only around its own work. Results: a table, a JSON file and optionally a plot.

The bench goes through the session as the app and the recorder do: the same parsers and limits
(:mod:`specdemo.session.request`), the same warm-up, calibration call and divergence check
(:mod:`specdemo.session.racer`), and each per-prompt entry is the one results schema
(:class:`~specdemo.session.results.RunResult`) with the bench's own fields around it.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from tqdm.auto import tqdm

from .backends.loading import (
    LoadedModel,
    LoadSettings,
    ModelLoadError,
    draft_dtype,
    load_model,
    resolve_device,
    resolve_format,
)
from .backends.offline import OfflinePackError
from .core.clock import now
from .core.economics import CostCurve
from .core.errors import InputError
from .core.events import Counters, RoundEvent
from .core.files import write_json_atomic
from .core.loop import collect
from .core.metrics import compare, decode_rate, decode_speedup, run_metrics, verify_cost_by_size
from .core.settings import GenerationSettings, SamplingSettings
from .methods import MAX_NUM_DRAFT_TOKENS, METHODS, SpecSettings, check_pair, describe_methods
from .methods.ngram import NGRAM_PREFERENCES
from .session.calibration import FormatChoice, choose_format, refresh_if_stale
from .session.config import WARMUP_TOKENS
from .session.pipeline import encode_prompt, plain_events, spec_events
from .session.presets import PRESETS, default_preset_key, get_preset, preset_eagle_head
from .session.prompts import Prompt, PromptFileError, load_prompts
from .session.racer import calibrate_pair, compare_outputs, warm_up
from .session.request import (
    DTYPES,
    MAX_NEW_TOKENS,
    QUANTIZATIONS,
    check_lengths,
    parse_max_new_tokens,
    parse_num_draft_tokens,
)
from .session.results import Divergence, RunResult, rate_ratio

logger = logging.getLogger(__name__)

#: transformers' own implementations, run in the same process for comparison
HF_MODES = {
    "hf-plain": "model.generate(do_sample=...) (stock baseline)",
    "hf-assisted": "model.generate(assistant_model=draft), transformers' defaults",
    "hf-lookup": "model.generate(prompt_lookup_num_tokens=N)",
    "hf-uag": "model.generate(assistant_model=draft, tokenizer=..., assistant_tokenizer=...) (different tokenizers)",
}
ALL_MODES = ["plain", *METHODS, *HF_MODES]


@dataclass
class ModeRun:
    """One timed run of one mode on one prompt."""

    ids: list[int]
    text: str
    seconds: float
    counters: Counters | None  # None for transformers' own generate


@dataclass
class BenchConfig:
    target: str
    draft: str | None
    modes: list[str]
    prompts: str
    max_new_tokens: int
    num_draft_tokens: str | int
    max_num_draft_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    dtype: str
    device: str
    warmup: int
    repeats: int
    chat: bool
    hf_lookup_tokens: int
    limit: int | None = None
    per_category: int | None = None
    categories: list[str] | None = None
    uag_draft: str | None = None
    draft_settings: dict[str, Any] = field(default_factory=dict)  # draft head, int8, n-gram sizes and rule, heads
    extra: dict[str, Any] = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------------------------
# running one mode


def _hf_generation_config(target: LoadedModel, settings: GenerationSettings):
    from transformers import GenerationConfig

    sampling = settings.sampling
    config = GenerationConfig(
        max_new_tokens=settings.max_new_tokens,
        do_sample=not sampling.greedy,
        eos_token_id=target.eos_token_ids or None,
        pad_token_id=(target.eos_token_ids or [0])[0],
    )
    if not sampling.greedy:
        config.temperature = sampling.temperature
        config.top_p = sampling.top_p
        config.top_k = sampling.top_k or None
    else:
        config.temperature = None
        config.top_p = None
        config.top_k = None
    return config


def _run_hf(
    mode: str,
    target: LoadedModel,
    draft: LoadedModel | None,
    prompt_ids: list[int],
    settings: GenerationSettings,
    lookup_tokens: int,
) -> ModeRun:
    kwargs: dict[str, Any] = {}
    if mode == "hf-assisted":
        if draft is None:
            raise InputError("hf-assisted needs a draft model")
        kwargs["assistant_model"] = draft.model
    elif mode == "hf-lookup":
        kwargs["prompt_lookup_num_tokens"] = lookup_tokens
    elif mode == "hf-uag":
        if draft is None:
            raise InputError("hf-uag needs a draft model")
        kwargs.update(assistant_model=draft.model, tokenizer=target.tokenizer, assistant_tokenizer=draft.tokenizer)
    input_ids = torch.tensor([prompt_ids], device=target.device)
    if settings.sampling.seed is not None:
        torch.manual_seed(settings.sampling.seed)  # transformers samples from the global RNG (bench process only)
    start = now(target.device)
    with torch.inference_mode():
        out = target.model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            generation_config=_hf_generation_config(target, settings),
            **kwargs,
        )
    seconds = now(target.device) - start
    ids = out[0, len(prompt_ids) :].tolist()
    return ModeRun(ids, target.tokenizer.decode(ids, skip_special_tokens=True), seconds, None)


def drafts_with_other_tokenizer(mode: str) -> bool:
    """Whether ``mode`` drafts with a model of another tokenizer (``--uag-draft`` when given)."""
    return mode == "hf-uag" or (mode in METHODS and METHODS[mode].other_tokenizer)


def needs_draft_model(mode: str) -> bool:
    return mode in ("hf-assisted", "hf-uag") or (mode in METHODS and METHODS[mode].needs_draft_model)


def mode_draft(mode: str, draft: LoadedModel | None, uag_draft: LoadedModel | None) -> LoadedModel | None:
    """The draft ``mode`` drafts with: ``--uag-draft`` for a mode of another tokenizer when given, else ``--draft``."""
    return uag_draft if drafts_with_other_tokenizer(mode) and uag_draft is not None else draft


def run_mode(
    mode: str,
    target: LoadedModel,
    draft: LoadedModel | None,
    prompt_ids: list[int],
    settings: GenerationSettings,
    spec: SpecSettings,
    lookup_tokens: int = 10,
    uag_draft: LoadedModel | None = None,
    calibration: CostCurve | None = None,
) -> ModeRun:
    draft = mode_draft(mode, draft, uag_draft)
    if mode in HF_MODES:
        return _run_hf(mode, target, draft, prompt_ids, settings, lookup_tokens)

    # wall clock around the whole run, bookkeeping and detokenization included, as for the transformers modes
    start = now(target.device)
    if mode == "plain":
        final: RoundEvent = collect(plain_events(target, prompt_ids, settings))
    else:
        mode_spec = replace(spec, mode=mode)
        final = collect(spec_events(target, draft, prompt_ids, settings, mode_spec, calibration))
    seconds = now(target.device) - start
    return ModeRun(final.new_token_ids, final.text, seconds, final.counters)


# ----------------------------------------------------------------------------------------------------------------
# aggregation


def repeat_rates(rows: list[dict]) -> list[float]:
    """Tokens per second of each repeat over all ``rows`` (repeat i of every prompt together), so the spread of a
    speedup between repeats shows beside its median."""
    per_repeat = zip(zip(*(r["new_tokens_all_repeats"] for r in rows)), zip(*(r["seconds_all_repeats"] for r in rows)))
    return [sum(tokens) / sum(seconds) if sum(seconds) > 0 else 0.0 for tokens, seconds in per_repeat]


def plain_step_seconds(results: list[dict]) -> float | None:
    """Seconds per plain decoding step over a run's plain rows (the prompt pass and its first token left out)."""
    rows = [r for r in results if r["mode"] == "plain" and r.get("prefill_seconds") is not None]
    steps = sum(len(r["new_token_ids"]) - 1 for r in rows)
    seconds = sum(r["seconds"] - r["prefill_seconds"] for r in rows)
    return seconds / steps if steps > 0 and seconds > 0 else None


def aggregate(results: list[dict], modes: list[str], counters: dict[tuple[str, str], Counters]) -> dict[str, dict]:
    """Per mode: tokens/s over all its prompts, speedup against plain (and per repeat), acceptance, accepted
    length."""
    summary: dict[str, dict] = {}
    plain_rate = None
    plain_repeat_rates: list[float] = []
    plain_decode_rate = None
    plain_counters = None
    for mode in modes:
        rows = [r for r in results if r["mode"] == mode]
        if not rows:
            continue
        tokens = sum(len(r["new_token_ids"]) for r in rows)
        seconds = sum(r["seconds"] for r in rows)
        rate = tokens / seconds if seconds > 0 else 0.0
        # the engine's runs time their prompt pass; generate()'s (the hf-* modes) do not
        timed = all(r.get("prefill_seconds") is not None for r in rows)
        prefill_seconds = sum(r["prefill_seconds"] for r in rows) if timed else None
        mode_decode_rate = None
        if prefill_seconds is not None:
            mode_decode_rate = decode_rate(tokens, seconds, prefill_seconds, runs=len(rows))
        entry: dict[str, Any] = {
            "prompts": len(rows),
            "new_tokens": tokens,
            "seconds": seconds,
            "tokens_per_s": rate,
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
        mode_repeat_rates = repeat_rates(rows)
        mode_counters = [counters[(r["id"], mode)] for r in rows if (r["id"], mode) in counters]
        if mode == "plain":
            plain_rate = rate
            plain_decode_rate = mode_decode_rate
            plain_repeat_rates = mode_repeat_rates
            entry["mean_accepted_length"] = 1.0
            entry["prefill_share"] = prefill_seconds / seconds if prefill_seconds is not None and seconds > 0 else None
            plain_counters = Counters.total(mode_counters) if mode_counters else None
        if plain_rate:
            entry["speedup"] = rate / plain_rate
            entry["decode_speedup"] = decode_speedup(mode_decode_rate, plain_decode_rate)
            per_prompt = [r["speedup"] for r in rows if r.get("speedup") is not None]
            entry["per_prompt_speedup_min"] = min(per_prompt) if per_prompt else None
            if mode != "plain":  # repeat i of this mode ran beside repeat i of plain (the same prompts, interleaved)
                entry["speedup_by_repeat"] = [
                    rate_i / plain_i if plain_i > 0 else None
                    for rate_i, plain_i in zip(mode_repeat_rates, plain_repeat_rates)
                ]
        if mode_counters and mode != "plain":
            metrics = run_metrics(Counters.total(mode_counters))
            entry["acceptance_rate"] = metrics.acceptance_rate
            entry["mean_accepted_length"] = metrics.mean_accepted_length
            entry["alpha"] = metrics.alpha
            entry["acceptance_by_position"] = metrics.acceptance_by_position
            entry["mean_draft_length"] = metrics.mean_draft_length  # for a tree: its nodes per round
            total = Counters.total(mode_counters)
            entry["tokens_per_target_pass"] = total.new_tokens / total.target_passes if total.target_passes else None
            if total.accepted_by_source:  # a drafter with several parts (EAGLE's head and its lookup branch)
                entry["accepted_by_source"] = dict(sorted(total.accepted_by_source.items()))
            if METHODS[mode].needs_hidden_states:  # heads on the target: head k's acceptance, given the heads before
                entry["per_head_acceptance"] = metrics.conditional_acceptance
            if plain_counters is not None:
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
        summary[mode] = entry
    return summary


def _fmt(value: Any, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _spread(speedups: list[float | None] | None) -> str:
    """The lowest and highest speedup among repeats ("0.91-1.02x"); "-" for a single repeat or none."""
    values = [v for v in speedups or () if v is not None]
    if len(values) < 2:
        return "-"
    return f"{min(values):.2f}-{max(values):.2f}x"


def format_table(summary: dict[str, dict], by_category: dict[str, dict[str, dict]]) -> str:
    header = (
        f"{'category':<16} {'mode':<12} {'tok/s':>7} {'speedup':>8} {'repeats':>11} {'decode':>7} {'drafted':>7} "
        f"{'accept':>7} {'acc.len':>7} {'expect':>7} {'same':>6}"
    )
    lines = [header, "-" * len(header)]

    def row(category: str, mode: str, e: dict) -> str:
        return (
            f"{category:<16} {mode:<12} {_fmt(e['tokens_per_s'], '.2f'):>7} {_fmt(e['speedup'], '.2f', 'x'):>8} "
            f"{_spread(e.get('speedup_by_repeat')):>11} "
            f"{_fmt(e.get('decode_speedup'), '.2f', 'x'):>7} {_fmt(e.get('mean_draft_length'), '.1f'):>7} "
            f"{_fmt(e['acceptance_rate'], '.0%'):>7} {_fmt(e['mean_accepted_length'], '.2f'):>7} "
            f"{_fmt(e['expected_speedup'], '.2f', 'x'):>7} {e['identical']:>3}/{e['prompts']:<2}"
        )

    for category, modes in by_category.items():
        for mode, entry in modes.items():
            lines.append(row(category, mode, entry))
    lines.append("-" * len(header))
    for mode, entry in summary.items():
        lines.append(row("ALL", mode, entry))
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m in summary if m != "plain"]
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


# ----------------------------------------------------------------------------------------------------------------
# the benchmark


def run_benchmark(
    config: BenchConfig,
    target: LoadedModel,
    draft: LoadedModel | None,
    prompts: list[Prompt],
    spec: SpecSettings,
    progress: bool = True,
    uag_draft: LoadedModel | None = None,
    calibration: CostCurve | None = None,
) -> dict:
    sampling = SamplingSettings(config.temperature, config.top_k, config.top_p, config.seed)
    settings = GenerationSettings(max_new_tokens=config.max_new_tokens, sampling=sampling, collect_probs=False)
    encoded = [(p, encode_prompt(target, p.text, chat=config.chat)) for p in prompts]
    for prompt, ids in encoded:
        try:
            check_lengths(target, ids, settings)
        except InputError as error:
            raise InputError(f"prompt {prompt.id}: {error}") from None
    modes = config.modes

    # the session's warm-up (the app's and the recorder's too) for the engine's modes, generate() for the hf-* ones
    tokens = min(WARMUP_TOKENS, config.max_new_tokens)
    warm = GenerationSettings(max_new_tokens=tokens, sampling=sampling, collect_probs=False)
    for _ in range(config.warmup):
        for mode in modes:
            if mode in HF_MODES:
                run_mode(mode, target, draft, encoded[0][1], warm, spec, config.hf_lookup_tokens, uag_draft)
            elif mode == "plain":
                warm_up(target, None, encoded[0][1], sampling, None, tokens)
            else:
                warm_up(target, mode_draft(mode, draft, uag_draft), encoded[0][1], sampling, replace(spec, mode=mode),
                        tokens, plain=False)

    results: list[dict] = []
    counters: dict[tuple[str, str], Counters] = {}
    bar = tqdm(total=len(encoded) * len(modes) * config.repeats, desc="bench", unit="run", disable=not progress)
    for index, (prompt, ids) in enumerate(encoded):
        order = modes[index % len(modes) :] + modes[: index % len(modes)]  # rotate: no mode always goes first
        runs: dict[str, list[ModeRun]] = {m: [] for m in modes}
        for _ in range(config.repeats):
            for mode in order:
                runs[mode].append(
                    run_mode(mode, target, draft, ids, settings, spec, config.hf_lookup_tokens, uag_draft, calibration)
                )
                bar.update(1)
        chosen = {m: sorted(r, key=lambda run: run.seconds)[len(r) // 2] for m, r in runs.items()}  # median
        plain = chosen.get("plain")
        for mode in modes:
            run = chosen[mode]
            identical = parted = speedup = decode = None
            if plain is not None:
                position, margin = compare_outputs(target, ids, plain.ids, run.ids, sampling.greedy)
                identical = position is None
                parted = None if position is None else Divergence(position, margin)
                speedup = rate_ratio(len(run.ids), run.seconds, len(plain.ids), plain.seconds)
                if run.counters is not None and plain.counters is not None:
                    decode = decode_speedup(
                        decode_rate(len(run.ids), run.seconds, run.counters.prefill_seconds),
                        decode_rate(len(plain.ids), plain.seconds, plain.counters.prefill_seconds),
                    )
            result = RunResult.of(run.counters, len(run.ids), run.seconds, identical, parted, speedup)
            entry: dict[str, Any] = {
                "id": prompt.id,
                "category": prompt.category,
                "mode": mode,
                "prompt_tokens": len(ids),
                **result.as_dict(),
                "new_token_ids": run.ids,
                "text": run.text,
                "seconds_all_repeats": [r.seconds for r in runs[mode]],
                "new_tokens_all_repeats": [len(r.ids) for r in runs[mode]],
                "tokens_per_s": len(run.ids) / run.seconds if run.seconds > 0 else 0.0,
                "decode_speedup": decode,
            }
            if mode == "plain":
                entry["prompt_ids"] = list(ids)  # lets `python -m specdemo.replay` replay drafting rules offline
            if run.counters is not None:
                counters[(prompt.id, mode)] = run.counters
            results.append(entry)
    bar.close()

    summary = aggregate(results, modes, counters)
    by_category: dict[str, dict[str, dict]] = {}
    for category in dict.fromkeys(p.category for p, _ in encoded):
        rows = [r for r in results if r["category"] == category]
        by_category[category] = aggregate(rows, modes, counters)
    return {
        "config": asdict(config),
        "environment": environment(target),
        "results": results,
        "summary": summary,
        "by_category": by_category,
    }


def environment(target: LoadedModel) -> dict[str, Any]:
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m specdemo.bench",
        description="Benchmark plain vs speculative decoding (exact output, fair timing).",
    )
    parser.add_argument("--pair", help=f"pair preset: {', '.join(PRESETS)} (default: offline pair if installed)")
    parser.add_argument("--target", help="target model: offline:NAME, Hub id, local folder or .gguf file")
    parser.add_argument("--draft", help="draft model (same sources as --target)")
    parser.add_argument("--uag-draft", help="draft for the uag/hf-uag modes when it differs from --draft (a model with another tokenizer)")
    parser.add_argument("--modes", default="plain,draft,ngram", help=f"comma list from: {', '.join(ALL_MODES)}")
    parser.add_argument("--prompts", help="JSON-lines prompt file (Spec-Bench or {id,category,prompt}); default: bundled set")
    parser.add_argument("--categories", help="comma list of categories to keep")
    parser.add_argument("--per-category", type=int, help="keep the first N prompts of each category (a balanced sample)")
    parser.add_argument("--limit", type=int, help="keep the first N prompts (after --categories and --per-category)")
    parser.add_argument("--max-new-tokens", default="128", help=f"new tokens per run (1 to {MAX_NEW_TOKENS})")
    parser.add_argument(
        "--num-draft-tokens", default="adaptive",
        help=f"k (1 to {MAX_NUM_DRAFT_TOKENS}), 'adaptive' (cost-aware) or 'heuristic' (+2/-1)",
    )
    parser.add_argument(
        "--max-num-draft-tokens", type=int, default=12,
        help=f"the most an adaptive policy drafts in one round (at most {MAX_NUM_DRAFT_TOKENS})",
    )
    parser.add_argument("--draft-head-tokens", type=int, default=None, help="restrict the draft LM head to N frequent ids (0 = full; default auto)")
    parser.add_argument("--draft-int8", choices=["auto", "on", "off"], default="auto", help="draft with an int8 copy of the draft model (auto: on for a CPU draft; for uag, only beside an int8 target)")
    parser.add_argument("--ngram-max", type=int, default=4)
    parser.add_argument("--ngram-min", type=int, default=1)
    parser.add_argument(
        "--ngram-prefer", choices=list(NGRAM_PREFERENCES), default="follow",
        help="which earlier occurrence an n-gram draft copies: follow (continue the last accepted copy, else the "
        "most recent), recent, or first (as transformers' prompt lookup)",
    )
    parser.add_argument(
        "--medusa-heads", help="folder of Medusa heads for the medusa modes (default: the heads shipped for the "
        "offline target); FasterDecoding's layout is accepted",
    )
    parser.add_argument(
        "--eagle-head", help="EAGLE-3 head for the eagle modes: a folder (this project's, EAGLE-3's or speculators' "
        "layout) or a Hub id (default: the head shipped for the target, or the pair preset's)",
    )
    parser.add_argument(
        "--eagle-lookup", choices=["on", "off"], default="on", help="the eagle mode's tree also holds prompt lookup's "
        "continuation as one more branch (the --ngram-* settings choose it); off: the head's candidates alone",
    )
    parser.add_argument("--hf-lookup-tokens", type=int, default=10, help="prompt_lookup_num_tokens for hf-lookup")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=list(DTYPES),
        help="the target's format: auto (on a CPU, measured: the fastest plain decoding among w8a8, int8 and bfloat16 "
        "where speculation can pay), bfloat16, float16, float32, int8 (CPU: int8 weights, bfloat16 activations), "
        "w8a8 (CPU: int8 weights, int8 activations with a scale per token, FBGEMM)",
    )
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N, mps")
    parser.add_argument(
        "--quantization", choices=list(QUANTIZATIONS), default="none",
        help="bitsandbytes quantisation of the target (CUDA)",
    )
    parser.add_argument("--warmup", type=int, default=1, help="warm-up runs of every mode before timing")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per prompt and mode (the median is kept)")
    parser.add_argument("--raw", action="store_true", help="send prompts as raw text, without the chat template")
    parser.add_argument("--json", type=Path, help="write all results to this JSON file")
    parser.add_argument("--plot", type=Path, help="write a PNG chart of speedup and acceptance per category")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.add_argument(
        "--calibration",
        choices=["cached", "refresh", "off"],
        default="cached",
        help="the machine's cost curve (a target pass over k tokens, a draft step), printed first and written to the "
        "JSON: cached (measure once per machine, model and format, about 15 s), refresh (measure again) or off",
    )
    return parser


def _parse_modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in modes if m not in ALL_MODES]
    if unknown or not modes:
        raise InputError(f"unknown mode(s) {', '.join(unknown) or '(none)'}; choose from: {', '.join(ALL_MODES)}")
    if "plain" in modes:
        modes.remove("plain")
    return ["plain", *dict.fromkeys(modes)]  # plain always runs: every figure is relative to it


def _parsed(option: str, parse: Callable[[Any], Any], value: Any) -> Any:
    """``parse(value)``, its InputError naming ``option``."""
    try:
        return parse(value)
    except InputError as error:
        raise InputError(f"{option}: {error}") from None


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.quiet:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    try:
        modes = _parse_modes(args.modes)
        # the session's parsers: the values and limits of the app and the recorder
        max_new_tokens = _parsed("--max-new-tokens", parse_max_new_tokens, args.max_new_tokens)
        num_draft_tokens = _parsed("--num-draft-tokens", parse_num_draft_tokens, args.num_draft_tokens)
        if args.warmup < 0 or args.repeats < 1:
            raise InputError("--warmup must be >= 0 and --repeats >= 1")
        target_source, draft_source, eagle_head = args.target, args.draft, args.eagle_head
        if args.pair or not target_source:
            preset = get_preset(args.pair or default_preset_key())
            target_source = target_source or preset.target
            draft_source = draft_source or preset.draft
            eagle_head = eagle_head or preset_eagle_head(preset, target_source)
        needs_draft = any(
            needs_draft_model(m) and not (drafts_with_other_tokenizer(m) and args.uag_draft) for m in modes
        )
        categories = [c.strip() for c in args.categories.split(",")] if args.categories else None
        prompts = load_prompts(args.prompts, categories=categories, limit=args.limit, per_category=args.per_category)
        spec = SpecSettings(
            mode="draft",
            num_draft_tokens=num_draft_tokens,
            max_num_draft_tokens=args.max_num_draft_tokens,
            draft_head_tokens=args.draft_head_tokens,
            draft_int8={"auto": None, "on": True, "off": False}[args.draft_int8],
            ngram_min=args.ngram_min,
            ngram_prefer=args.ngram_prefer,
            ngram_max=args.ngram_max,
            medusa_heads=args.medusa_heads,
            eagle_head=eagle_head,
            eagle_lookup=args.eagle_lookup == "on",
        )
        spec.validate()
        SamplingSettings(args.temperature, args.top_k, args.top_p, args.seed).validate()
        quantization = QUANTIZATIONS[args.quantization]
        target_settings = LoadSettings(dtype=args.dtype, device=args.device, quantization=quantization)
        if args.calibration == "off":
            choice = FormatChoice(resolve_format(args.dtype, resolve_device(args.device)), "without calibration")
        else:
            choice = choose_format(target_source, target_settings, refresh=args.calibration == "refresh")
        print(choice.summary(), flush=True)
        target_settings = replace(target_settings, dtype=choice.format)
        load = LoadSettings(dtype=draft_dtype(choice.format), device=args.device)
        target = load_model(target_source, target_settings, progress=not args.quiet)
        draft = load_model(draft_source, load, progress=not args.quiet) if needs_draft and draft_source else None
        uag_draft = None
        if args.uag_draft and any(drafts_with_other_tokenizer(m) for m in modes):
            uag_draft = load_model(args.uag_draft, load, progress=not args.quiet)
        for mode in modes:  # a misfit pair (heads that do not fit, another tokenizer): one line before any run
            if mode in METHODS:
                check_pair(replace(spec, mode=mode), target, mode_draft(mode, draft, uag_draft))
        config = BenchConfig(
            target=target_source,
            draft=draft_source if needs_draft else None,
            uag_draft=args.uag_draft,
            modes=modes,
            prompts=str(args.prompts or "bundled"),
            max_new_tokens=max_new_tokens,
            num_draft_tokens=spec.num_draft_tokens,
            max_num_draft_tokens=spec.max_num_draft_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            dtype=target.format,
            device=str(target.device),
            warmup=args.warmup,
            repeats=args.repeats,
            chat=not args.raw,
            hf_lookup_tokens=args.hf_lookup_tokens,
            limit=args.limit,
            per_category=args.per_category,
            categories=categories,
            draft_settings={
                k: v for k, v in asdict(spec).items() if k not in ("mode", "num_draft_tokens", "max_num_draft_tokens")
            },
        )
        curve = None
        if args.calibration != "off":
            # the session's calibration call: the draft's step as the first mode that drafts with it runs it
            drafting = next((m for m in modes if m in METHODS and mode_draft(m, draft, uag_draft) is draft
                             and METHODS[m].needs_draft_model), "draft")
            curve = calibrate_pair(target, draft, replace(spec, mode=drafting), refresh=args.calibration == "refresh")
            print(curve.summary(), flush=True)
        report = run_benchmark(
            config, target, draft, prompts, spec, progress=not args.quiet, uag_draft=uag_draft, calibration=curve
        )
        report["calibration"] = curve.as_dict() if curve is not None else None
        report["format"] = choice.as_dict()
        report["methods"] = describe_methods(spec, target, modes)
        report["calibration_stale"] = refresh_if_stale(curve, plain_step_seconds(report["results"]), choice)
        if report["calibration_stale"]:
            print(f"warning: the cached cost curve is stale ({report['calibration_stale']}); it is measured again "
                  "at the next run", file=sys.stderr)
    except (InputError, PromptFileError, ModelLoadError, OfflinePackError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: nothing written", file=sys.stderr)
        return 130
    print(format_table(report["summary"], report["by_category"]))
    verify_costs = format_verify_costs(report["summary"], report.get("calibration"))
    if verify_costs:
        print(verify_costs)
    if args.json:
        write_json_atomic(args.json, report, indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        plot(report["summary"], report["by_category"], args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
