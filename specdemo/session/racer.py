"""Preparing a pair and racing it: what the app, the ``/race`` API and the recorder run, and the bench reuses.

- :class:`Racer`: checks a :class:`~specdemo.session.request.RaceRequest` (:func:`check_request`), loads the pair
  with progress (freeing the previous pair's models), warms it up, calibrates it, and runs one race through
  :func:`specdemo.session.race.race`, yielding a :class:`~specdemo.session.state.RaceState` after every round,
  within the time budget; every race and every refusal ends with one line in the server log;
- shared with the bench: :func:`warm_up` (the one untimed warm-up run), :func:`calibrate_pair` (the one calibration
  call, with the same cache keys everywhere) and :func:`compare_outputs` (the divergence check and its logit margin);
- the server log: one structured line per race on the ``specdemo.races`` logger (:func:`log_race`,
  :func:`log_refusal`); never the prompt's text. Not the race log of :mod:`specdemo.session.racelog`, which
  records a race round by round.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import platform
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, Sequence

import torch

from ..backends.loading import (
    CacheKey,
    LoadedModel,
    LoadSettings,
    ModelLoadError,
    cache_key,
    draft_dtype,
    load_model,
)
from ..backends.memory import resident_gb, return_free_memory
from ..backends.offline import OfflinePackError
from ..backends.static_lm import capacity_for
from ..backends.suffix_trees import SuffixMemory
from ..core.economics import CostCurve
from ..core.errors import InputError, first_line
from ..core.loop import collect
from ..core.settings import GenerationSettings, SamplingSettings
from ..methods import SpecSettings, check_pair, describe_methods
from ..methods.draft_model import drafting_model
from .calibration import AUTO_FORMATS, FormatChoice, calibrate, choose_format, measures_formats, refresh_if_stale
from .config import WARMUP_TOKENS, SessionConfig
from .compiling import (
    EAGER,
    CompileOutcome,
    Passes,
    choose_passes,
    compile_graphs,
    drafting_model_of,
    longest_draft_of,
)
from .format_probe import quick_curves
from .pipeline import encode_prompt, plain_events, spec_events
from .preparation import (
    CALIBRATING,
    CHOOSING_PASSES,
    LOADING_DRAFT,
    LOADING_TARGET,
    MEASURING_FORMATS,
    WARMING_UP,
    PreparedBeside,
    StepProgress,
    plan_steps,
    prepare_beside,
    wait_beside,
)
from .race import race
from .racelog import RaceSettings
from .request import (
    Checked,
    RaceRequest,
    check_lengths,
    check_prompt_tokens,
    check_request,
)
from .results import RunResult, divergence
from .state import RaceState

logger = logging.getLogger(__name__)
#: the server log: one structured line per race (pair, mode, sizes, seconds, both runs, how it ended)
race_logger = logging.getLogger("specdemo.races")

#: why a race stopped before both sides finished
TIME_BUDGET = "time budget"

#: (fraction in [0, 1], message): how far loading and preparing a pair has come
Progress = Callable[[float, str], None]


def _no_progress(fraction: float, message: str) -> None:
    """A progress callback that reports nowhere."""


@dataclass
class Prepared:
    """A checked request with its models loaded, warmed up and calibrated, and its prompt encoded."""

    request: RaceRequest
    target: LoadedModel
    draft: LoadedModel | None
    target_source: str
    draft_source: str | None
    prompt_ids: list[int]
    settings: GenerationSettings
    spec: SpecSettings
    warnings: list[str] = field(default_factory=list)
    load_seconds: float = 0.0
    warmup_seconds: float = 0.0
    pair: str | None = None  # the preset raced (None: custom models)
    calibration: CostCurve | None = None  # this machine's cost curve for the target (and draft)
    format_reason: str | None = None  # why the target runs in its format, when --dtype auto chose it
    format_choice: FormatChoice | None = None  # the choice itself (its measured candidates), when auto chose
    memory: SuffixMemory | None = None  # the answers of earlier races the suffix mode drafts from (None: none)
    compiled: CompileOutcome | None = None  # how the target's passes run (None: eager, nothing asked)

    @property
    def passes(self) -> Passes:
        return self.compiled.passes if self.compiled is not None else EAGER


# ----------------------------------------------------------------------------------------------------------------
# shared with the bench


def warm_up(
    target: LoadedModel,
    draft: LoadedModel | None,
    prompt_ids: list[int],
    sampling: SamplingSettings,
    spec: SpecSettings | None,
    tokens: int = WARMUP_TOKENS,
    plain: bool = True,
    passes: Passes = EAGER,
) -> float:
    """One short untimed run of plain decoding (unless ``plain`` is False) and of ``spec``'s mode (when given), so
    that no timed run pays first-call costs; the seconds it took. ``passes``: how the target's passes run."""
    if tokens <= 0:
        return 0.0
    started = time.perf_counter()
    warm = GenerationSettings(max_new_tokens=tokens, sampling=sampling, collect_probs=False)
    if plain:
        collect(plain_events(target, prompt_ids, warm, passes))
    if spec is not None:
        collect(spec_events(target, draft, prompt_ids, warm, spec, passes=passes))
    return time.perf_counter() - started


