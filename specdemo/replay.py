"""Replay n-gram drafting rules offline against the greedy outputs a benchmark recorded.

Greedy speculative decoding writes exactly the plain output, so how many target passes a greedy drafter needs on
a prompt depends only on the prompt, that output and the drafter, not on timing. Replaying each rule over the
plain outputs of a ``python -m specdemo.bench`` JSON gives tokens per target pass with no timing noise, in well
under a second per rule: a fair way to compare lookup rules on a machine whose single runs swing by 10 to 30 %.

    python -m specdemo.replay bench-out/bf16-all.json --num-draft-tokens 10

The rules are our n-gram drafter with each ``prefer`` setting (n from 4 down to 1) and transformers' prompt lookup
rule (first occurrence, n from 2 down to 1), each run in the engine's own decoding loop
(:func:`specdemo.core.loop.speculative_decode`) over a stub target that writes the recorded output
(:class:`RecordedTarget`), on simulated time. The draft length is fixed, so the figures compare which tokens each
rule proposes, not the adaptive policy.

With ``--cost-curve`` (a calibration: a bench JSON's ``calibration`` field, a cached calibration file, or a recorded
curve such as ``assets/curves/avx2-only-fbgemm-int8.json``), the n-gram mode as the app runs it (the ``follow`` rule)
is replayed on that machine's costs as well: every verify pass costs what the curve says a pass over its length
costs, and the adaptive draft length decides on those costs as it would there. That gives the decode speedup (after
the prompt pass) the mode reaches on a class of CPU that is not at hand, with no timing noise:

    python -m specdemo.replay assets/bench/w8a8-code-editing-avx2-kernels-r3.json \
        --cost-curve assets/curves/avx2-only-fbgemm-int8.json
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

import torch

from .backends.loading import ModelLoadError
from .backends.offline import OfflinePackError
from .core.clock import SimulatedClock
from .core.economics import CostCurve
from .core.errors import InputError
from .core.loop import collect, speculative_decode
from .core.protocol import Drafter, DraftLengthPolicy, TargetPass
from .core.settings import GenerationSettings
from .core.tree import tree_depths
from .backends.suffix_trees import SuffixMemory, suffix_trees_available
from .methods import SpecSettings, make_spec_policy
from .methods.base import BuildContext
from .methods.draft_length import FixedDraftLength, make_policy
from .methods.ngram import NGRAM_PREFERENCES, NgramDrafter
from .session.results import read_plain_runs

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplayItem:
    """One prompt of a benchmark run: its id, category, prompt ids and the plain (greedy) output, with plain's time
    and the part of it its prompt pass took (None in JSONs written before the bench recorded it)."""

    id: str
    category: str
    prompt_ids: list[int]
    output_ids: list[int]
    seconds: float | None = None
    prefill_seconds: float | None = None


@dataclass(frozen=True)
class ReplayRun:
    """One replayed run: its target passes (the prompt pass included) and, on a cost curve, the seconds of the passes
    after the prompt pass, beside plain decoding's for the same tokens (one pass each)."""

    new_tokens: int
    passes: int
    seconds: float = 0.0
    plain_seconds: float = 0.0


class RecordedTarget:
    """A stub :class:`~specdemo.core.protocol.LanguageModel` that writes a recorded greedy output.

    Its logits (one-hot scores) put the recorded next token on top at every position of a pass, a tree's nodes at
    their depth, so greedy verification accepts exactly the draft tokens that match the output. Each pass after
    the prompt pass moves ``clock`` on by what ``cost_curve`` says a pass over its length costs (no time without a
    curve); the prompt pass is not charged (the replay compares decoding after it).
    """

    device = torch.device("cpu")

    def __init__(
        self,
        prompt_ids: Sequence[int],
        output_ids: Sequence[int],
        clock: SimulatedClock,
        cost_curve: CostCurve | None = None,
    ) -> None:
        self.sequence = [int(t) for t in prompt_ids] + [int(t) for t in output_ids]
        self.vocab_size = max(self.sequence) + 1
        self.clock = clock
        self.cost_curve = cost_curve
        self.one_pass = cost_curve.seconds[0] if cost_curve is not None else 0.0
        self.length = 0
        self._prompted = False

    def reset(self) -> None:
        self.length = 0
        self._prompted = False

    def run(
        self,
        input_ids: torch.Tensor,
        all_logits: bool = True,
        parents: Sequence[int] | None = None,
        with_hidden: bool = True,
        hidden_layers: Sequence[int] | None = None,
    ) -> TargetPass:
        count = int(input_ids.numel())
        if self._prompted:
            self.clock.advance(self.one_pass * (self.cost_curve.cost(count) if self.cost_curve is not None else 1.0))
        self._prompted = True
        depths = tree_depths(parents) if parents is not None else list(range(count))
        # the row at depth d predicts the token after position length + d
        after = [self.length + depth + 1 for depth in (depths if all_logits else depths[-1:])]
        self.length += count
        tokens = [self.sequence[p] if p < len(self.sequence) else 0 for p in after]
        logits = torch.zeros(len(tokens), self.vocab_size, dtype=torch.int8)
        logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 1
        return TargetPass(logits)

    def keep(self, num_new: int, rows: Sequence[int]) -> None:
        self.length -= num_new - len(rows)


