"""Running the bench: every mode on every prompt, timed and set against plain decoding, into the report.

:func:`run_benchmark` encodes the prompts, warms every mode up, times every mode on every prompt (modes
interleaved, their order rotating) and summarises (:mod:`specdemo.bench_report`). A mode is plain decoding, one of
the engine's (:data:`specdemo.methods.METHODS`) or one of transformers' own ``generate``
(:data:`specdemo.session.stock.STOCK_MODES`).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from tqdm.auto import tqdm

from .backends.loading import LoadedModel
from .backends.suffix_trees import SuffixMemory
from .bench_checkpoint import BenchCheckpoint, PromptRecord
from .bench_report import aggregate, environment, plain_of, split_mode
from .core.clock import now
from .core.economics import CostCurve
from .core.errors import InputError
from .core.events import Counters, RoundEvent
from .core.loop import collect
from .core.metrics import decode_rate, decode_speedup
from .core.settings import GenerationSettings, SamplingSettings
from .methods import METHODS, Method, SpecSettings
from .session.compiling import EAGER, CompileOutcome, Passes, compile_graphs, drafting_model_of, longest_draft_of
from .session.config import WARMUP_TOKENS
from .session.pipeline import encode_prompt, plain_events, spec_events
from .session.prompts import Prompt
from .session.racer import compare_outputs, warm_up
from .session.request import check_lengths
from .session.results import Divergence, RunResult, rate_ratio
from .session.stock import STOCK_MODES, StockMode, run_stock

logger = logging.getLogger(__name__)


@dataclass
class ModeRun:
    """One timed run of one mode on one prompt."""

    ids: list[int]
    text: str
    seconds: float
    counters: Counters | None  # None for transformers' own generate


@dataclass
class BenchConfig:
    """The settings of one benchmark, as its report records them (the JSON's ``config``)."""

    target: str
    draft: str | None
    modes: list[str]
    prompts: str
    max_new_tokens: int
    num_draft_tokens_schedule: str
    num_draft_tokens: int | None
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
    #: the suffix mode drafts from the answers of the prompts before (each prompt's answer is remembered after its
    #: runs); off: from each prompt's own text alone
    suffix_memory: bool = True
    passes: int = 1  # the prompt set raced this many times in a row (later passes meet earlier answers again)
    #: ``--compile``: how the target's passes run; several choices run every engine mode in each (``draft@on``)
    compile: list[str] = field(default_factory=lambda: ["auto"])
    draft_settings: dict[str, Any] = field(default_factory=dict)  # draft head, int8, n-gram sizes and rule, heads
    extra: dict[str, Any] = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------------------------
# running one mode


def _declared(mode: str) -> Method | StockMode | None:
    """What the registries say ``mode`` is: the engine's method, transformers' stock mode, or None (plain)."""
    mode = split_mode(mode)[0]
    return METHODS[mode] if mode in METHODS else STOCK_MODES.get(mode)


def drafts_with_other_tokenizer(mode: str) -> bool:
    """Whether ``mode`` drafts with a model of another tokenizer (``--uag-draft`` when given)."""
    declared = _declared(mode)
    return declared is not None and declared.other_tokenizer


def needs_draft_model(mode: str) -> bool:
    """Whether ``mode`` drafts with a draft model (``--draft``, or ``--uag-draft`` for another tokenizer)."""
    declared = _declared(mode)
    return declared is not None and declared.needs_draft_model


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
    memory: SuffixMemory | None = None,
    passes: Passes = EAGER,
    cache_tokens: int | None = None,
) -> ModeRun:
    """One timed run of ``mode`` on ``prompt_ids``: plain decoding, one of the engine's modes, or a stock one;
    ``memory``: the earlier answers a mode that drafts from them reads; ``passes``: how the engine's target passes
    run; ``cache_tokens``: the longest sequence of the bench (a stock static cache is sized for it once)."""
    draft = mode_draft(mode, draft, uag_draft)
    if mode in STOCK_MODES:
        stock = run_stock(mode, target, draft, prompt_ids, settings, lookup_tokens, cache_tokens)
        return ModeRun(stock.ids, stock.text, stock.seconds, None)

    # wall clock around the whole run, bookkeeping and detokenization included, as for the transformers modes
    start = now(target.device)
    if mode == "plain":
        final: RoundEvent = collect(plain_events(target, prompt_ids, settings, passes))
    else:
        mode_spec = replace(spec, mode=mode)
        final = collect(spec_events(target, draft, prompt_ids, settings, mode_spec, calibration, memory, passes))
    seconds = now(target.device) - start
    return ModeRun(final.new_token_ids, final.text, seconds, final.counters)