def calibrate_pair(
    target: LoadedModel, draft: LoadedModel | None, spec: SpecSettings, refresh: bool = False
) -> CostCurve:
    """This machine's cost curve for the target (and the draft's step as ``spec``'s mode runs it: its int8 copy
    or not); measured once per machine, model, format and draft set-up, then cached. The one calibration call of
    every front end, so the same pair and mode hit the same cache entry everywhere."""
    return calibrate(target, draft, refresh=refresh, draft_int8=spec.draft_runs_int8(target, draft))


def divergence_margin(target: LoadedModel, prompt_ids: list[int], reference: Sequence[int], position: int) -> float:
    """The target's top-1 minus top-2 logit where the outputs part (in the reference's context)."""
    ids = torch.tensor([list(prompt_ids) + list(reference[:position])], device=target.device)
    with torch.inference_mode():
        logits = target.model(input_ids=ids, logits_to_keep=1).logits[0, -1].float()
    top2 = torch.topk(logits, 2).values
    return float(top2[0] - top2[1])


def compare_outputs(
    target: LoadedModel, prompt_ids: list[int], reference: Sequence[int], other: Sequence[int], greedy: bool
) -> tuple[int | None, float | None]:
    """Where ``other`` first differs from ``reference`` (None: identical) and, for greedy runs that part before the
    reference ends, the target's logit margin there (a near-tie says low precision, not a bug)."""
    position = divergence(reference, other)
    margin = None
    if greedy and position is not None and position < len(reference):
        try:
            margin = divergence_margin(target, prompt_ids, reference, position)
        except RuntimeError:  # pragma: no cover - out of memory and the like: the result says less
            logger.exception("Could not compute the divergence margin")
    return position, margin


@functools.lru_cache(maxsize=None)
def hardware_name(device: str) -> str:
    """What a race ran on, for titles: the GPU's name, or the CPU's model name and core count."""
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    if device.startswith("mps"):
        return "Apple GPU (mps)"
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{model} ({os.cpu_count()} cores)"


def race_settings(prepared: Prepared) -> RaceSettings:
    """What a prepared race races, as its log records it."""
    sampling = prepared.settings.sampling
    device = str(prepared.target.device)
    return RaceSettings(
        target=prepared.target_source,
        draft=prepared.draft_source,
        mode=prepared.spec.mode,
        num_draft_tokens_schedule=prepared.spec.num_draft_tokens_schedule,
        num_draft_tokens=prepared.spec.num_draft_tokens,
        max_num_draft_tokens=prepared.spec.max_num_draft_tokens,
        method_label=prepared.spec.method.label,
        max_new_tokens=prepared.settings.max_new_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        seed=sampling.seed,
        dtype=prepared.target.format,
        device=device,
        hardware=hardware_name(device),
        prompt=prepared.request.prompt,
        prompt_tokens=len(prepared.prompt_ids),
        chat=bool(prepared.request.chat),
        pair=prepared.pair,
        methods=_methods(prepared),
        compile=prepared.compiled.as_record() if prepared.compiled is not None else None,
    )