def replay_run(
    drafter: Drafter,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    policy: DraftLengthPolicy,
    cost_curve: CostCurve | None = None,
) -> ReplayRun:
    """Greedy speculation with ``drafter`` over the recorded output, each round as long as ``policy`` asks.

    The engine's own loop (:func:`~specdemo.core.loop.speculative_decode`) runs over a :class:`RecordedTarget` on
    simulated time: the prompt pass writes the first token, then each round drafts, accepts the longest prefix that
    matches the output and adds the target's own token; no round drafts past ``len(output_ids)``. On a
    ``cost_curve`` a verify pass over n tokens costs what the curve says, and the policy is told so; drafting takes
    no simulated time (an n-gram lookup takes microseconds beside a target pass).
    """
    if not output_ids:
        return ReplayRun(0, 0)
    clock = SimulatedClock()
    target = RecordedTarget(prompt_ids, output_ids, clock, cost_curve)
    settings = GenerationSettings(max_new_tokens=len(output_ids), stop_on_eos=False, collect_probs=False)
    final = collect(speculative_decode(target, drafter, policy, prompt_ids, settings, clock=clock))
    if final.new_token_ids != [int(t) for t in output_ids]:
        raise RuntimeError("the replay did not write the recorded output")  # the stub target's logits are wrong
    counters = final.counters
    return ReplayRun(len(output_ids), counters.target_passes, counters.verify_seconds,
                     target.one_pass * (len(output_ids) - 1))


def replay_passes(drafter: Drafter, prompt_ids: Sequence[int], output_ids: Sequence[int], num_draft_tokens: int) -> int:
    """Target passes greedy speculation with ``drafter`` (``num_draft_tokens`` per round at most) needs for the output."""
    if num_draft_tokens < 0:
        raise ValueError(f"num_draft_tokens must be >= 0, got {num_draft_tokens}")
    return replay_run(drafter, prompt_ids, output_ids, FixedDraftLength(num_draft_tokens)).passes


def ngram_rules(min_n: int = 1, max_n: int = 4) -> dict[str, Callable[[], Drafter]]:
    """The rules compared: our drafter with each preference, and transformers' prompt lookup rule."""
    rules: dict[str, Callable[[], Drafter]] = {
        prefer: (lambda prefer=prefer: NgramDrafter(min_n, max_n, prefer)) for prefer in NGRAM_PREFERENCES
    }
    rules["transformers"] = lambda: NgramDrafter(1, 2, "first")
    return rules


def tokens_per_pass(
    items: Sequence[ReplayItem], rules: dict[str, Callable[[], Drafter]], num_draft_tokens: int
) -> dict[str, dict[str, float]]:
    """``{category or "ALL": {rule: new tokens / target passes}}`` over the items."""
    totals: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    for item in items:
        for name, make in rules.items():
            passes = replay_passes(make(), item.prompt_ids, item.output_ids, num_draft_tokens)
            for group in (item.category, "ALL"):
                totals[group][name][0] += len(item.output_ids)
                totals[group][name][1] += passes
    ordered = [g for g in totals if g != "ALL"] + ["ALL"]
    return {g: {name: tokens / passes for name, (tokens, passes) in totals[g].items() if passes} for g in ordered if g in totals}


def load_items(path: Path) -> list[ReplayItem]:
    """The plain results of a bench JSON, with their prompt ids (re-encoded with the run's target if absent)."""
    config, runs = read_plain_runs(path)
    if any(run.prompt_ids is None for run in runs):
        prompt_ids = _encode_again(config, [run.id for run in runs])
    else:
        prompt_ids = {run.id: run.prompt_ids for run in runs}
    items = []
    for run in runs:
        ids = prompt_ids[run.id]
        if run.prompt_tokens is not None and len(ids) != run.prompt_tokens:
            raise InputError(f"{path}: prompt {run.id} encodes to {len(ids)} tokens, the run had {run.prompt_tokens}")
        items.append(ReplayItem(run.id, run.category, list(ids), list(run.new_token_ids), run.seconds,
                                run.prefill_seconds))
    return items