# ----------------------------------------------------------------------------------------------------------------
# the benchmark


def _against_plain(
    target: LoadedModel, prompt_ids: list[int], run: ModeRun, plain: ModeRun | None, greedy: bool
) -> tuple[bool | None, Divergence | None, float | None, float | None]:
    """Whether ``run`` wrote plain's output (else where they parted), its speedup over plain overall and after the
    prompt pass (all None without a plain run; the last None without both runs' counters)."""
    if plain is None:
        return None, None, None, None
    position, margin = compare_outputs(target, prompt_ids, plain.ids, run.ids, greedy)
    parted = None if position is None else Divergence(position, margin)
    speedup = rate_ratio(len(run.ids), run.seconds, len(plain.ids), plain.seconds)
    decode = None
    if run.counters is not None and plain.counters is not None:
        decode = decode_speedup(
            decode_rate(len(run.ids), run.seconds, run.counters.prefill_seconds),
            decode_rate(len(plain.ids), plain.seconds, plain.counters.prefill_seconds),
        )
    return position is None, parted, speedup, decode


@dataclass
class BenchRun:
    """One benchmark: its settings and models, and the steps :func:`run_benchmark` takes with them."""

    config: BenchConfig
    target: LoadedModel
    draft: LoadedModel | None
    uag_draft: LoadedModel | None
    spec: SpecSettings
    calibration: CostCurve | None
    #: the answers of the prompts timed so far, for the modes that draft from them (None: memory off or no such mode)
    memory: SuffixMemory | None = None
    #: how the target's passes run, per variant of the modes ("" when every mode runs once)
    variants: dict[str, CompileOutcome] = field(default_factory=dict)
    #: the longest prompt and answer of the bench, in tokens (set by :meth:`encode`)
    longest: int | None = None
    #: the prompts finished so far, kept after each one (None: not kept)
    checkpoint: BenchCheckpoint | None = None

    @property
    def sampling(self) -> SamplingSettings:
        return SamplingSettings(self.config.temperature, self.config.top_k, self.config.top_p, self.config.seed)

    def settings(self, max_new_tokens: int) -> GenerationSettings:
        return GenerationSettings(max_new_tokens=max_new_tokens, sampling=self.sampling, collect_probs=False)

    def run(self, mode: str, prompt_ids: list[int], settings: GenerationSettings) -> ModeRun:
        base, variant = split_mode(mode)
        outcome = self.variants.get(variant)
        return run_mode(base, self.target, self.draft, prompt_ids, settings, self.spec, self.config.hf_lookup_tokens,
                        self.uag_draft, self.calibration, self.memory if _drafts_from_memory(mode) else None,
                        outcome.passes if outcome is not None else EAGER, self.longest)

    def encode(self, prompts: list[Prompt]) -> list[tuple[Prompt, list[int]]]:
        """Each prompt's token ids, checked against the target's limits (the error names the prompt)."""
        settings = self.settings(self.config.max_new_tokens)
        encoded = [(p, encode_prompt(self.target, p.text, chat=self.config.chat)) for p in prompts]
        for prompt, ids in encoded:
            try:
                check_lengths(self.target, ids, settings)
            except InputError as error:
                raise InputError(f"prompt {prompt.id}: {error}") from None
        self.longest = max(len(ids) for _, ids in encoded) + self.config.max_new_tokens
        return encoded

    def compile(self) -> None:
        """Make every graph each variant's passes use (printed), before anything is timed."""
        engine_modes = [split_mode(mode) for mode in self.config.modes if split_mode(mode)[0] not in STOCK_MODES]
        longest_draft = longest_draft_of(self.spec)
        for variant, outcome in self.variants.items():
            modes = [mode for mode, of in engine_modes if of == variant and mode in METHODS]
            hidden = {METHODS[mode].needs_hidden_states for mode in modes}
            outcome = compile_graphs(outcome, self.target, hidden, longest_draft + 1, self.longest or 0,
                                     self._drafting_models(modes))
            self.variants[variant] = outcome
            print(f"{variant or 'passes'}: {outcome.describe()}", flush=True)

    def _drafting_models(self, modes: list[str]) -> list[Any]:
        """The draft models and heads ``modes`` run through the run's passes, each once (eagle and eagle-chain share
        their head)."""
        found = (drafting_model_of(replace(self.spec, mode=mode), self.target,
                                   mode_draft(mode, self.draft, self.uag_draft)) for mode in modes)
        return list({id(model): model for model in found if model is not None}.values())

    def warm(self, prompt_ids: list[int]) -> None:
        """The session's warm-up (the app's and the recorder's too) for the engine's modes, generate() for the
        stock ones, ``config.warmup`` times."""
        sampling = self.sampling
        tokens = min(WARMUP_TOKENS, self.config.max_new_tokens)
        warm = self.settings(tokens)
        for _ in range(self.config.warmup):
            for name in self.config.modes:
                mode, variant = split_mode(name)
                passes = self.variants[variant].passes if variant in self.variants else EAGER
                if mode in STOCK_MODES:
                    self.run(mode, prompt_ids, warm)
                elif mode == "plain":
                    warm_up(self.target, None, prompt_ids, sampling, None, tokens, passes=passes)
                else:
                    warm_up(self.target, mode_draft(mode, self.draft, self.uag_draft), prompt_ids, sampling,
                            replace(self.spec, mode=mode), tokens, plain=False, passes=passes)

    def time_prompt(self, index: int, prompt_ids: list[int], bar: tqdm) -> dict[str, list[ModeRun]]:
        """Every mode's ``config.repeats`` runs on the prompt, modes interleaved in an order rotated by ``index``."""
        modes = self.config.modes
        settings = self.settings(self.config.max_new_tokens)
        order = modes[index % len(modes) :] + modes[: index % len(modes)]  # rotate: no mode always goes first
        runs: dict[str, list[ModeRun]] = {m: [] for m in modes}
        for _ in range(self.config.repeats):
            for mode in order:
                runs[mode].append(self.run(mode, prompt_ids, settings))
                bar.update(1)
        return runs

    def row(
        self, prompt: Prompt, prompt_ids: list[int], mode: str, run: ModeRun, runs: list[ModeRun], plain: ModeRun | None
    ) -> dict[str, Any]:
        """The results entry of ``mode`` on the prompt: its median ``run`` among ``runs``, set against plain's."""
        identical, parted, speedup, decode = _against_plain(self.target, prompt_ids, run, plain, self.sampling.greedy)
        result = RunResult.of(run.counters, len(run.ids), run.seconds, identical, parted, speedup)
        entry: dict[str, Any] = {
            "id": prompt.id,
            "category": prompt.category,
            "mode": mode,
            "prompt_tokens": len(prompt_ids),
            **result.as_dict(),
            "new_token_ids": run.ids,
            "text": run.text,
            "seconds_all_repeats": [r.seconds for r in runs],
            "new_tokens_all_repeats": [len(r.ids) for r in runs],
            "tokens_per_s": len(run.ids) / run.seconds if run.seconds > 0 else 0.0,
            "decode_speedup": decode,
        }
        if mode == plain_of(mode, self.config.modes):
            entry["prompt_ids"] = list(prompt_ids)  # lets `python -m specdemo.replay` replay drafting rules offline
        return entry

    def run_prompts(
        self, encoded: list[tuple[Prompt, list[int]]], progress: bool
    ) -> tuple[list[dict], dict[tuple[str, str], Counters]]:
        """The results entries of every mode on every prompt, and the engine's counters of each, by (prompt, mode):
        the prompts a kept run finished read back, the others timed (and kept, one by one)."""
        results: list[dict] = []
        counters: dict[tuple[str, str], Counters] = {}
        passes, runs_per_prompt = self.config.passes, len(self.config.modes) * self.config.repeats
        kept = self.checkpoint.done if self.checkpoint is not None else []
        total = len(encoded) * runs_per_prompt * passes
        bar = tqdm(total=total, initial=min(len(kept), total) * runs_per_prompt, desc="bench", unit="run",
                   disable=not progress)
        for index, (number, (prompt, ids)) in enumerate((n, p) for n in range(1, passes + 1) for p in encoded):
            if number > 1:  # the same prompt again: its own entries
                prompt = replace(prompt, id=f"{prompt.id}#{number}")
            record = kept[index] if index < len(kept) else self.time_record(index, number, prompt, ids, bar)
            results.extend(record.rows)
            counters.update({(prompt.id, mode): c for mode, c in record.counters_by_mode().items()})
            if self.memory is not None and record.remembered is not None:
                self.memory.remember(record.remembered)
        bar.close()
        return results, counters

    def time_record(self, index: int, number: int, prompt: Prompt, ids: list[int], bar: tqdm) -> PromptRecord:
        """Time every mode on the prompt: its results entries, counters and remembered answer, kept when the run
        keeps a checkpoint."""
        runs = self.time_prompt(index, ids, bar)
        chosen = {mode: _median(mode_runs) for mode, mode_runs in runs.items()}
        rows = []
        for mode, run in chosen.items():
            plain = chosen.get(plain_of(mode, self.config.modes))
            rows.append({**self.row(prompt, ids, mode, run, runs[mode], plain), "pass": number})
        counters = {mode: asdict(run.counters) for mode, run in chosen.items() if run.counters is not None}
        record = PromptRecord(rows, counters, self.remembered(chosen))
        if self.checkpoint is not None:
            self.checkpoint.save(record)
        return record

    @staticmethod
    def remembered(chosen: dict[str, ModeRun]) -> list[int] | None:
        """After a prompt's runs: its answer for the memory (the first mode's that drafts from it), so the next
        prompts, never this one, draft from it."""
        return next((run.ids for mode, run in chosen.items() if _drafts_from_memory(mode)), None)