def _methods(prepared: Prepared) -> dict[str, Any] | None:
    """What the race's mode records about its own parts (for a mode that drafts from earlier answers, how much its
    memory held when the race began: None, no memory)."""
    methods = describe_methods(prepared.spec, prepared.target, [prepared.spec.mode])
    mode = prepared.spec.mode
    if prepared.spec.method.drafts_from_memory:
        memory = prepared.memory.describe() if prepared.memory is not None else None
        methods[mode] = {**methods.get(mode, {}), "memory": memory}
    return methods or None


# ----------------------------------------------------------------------------------------------------------------
# the racer


class Racer:
    """Checks requests, prepares pairs and runs races (one at a time: the app's queue sees to that)."""

    def __init__(self, config: SessionConfig) -> None:
        self.config = config
        self._warm: set[tuple[int, int | None, str]] = set()  # (target model, draft model, mode) warmed up
        #: how each target's passes were compiled, by (target model, hidden states asked, longest draft, buffer)
        self._compiled: dict[tuple[int, bool, int, int, int], CompileOutcome] = {}
        self._pair: frozenset[CacheKey] | None = None  # cache keys of the pair that ran last

    # -- checking and preparing --------------------------------------------------------------------------------

    def check(self, request: RaceRequest) -> Checked:
        """Every check that needs no model (see :func:`~specdemo.session.request.check_request`)."""
        return check_request(request, self.config)

    def prepare(
        self, request: RaceRequest, on_progress: Progress | None = None, memory: SuffixMemory | None = None
    ) -> Prepared:
        """Check, load (reporting progress in [0, 1]), encode, warm up, calibrate; InputError with one plain line
        otherwise (and one line in the server log). ``memory``: the earlier answers the suffix mode drafts from
        (the warm-up never adds to it; whoever runs the race remembers its answer)."""
        try:
            prepared = self._prepare(request, on_progress or _no_progress)
        except InputError as error:
            log_refusal(str(error))
            raise
        prepared.memory = memory
        return prepared

    def _source_limits(self, source: str | None, checked: Checked) -> dict[str, Any]:
        """How a source loads: a hosted app's custom Hub id never from disk, its download capped."""
        if source is None or source not in checked.remote_only:
            return {}
        return {"local_files": False, "max_download_bytes": int(self.config.max_download_gb * 1e9)}

    def _prepare(self, request: RaceRequest, report: Progress) -> Prepared:
        config = self.config
        checked = self.check(request)
        settings, spec, dtype = checked.settings, checked.spec, checked.dtype
        target_source, draft_source, preset = checked.target_source, checked.draft_source, checked.preset

        # loading (a first start joins, measures and converts the pack's files: see session/preparation.py)
        started = time.perf_counter()
        target_settings = LoadSettings(dtype=dtype, device=config.device, quantization=checked.quantization,
                                       **self._source_limits(target_source, checked))
        format_reason = choice = None
        pair_draft = draft_source or (preset and preset.draft)
        draft_limits = self._source_limits(pair_draft, checked)
        choosing = dtype == "auto" and config.calibrate
        steps = StepProgress(report, plan_steps(target_source, target_settings, draft_source,
                                                choosing and measures_formats(target_source, target_settings),
                                                config.calibrate))
        beside = prepare_beside(draft_source, LoadSettings(dtype=draft_dtype(dtype), device=config.device,
                                                           **draft_limits))
        try:
            if choosing:
                choice = self._choose_format(target_source, target_settings, pair_draft, draft_limits, steps, beside)
                dtype, format_reason = choice.format, choice.reason
                target_settings = replace(target_settings, dtype=dtype)
            draft_settings = LoadSettings(dtype=draft_dtype(dtype), device=config.device, **draft_limits)
            # the pair's draft stays loaded in a draft-free mode, so flipping modes on one pair reloads nothing
            self._switch_pair(target_source, target_settings, pair_draft, draft_settings)
            steps.start(LOADING_TARGET, target_source)
        finally:
            if beside is not None:
                beside.release()  # the draft converts while the target does (or when this failed, for next time)
        try:
            target = self._load(target_source, target_settings, steps.within, "target")
        except InputError:
            if beside is not None:
                beside.stop()  # a conversion cut here resumes next time
            raise
        # the prompt is measured with the target's tokenizer before the draft loads or any pass runs
        prompt_ids = encode_prompt(target, request.prompt, chat=bool(request.chat))
        check_prompt_tokens(prompt_ids, checked.max_prompt_tokens)
        check_lengths(target, prompt_ids, settings)
        draft = None
        if draft_source:
            steps.start(LOADING_DRAFT, draft_source)
            wait_beside(beside)
            draft = self._load(draft_source, draft_settings, steps.within, "draft")
        load_seconds = time.perf_counter() - started
        check_pair(spec, target, draft)  # e.g. Medusa heads that misfit: one line, before any pass

        as_preset = preset is not None and (target_source, draft_source or preset.draft) == (preset.target, preset.draft)
        prepared = Prepared(
            request, target, draft, target_source, draft_source, prompt_ids, settings, spec,
            _warnings(checked, target, draft), load_seconds, pair=preset.key if as_preset else None,
            format_reason=format_reason,
            format_choice=choice,
        )
        steps.start(CHOOSING_PASSES)
        prepared.compiled = self._compile(prepared, steps.within_step)
        steps.start(WARMING_UP)
        try:
            prepared.warmup_seconds = self._warm_up(prepared, steps.within_step)
        except (RuntimeError, ValueError) as error:
            logger.exception("The warm-up run failed")
            raise InputError(f"the warm-up run failed: {first_line(error)}") from None
        if config.calibrate:
            steps.start(CALIBRATING, "what a pass costs on this machine (once per model and format)")
            try:
                prepared.calibration = calibrate_pair(target, draft, spec)
            except (RuntimeError, ValueError, OSError):  # the race runs without the chart
                logger.exception("Calibration failed")
        logger.info("Prepared %s in %.1f s", target_source, steps.finish())
        return prepared

    def _choose_format(self, target_source: str, target_settings: LoadSettings, pair_draft: str | None,
                       draft_limits: dict[str, Any], steps: StepProgress | None,
                       beside: PreparedBeside | None) -> FormatChoice:
        """``--dtype auto``'s format for the target: cached for this machine, else measured on a few layers of its
        real weights, alone on the cores (the draft's preparation beside waits until the timing is done); the step
        is reported through ``steps``, or logged when there are none (preloading)."""
        if measures_formats(target_source, target_settings):  # candidates load: free the old pair first
            self._free_before_candidates(target_source, target_settings, pair_draft, LoadSettings(**draft_limits))
            what = f"{', '.join(AUTO_FORMATS)} on a few layers of the real weights, alone on the cores"
            if steps is None:
                logger.info("Preloading: choosing the target's format (%s)", what)
            else:
                steps.start(MEASURING_FORMATS, f"{what} (once per machine)")
        try:
            return choose_format(target_source, target_settings, load=self.config.loader,
                                 measure_candidates=self._format_probe(beside))
        except (ModelLoadError, OfflinePackError) as error:
            raise InputError(first_line(error)) from None

    def _format_probe(self, beside: PreparedBeside | None) -> Callable[..., dict[str, CostCurve]] | None:
        """How the target's formats are measured: on a few layers of its real weights, read from the sources
        :func:`load_model` knows (waiting for the draft's preparation before timing); with another loader (an
        embedding application's, the tests'), each candidate loaded whole through it."""
        if self.config.loader is not load_model:
            return None
        return functools.partial(quick_curves, before_timing=beside.wait_joined if beside is not None else None)

    def preload(self, key: str | None = None) -> None:
        """Load a preset's pair now (the default pair unless ``key``) as a race would, before serving (ZeroGPU
        Spaces want models loaded first): with ``auto`` on a CPU the format is chosen here (measured once per
        machine), each model converted once, the draft's int8 copy made and the pair's cost curve measured, so the
        first visitor waits for none of them. InputError when it cannot."""
        started = time.perf_counter()
        preset = self.config.presets[key or self.config.default_pair()]
        config = self.config
        target_settings = LoadSettings(dtype=config.dtype, device=config.device)
        dtype = config.dtype
        beside = prepare_beside(preset.draft, LoadSettings(dtype=draft_dtype(dtype), device=config.device))
        try:
            if config.dtype == "auto" and config.calibrate:
                dtype = self._choose_format(preset.target, target_settings, preset.draft, {}, None, beside).format
                target_settings = replace(target_settings, dtype=dtype)
        finally:
            if beside is not None:
                beside.release()  # the draft converts while the target does
        draft_settings = LoadSettings(dtype=draft_dtype(dtype), device=config.device)
        self._switch_pair(preset.target, target_settings, preset.draft, draft_settings)
        target = self._load(preset.target, target_settings, _no_progress, "target")
        wait_beside(beside)
        draft = self._load(preset.draft, draft_settings, _no_progress, "draft") if preset.draft else None
        if draft is not None:  # the draft's int8 copy (seconds) is made now too, not in the first visitor's warm-up
            drafting_model(draft.model, SpecSettings(mode=preset.mode).draft_runs_int8(target, draft))
        if config.calibrate:
            try:
                calibrate_pair(target, draft, SpecSettings(mode="draft" if draft is not None else "ngram"))
            except (RuntimeError, ValueError) as error:
                logger.warning("Preloading: the calibration failed: %s", first_line(error))
        logger.info("Preloaded %s in %.1f s", preset.key, time.perf_counter() - started)

    def _free_before_candidates(
        self, target_source: str, target_settings: LoadSettings, draft_source: str | None, draft_settings: LoadSettings
    ) -> None:
        """Before the target's format candidates load (one at a time): free every model of the old pair but the
        new pair's draft, so a switch never holds the old target (or an old draft that is the new target, with
        its int8 copy) beside a candidate."""
        if self._pair is None or self.config.forget_models is None:
            return
        try:
            draft_name = cache_key(draft_source, draft_settings)[0] if draft_source else None
            target_name = cache_key(target_source, target_settings)[0]
        except ModelLoadError as error:
            raise InputError(first_line(error)) from None
        keep = frozenset(key for key in self._pair if key[0] == draft_name != target_name)
        logger.info("Freeing %s before the target's formats are measured",
                    " + ".join(sorted(key[0] for key in self._pair - keep)) or "nothing")
        self._warm.clear()
        self._compiled.clear()
        self.config.forget_models(keep)
        self._pair = keep or None

    def _switch_pair(
        self, target_source: str, target_settings: LoadSettings, draft_source: str | None, draft_settings: LoadSettings
    ) -> None:
        """When the pair changes, free every model the new pair does not use (the int8 copies go with them)."""
        try:
            keys = {cache_key(target_source, target_settings)}
            if draft_source:
                keys.add(cache_key(draft_source, draft_settings))
        except ModelLoadError as error:
            raise InputError(first_line(error)) from None
        pair = frozenset(keys)
        if self._pair is not None and pair != self._pair and self.config.forget_models is not None:
            logger.info("Switching pair to %s: freeing the models it does not use", " + ".join(sorted(k[0] for k in pair)))
            self._warm.clear()
            self._compiled.clear()
            self.config.forget_models(pair)
        self._pair = pair

    def _load(self, source: str, settings: LoadSettings, report: Progress, role: str) -> LoadedModel:
        report(0.0, f"Loading the {role}: {source}")
        try:
            return self.config.loader(source, settings, progress=False, on_progress=report)
        except (ModelLoadError, OfflinePackError) as error:
            raise InputError(first_line(error)) from None
        except (OSError, RuntimeError, ValueError, ImportError, KeyError) as error:
            logger.exception("Loading %s failed", source)
            raise InputError(f"cannot load {source!r}: {first_line(error)}") from None

    def _compile(self, prepared: Prepared, report: Progress) -> CompileOutcome:
        """How the target's passes run (``config.compile``), their graphs made the first time a target, mode and
        longest draft race; the page says what is compiling, and a failure gives eager passes before the race."""
        if self.config.compile == "auto" and self.config.calibrate:
            report(1.0, "Choosing how the target's passes run (on a CPU, compiled passes are measured against eager "
                   "ones once per machine, model and format)")
        outcome = choose_passes(self.config.compile, prepared.target, zero_gpu=self.config.zero_gpu,
                                measure=self.config.calibrate)
        if not outcome.compiled_passes:
            if outcome.choice == "on":  # asked for and not given: the page says why
                prepared.warnings.append(outcome.describe())
            return outcome
        hidden = prepared.spec.method.needs_hidden_states
        max_tokens = len(prepared.prompt_ids) + prepared.settings.max_new_tokens
        drafting = drafting_model_of(prepared.spec, prepared.target, prepared.draft)
        longest_draft = longest_draft_of(prepared.spec)
        key = (id(prepared.target.model), hidden, longest_draft, capacity_for(max_tokens), id(drafting))
        if key not in self._compiled:
            report(1.0, f"Compiling the target's passes ({outcome.reason}; once per pair, mode and length, before "
                   "the race)")
            self._compiled[key] = compile_graphs(outcome, prepared.target, {hidden}, longest_draft + 1, max_tokens,
                                                 [drafting] if drafting is not None else [])
            logger.info("%s", self._compiled[key].describe())
        compiled = self._compiled[key]
        if not compiled.compiled_passes:
            prepared.warnings.append(compiled.describe())
        return compiled

    def _warm_up(self, prepared: Prepared, report: Progress) -> float:
        """The warm-up run (:func:`warm_up`) the first time a pair and mode race; seconds it took (0: none)."""
        tokens = min(self.config.warmup_tokens, prepared.settings.max_new_tokens)
        key = (id(prepared.target.model), id(prepared.draft.model) if prepared.draft else None, prepared.spec.mode)
        if tokens <= 0 or key in self._warm:
            return 0.0
        report(1.0, "Warming up (untimed)")
        seconds = warm_up(
            prepared.target, prepared.draft, prepared.prompt_ids, prepared.settings.sampling, prepared.spec, tokens,
            passes=prepared.passes,
        )
        self._warm.add(key)
        return seconds

    # -- the race ----------------------------------------------------------------------------------------------

    def run(self, prepared: Prepared) -> Iterator[RaceState]:
        """One race; yields the state after every round, and once more when the outcome is final.

        Closing this generator (the Stop button, a cancelled or disconnected API client) closes the race, which
        closes both decoders. When the race outlives the configured time budget it stops there, with the figures
        of what both sides wrote so far. Every race ends with one line in the server log (:func:`log_race`).
        """
        state = RaceState(race_settings(prepared))
        plain = plain_events(prepared.target, prepared.prompt_ids, prepared.settings, prepared.passes)
        spec = spec_events(
            prepared.target, prepared.draft, prepared.prompt_ids, prepared.settings, prepared.spec, prepared.calibration,
            prepared.memory, prepared.passes,
        )
        events = race(plain, spec)
        budget = self.config.race_time_budget
        started = time.perf_counter()
        ended = "cancelled"  # until the race reaches an end of its own
        try:
            for event in events:
                (state.plain if event.side == "plain" else state.spec).add(event)
                yield state
                both_finished = state.plain.finished and state.spec.finished
                if budget is not None and not both_finished and time.perf_counter() - started > budget:
                    state.stop_reason = TIME_BUDGET
                    break
            events.close()
            self.finish(state, prepared)
            ended = state.stop_reason or "done"
            yield state
        except Exception:
            ended = "error"
            raise
        finally:
            events.close()
            seconds = time.perf_counter() - started
            return_free_memory(collect=False)  # the race's caches and activations: a long session stays flat
            log_race(state, prepared, ended, seconds)

    def finish(self, state: RaceState, prepared: Prepared) -> None:
        """Compare the outputs (as far as both got, when the race stopped early) and mark the race done."""
        plain_ids, spec_ids = state.plain.output_ids(), state.spec.output_ids()
        if state.stop_reason is not None:
            plain_ids, spec_ids = plain_ids[: len(spec_ids)], spec_ids[: len(plain_ids)]
        state.divergence, state.margin = compare_outputs(
            prepared.target, prepared.prompt_ids, plain_ids, spec_ids, state.greedy
        )
        state.done = True
        plain = state.plain.counters
        # today's plain steps against the cached curve (eager passes, as the curve's): a stale one is measured again
        if plain.rounds and prepared.passes == EAGER:
            refresh_if_stale(prepared.calibration, plain.verify_seconds / plain.rounds, prepared.format_choice)