def _encode_again(config: dict, ids: list[str]) -> dict[str, list[int]]:
    """Prompt ids for JSONs written before the bench recorded them: load the run's target and prompts again."""
    from .backends.loading import LoadSettings, load_model
    from .session.pipeline import encode_prompt
    from .session.prompts import load_prompts

    source, prompt_file = config.get("target"), config.get("prompts")
    if not isinstance(source, str) or not isinstance(prompt_file, str):
        raise InputError("this JSON has no prompt ids and names no target and prompt file to encode them again")
    logger.info("this JSON has no prompt ids: encoding the prompts again with %s", source)
    prompts = {p.id: p for p in load_prompts(None if prompt_file == "bundled" else prompt_file)}
    missing = [i for i in ids if i not in prompts]
    if missing:
        raise InputError(f"prompts {', '.join(missing)} are not in {prompt_file}")
    target = load_model(source, LoadSettings(device="cpu"), progress=False)
    return {i: encode_prompt(target, prompts[i].text, chat=config.get("chat", True)) for i in ids}


def format_replay(table: dict[str, dict[str, float]], num_draft_tokens: int) -> str:
    rules = list(next(iter(table.values())))
    lines = [f"tokens per target pass, greedy, k = {num_draft_tokens} (replayed; higher is better)"]
    lines.append(f"{'category':<16}" + "".join(f"{r:>14}" for r in rules))
    for group, row in table.items():
        lines.append(f"{group:<16}" + "".join(f"{row.get(r, 0.0):>14.3f}" for r in rules))
    return "\n".join(lines)


#: the fixed draft lengths a replay on a cost curve sets beside the adaptive one
CURVE_DRAFT_LENGTHS = (1, 2, 3, 4, 6, 8, 10, 12)


@dataclass(frozen=True)
class CurveRow:
    """A group of prompts replayed on a cost curve: the decode speedup (plain decoding's passes after the prompt pass
    over speculation's) with the adaptive draft length and with the best fixed one, and plain's prompt-pass share."""

    group: str
    adaptive: float
    tokens_per_pass: float
    best_fixed: float
    best_k: int
    prefill_share: float | None

    @property
    def end_to_end(self) -> float | None:
        """The speedup with the prompt pass in, that pass taking the share of plain's time it took in the run."""
        if self.prefill_share is None:
            return None
        return 1.0 / (self.prefill_share + (1.0 - self.prefill_share) / self.adaptive)


def decode_speedups_on_curve(
    items: Sequence[ReplayItem], cost_curve: CostCurve, prefill_shares: dict[str, float] | None = None,
    spec: SpecSettings | None = None,
) -> list[CurveRow]:
    """Per category and over all (``"ALL"``): the n-gram mode with ``spec``'s n-gram settings and longest draft (the
    app's and the bench's defaults if None) replayed on ``cost_curve``."""
    spec = spec or SpecSettings(mode="ngram")
    max_num_draft_tokens = spec.max_num_draft_tokens
    runs: dict[str, dict[str, list[ReplayRun]]] = defaultdict(lambda: defaultdict(list))
    for item in items:
        policies: dict[str, DraftLengthPolicy] = {
            "adaptive": make_policy("adaptive", None, max_num_draft_tokens, free_drafts=True, prior=cost_curve)
        }
        policies.update({str(k): FixedDraftLength(k) for k in CURVE_DRAFT_LENGTHS if k <= max_num_draft_tokens})
        for name, policy in policies.items():
            drafter = NgramDrafter(spec.ngram_min, spec.ngram_max, spec.ngram_prefer)
            run = replay_run(drafter, item.prompt_ids, item.output_ids, policy, cost_curve)
            for group in (item.category, "ALL"):
                runs[group][name].append(run)

    def speedup(group_runs: list[ReplayRun]) -> float:
        return sum(r.plain_seconds for r in group_runs) / max(1e-12, sum(r.seconds for r in group_runs))

    rows = []
    for group in [g for g in runs if g != "ALL"] + ["ALL"]:
        by_policy = runs[group]
        adaptive = by_policy.pop("adaptive")
        best_k = max(by_policy, key=lambda k: speedup(by_policy[k]))
        tokens = sum(r.new_tokens - 1 for r in adaptive)
        passes = sum(r.passes - 1 for r in adaptive)
        rows.append(CurveRow(group, speedup(adaptive), tokens / max(1, passes), speedup(by_policy[best_k]),
                             int(best_k), (prefill_shares or {}).get(group)))
    return rows