def _drafts_from_memory(mode: str) -> bool:
    """Whether ``mode`` drafts from the answers of earlier prompts."""
    mode = split_mode(mode)[0]
    return mode in METHODS and METHODS[mode].drafts_from_memory


def _median(runs: list[ModeRun]) -> ModeRun:
    """The run of median time (of an even count, the slower of the two middle ones)."""
    return sorted(runs, key=lambda run: run.seconds)[len(runs) // 2]


def run_benchmark(
    config: BenchConfig,
    target: LoadedModel,
    draft: LoadedModel | None,
    prompts: list[Prompt],
    spec: SpecSettings,
    progress: bool = True,
    uag_draft: LoadedModel | None = None,
    calibration: CostCurve | None = None,
    variants: dict[str, CompileOutcome] | None = None,
    checkpoint: BenchCheckpoint | None = None,
) -> dict:
    """Encode the prompts, compile and warm every mode up, time every mode on every prompt, and summarise: the
    report. ``variants``: how the target's passes run, per variant of the modes (default: eager); ``checkpoint``:
    the prompts a stopped run finished (not timed again), and where each finished prompt is kept."""
    memory = None
    if config.suffix_memory and any(_drafts_from_memory(mode) for mode in config.modes):
        memory = SuffixMemory()
    bench = BenchRun(config, target, draft, uag_draft, spec, calibration, memory, dict(variants or {}),
                     checkpoint=checkpoint)
    encoded = bench.encode(prompts)
    bench.compile()
    bench.warm(encoded[0][1])  # before any answer is remembered
    compiled = {variant: outcome.as_record() for variant, outcome in bench.variants.items()}
    if checkpoint is not None:
        checkpoint.begin(compiled)
    results, counters = bench.run_prompts(encoded, progress)
    summary = aggregate(results, config.modes, counters)
    by_category: dict[str, dict[str, dict]] = {}
    for category in dict.fromkeys(p.category for p, _ in encoded):
        rows = [r for r in results if r["category"] == category]
        by_category[category] = aggregate(rows, config.modes, counters)
    report = {
        "config": asdict(config),
        "environment": environment(target),
        "results": results,
        "summary": summary,
        "by_category": by_category,
        "suffix_memory": memory.describe() if memory is not None else None,  # what it held at the end
        "compile": compiled,
        # every process that timed prompts of this run (one unless a stopped run was resumed); None: not kept
        "processes": checkpoint.processes if checkpoint is not None else None,
    }
    if config.passes > 1:
        report["by_pass"] = {
            f"pass {number}": aggregate([r for r in results if r["pass"] == number], config.modes, counters)
            for number in range(1, config.passes + 1)
        }
    return report