def _warnings(checked: Checked, target: LoadedModel, draft: LoadedModel | None) -> list[str]:
    """What a visitor should know before the race starts."""
    warnings: list[str] = []
    if draft is not None and (draft is target or draft.model is target.model):
        warnings.append(
            "The draft is the target itself: every draft is accepted, but each costs a full target pass, "
            "so expect no speedup."
        )
    preset = checked.preset
    if preset is not None and target.device.type == "cpu" and preset.hardware.lower().startswith("gpu"):
        warnings.append(f"{preset.label} is meant for a GPU ({preset.hardware}); on this CPU it will be slow.")
    if not checked.settings.sampling.greedy:
        warnings.append(
            "Sampling (temperature > 0): both sides draw from the same distribution, but not the same tokens, "
            "so the texts will differ."
        )
    return warnings


# ----------------------------------------------------------------------------------------------------------------
# the server log


def _rounded(value: Any, digits: int = 4) -> Any:
    """``value`` with every float rounded to ``digits`` places (nested dicts included), for a readable log line."""
    if isinstance(value, float):
        return round(value, digits)
    if isinstance(value, dict):
        return {key: _rounded(item, digits) for key, item in value.items()}
    return value


def log_race(state: RaceState, prepared: Prepared, ended: str, seconds: float) -> None:
    """One structured line (JSON) about a race that ran: what raced, how it ended, and both runs in the one
    results schema; never the prompt's text."""
    runs: dict[str, RunResult] = state.runs()
    if ended == "error":  # no figure of a race that failed stands
        runs = {side: replace(run, speedup=None) for side, run in runs.items()}
    record: dict[str, Any] = {
        "pair": prepared.pair,
        "target": prepared.target_source,
        "draft": prepared.draft_source,
        "mode": prepared.spec.mode,
        "num_draft_tokens_schedule": prepared.spec.num_draft_tokens_schedule,
        "num_draft_tokens": prepared.spec.num_draft_tokens,
        "max_num_draft_tokens": prepared.spec.max_num_draft_tokens,
        "dtype": prepared.target.format,
        "device": str(prepared.target.device),
        "prompt_tokens": len(prepared.prompt_ids),
        "max_new_tokens": prepared.settings.max_new_tokens,
        "ended": ended,
        "seconds": round(seconds, 3),
        **{side: _rounded(run.as_dict()) for side, run in runs.items()},
        "rss_gb": None if (rss := resident_gb()) is None else round(rss, 2),
    }
    race_logger.info("race %s", json.dumps(record))


def log_refusal(reason: str) -> None:
    """One structured line about a request refused before it raced (the reason, never the prompt's text)."""
    race_logger.info("race %s", json.dumps({"ended": "refused", "reason": reason}))