#: the modes a replay can run: those that draft with no model (a model's drafts depend on its weights)
REPLAYABLE_MODES = ("ngram", "suffix")


def _still_clock() -> float:
    """A clock that stands still: drafting takes no simulated time, so no cut depends on how fast it ran here."""
    return 0.0


@dataclass(frozen=True)
class ModeRow:
    """A group of prompts replayed on a cost curve in each mode as the bench and the app run it: ``{mode: (decode
    speedup after the prompt pass, tokens per target pass)}``."""

    group: str
    by_mode: dict[str, tuple[float, float]]


def check_replayable(modes: Sequence[str]) -> None:
    """Refuse, in one line, a mode the replay cannot run here."""
    unknown = [mode for mode in modes if mode not in REPLAYABLE_MODES]
    if unknown:
        raise ValueError(f"the replay runs {', '.join(REPLAYABLE_MODES)} only, not {', '.join(unknown)}")
    if "suffix" in modes and not suffix_trees_available():
        raise ValueError("the suffix mode needs arctic-inference: python3 -m pip install --no-build-isolation "
                         "--no-deps -r requirements-suffix.txt")


def compare_modes_on_curve(
    items: Sequence[ReplayItem], cost_curve: CostCurve, modes: Sequence[str] = REPLAYABLE_MODES,
    memory: bool = False, spec: SpecSettings | None = None,
) -> list[ModeRow]:
    """Per category and over all (``"ALL"``): each of ``modes`` (:data:`REPLAYABLE_MODES`) replayed on
    ``cost_curve`` with its own draft-length policy and ``spec``'s settings (the defaults if None). ``memory``:
    suffix decoding remembers each prompt's answer after it, in file order, as the bench's ``--suffix-memory on``
    does (one memory for the whole replay)."""
    spec = spec or SpecSettings()
    check_replayable(modes)
    remembered = SuffixMemory() if memory and "suffix" in modes else None
    runs: dict[str, dict[str, list[ReplayRun]]] = defaultdict(lambda: defaultdict(list))
    for item in items:
        settings = GenerationSettings(max_new_tokens=len(item.output_ids), stop_on_eos=False, collect_probs=False)
        for mode in modes:
            mode_spec = replace(spec, mode=mode)
            # the replayable modes read no model: their policy and drafter are built without a target
            policy = make_spec_policy(mode_spec, None, settings, prior=cost_curve)  # type: ignore[arg-type]
            drafter = mode_spec.method.build(BuildContext(None, None, settings, mode_spec.options(), policy,  # type: ignore[arg-type]
                                                          remembered, clock=_still_clock))
            run = replay_run(drafter, item.prompt_ids, item.output_ids, policy, cost_curve)
            for group in (item.category, "ALL"):
                runs[group][mode].append(run)
        if remembered is not None:
            remembered.remember(item.output_ids)
    rows = []
    for group in [g for g in runs if g != "ALL"] + ["ALL"]:
        by_mode = {}
        for mode, mode_runs in runs[group].items():
            seconds = max(1e-12, sum(r.seconds for r in mode_runs))
            passes = max(1, sum(r.passes - 1 for r in mode_runs))
            by_mode[mode] = (sum(r.plain_seconds for r in mode_runs) / seconds,
                             sum(r.new_tokens - 1 for r in mode_runs) / passes)
        rows.append(ModeRow(group, by_mode))
    return rows


def format_mode_rows(rows: Sequence[ModeRow], memory: bool) -> str:
    modes = list(rows[0].by_mode) if rows else []
    lines = [f"each mode as the bench runs it, replayed on the same costs (suffix memory {'on' if memory else 'off'}): "
             "decode speedup after the prompt pass, tokens per target pass",
             f"{'category':<18}" + "".join(f"{mode:>18}" for mode in modes)]
    for row in rows:
        cells = "".join(f"{f'{speedup:.3f}x {tokens:.2f}':>18}" for speedup, tokens in row.by_mode.values())
        lines.append(f"{row.group:<18}{cells}")
    return "\n".join(lines)


def format_curve_rows(rows: Sequence[CurveRow], cost_curve: CostCurve) -> str:
    relative = " / ".join(f"{r:.2f}" for r in cost_curve.relative[1:])
    lengths = "/".join(str(k) for k in cost_curve.lengths[1:])
    lines = [
        f"n-gram ('{SpecSettings().ngram_prefer}' rule, adaptive draft length), replayed on the costs of: "
        f"{cost_curve.hardware.describe()}",
        f"  {cost_curve.target} in {cost_curve.dtype}: a one-token pass {cost_curve.seconds[0] * 1000:.0f} ms; "
        f"passes over {lengths} tokens cost {relative} one-token passes",
        "decode speedup after the prompt pass (no timing noise); end to end with the prompt pass taking the share of "
        "plain's time it took in the run",
        f"{'category':<16}{'adaptive':>10}{'tok/pass':>10}{'best fixed':>12}{'end to end':>12}",
    ]
    for row in rows:
        end = f"{row.end_to_end:.2f}x" if row.end_to_end is not None else "-"
        fixed = f"{row.best_fixed:.2f}x k={row.best_k}"
        lines.append(f"{row.group:<16}{row.adaptive:>9.2f}x{row.tokens_per_pass:>10.2f}{fixed:>12}{end:>12}")
    return "\n".join(lines)


def load_cost_curve(path: Path) -> CostCurve:
    """A cost curve from a calibration file or from a bench JSON's ``calibration`` field."""
    try:
        data = json.loads(Path(path).read_text())
        if isinstance(data, dict) and "calibration" in data:
            data = data["calibration"]
        if not data:
            raise ValueError("it holds no calibration")
        return CostCurve.from_dict(data)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{path}: not a cost curve ({error})") from None


def plain_prefill_shares(items: Sequence[ReplayItem]) -> dict[str, float]:
    """Per category and over all: plain's prompt passes' share of its time in the run the items come from."""
    sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for item in items:
        if item.prefill_seconds is not None and item.seconds:
            for group in (item.category, "ALL"):
                sums[group][0] += item.prefill_seconds
                sums[group][1] += item.seconds
    return {group: prefill / total for group, (prefill, total) in sums.items() if total > 0}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specdemo.replay", description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, help="a JSON written by python -m specdemo.bench (with the plain mode)")
    parser.add_argument("--num-draft-tokens", type=int, default=10, help="draft length k, fixed (default 10)")
    parser.add_argument("--ngram-min", type=int, default=1)
    parser.add_argument("--ngram-max", type=int, default=4)
    parser.add_argument("--cost-curve", type=Path, default=None,
                        help="a calibration (a bench JSON, a cached calibration or a recorded curve): replay the "
                             "n-gram mode on that machine's costs as well, with the adaptive draft length")
    parser.add_argument("--modes", default=None,
                        help=f"with --cost-curve: also replay these modes side by side, each with its own draft-length "
                             f"policy (comma-separated, of: {', '.join(REPLAYABLE_MODES)})")
    parser.add_argument("--suffix-memory", choices=("on", "off"), default="off",
                        help="with --modes: suffix decoding remembers each answer for the prompts after it, in file "
                             "order (as the bench's --suffix-memory on); default off")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        if args.num_draft_tokens < 1:
            raise ValueError(f"--num-draft-tokens must be >= 1, got {args.num_draft_tokens}")
        rules = ngram_rules(args.ngram_min, args.ngram_max)
        cost_curve = load_cost_curve(args.cost_curve) if args.cost_curve is not None else None
        modes = [mode.strip() for mode in args.modes.split(",") if mode.strip()] if args.modes else []
        if modes and cost_curve is None:
            raise ValueError("--modes needs --cost-curve: the modes are compared on a machine's costs")
        check_replayable(modes)
        items = load_items(args.results)
        table = tokens_per_pass(items, rules, args.num_draft_tokens)
        curve_rows = decode_speedups_on_curve(items, cost_curve, plain_prefill_shares(items)) if cost_curve else None
        mode_rows = compare_modes_on_curve(items, cost_curve, modes, args.suffix_memory == "on") if modes else None
    except (ValueError, OSError, ModelLoadError, OfflinePackError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(format_replay(table, args.num_draft_tokens))
    if cost_curve is not None and curve_rows is not None:
        print()
        print(format_curve_rows(curve_rows, cost_curve))
    if mode_rows is not None:
        print()
        print(format_mode_rows(mode_rows, args.suffix_memory == "on"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
