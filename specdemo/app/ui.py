"""The Gradio app: one Run makes one fair race between plain and speculative decoding, every token coloured.

Structure (everything but :func:`build_app` is testable without a browser):

- :class:`AppConfig`: what the app serves (presets, device, model loader, update rate, ...);
- :class:`Racer`: checks a :class:`RaceRequest` (the cheap checks also run as the queue's validator), loads the
  pair (with progress, freeing the previous pair), and runs one race through :func:`specdemo.session.race.race`, yielding
  a :class:`RaceState` after every round, within the time budget, and logging one line per race;
- views: token spans, pane figures, cards and CSS come from :mod:`specdemo.render.views` (no Gradio there); here: chart
  frames (:func:`race_frame`, :func:`accepted_length_frame`, :func:`acceptance_position_frame`) and
  :func:`result_dict` (the ``/race`` API's JSON, with the race log under ``"log"``);
- :func:`make_handlers`: the Gradio handlers (generators for the Run button and the ``/race`` API, validators);
- :func:`build_app`: the Blocks page; :func:`launch` adds the page's CSS.
"""

import json
import logging
import shutil
import tempfile
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import gradio as gr
import pandas as pd
import torch

from ..bench import divergence, divergence_margin
from ..core.loop import Counters, GenerationSettings, TokenEvent, collect
from ..session.calibration import PASS_LENGTHS, CostCurve, cached_format_choice, calibrate, choose_format
from ..backends.memory import resident_gb, return_free_memory
from ..backends.loading import (
    CacheKey,
    LoadedModel,
    LoadSettings,
    ModelLoadError,
    cache_key,
    draft_dtype,
    load_model,
    resolve_device,
    resolve_format,
)
from ..backends.offline import OfflinePackError
from ..session.pipeline import (
    MEDUSA_MODES,
    MODES_NEEDING_DRAFT,
    SPEC_MODES,
    InputError,
    SpecSettings,
    check_lengths,
    check_pair,
    check_prompt_chars,
    check_prompt_tokens,
    default_max_prompt_tokens,
    encode_prompt,
    medusa_heads,
    plain_events,
    release_models,
    spec_events,
    uag_draft_int8,
)
from ..session.presets import PRESETS, PairPreset, default_preset_key
from ..session.prompts import Prompt, PromptFileError, load_prompts
from ..session.race import race
from ..session.racelog import RaceLog, RaceLogError
from ..record import write_recording
from ..core.acceptance import SamplingSettings
from .spaces import gpu
from ..render.views import (
    CSS,
    PaneState,
    RaceState,
    figures_html,
    identical_html,
    legend_html,
    pane_stats_html,
    pane_titles,
    speedup_html,
)

logger = logging.getLogger(__name__)
#: the server log: one structured line per race (pair, mode, sizes, seconds, speedup, how it ended; never the
#: prompt's text); not the race log of :mod:`specdemo.session.racelog`, which records a race round by round
race_logger = logging.getLogger(__name__ + ".races")

#: why a race stopped before both sides finished
TIME_BUDGET = "time budget"

Loader = Callable[..., LoadedModel]  # load_model(source, settings, progress=..., on_progress=...)

DTYPES = ("auto", "bfloat16", "float16", "float32", "int8", "w8a8")
QUANTIZATIONS = {"none": None, "8bit": "8bit", "4bit": "4bit"}
DRAFT_LENGTHS = ["adaptive", "heuristic", *[str(k) for k in range(1, 13)]]
#: categories of the labelled examples, in display order
EXAMPLE_CATEGORIES = ("chat", "code-writing", "code-editing", "summarization", "translation")
SIDE_LABELS = {"plain": "plain", "spec": "speculative"}
COST_COLOURS = {"one-token pass (plain decoding)": "#9ca3af", "can pay": "#16a34a", "cannot pay": "#dc2626"}
SIDE_COLOURS = {"plain": "#9ca3af", "speculative": "#16a34a"}

#: the Run handler's outputs, in order (tests zip them with the yielded tuples)
OUTPUTS = (
    "plain_stats",
    "plain_output",
    "spec_stats",
    "spec_output",
    "speedup",
    "figures",
    "identical",
    "status",
    "race_plot",
    "length_plot",
    "position_plot",
    "result",
    "cost_plot",
)
#: the ``/race`` API's inputs, in order
API_INPUTS = (
    "prompt",
    "pair",
    "mode",
    "draft_tokens",
    "max_new_tokens",
    "temperature",
    "top_p",
    "seed",
    "chat",
    "target",
    "draft",
    "dtype",
)
#: the Run handler's inputs, in order
INPUTS = (
    "prompt",
    "pair",
    "target",
    "draft",
    "mode",
    "draft_tokens",
    "max_new_tokens",
    "temperature",
    "top_p",
    "seed",
    "dtype",
    "quantization",
    "chat",
)


# ----------------------------------------------------------------------------------------------------------------
# configuration and requests


def cuda_quantization_reason() -> str | None:
    """Why 4-bit/8-bit loading is unavailable here, or None when it is available."""
    if not torch.cuda.is_available():
        return "4-bit/8-bit needs a CUDA GPU (bitsandbytes); none found"
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is None:
        return "4-bit/8-bit needs the bitsandbytes package (pip install bitsandbytes)"
    return None


@dataclass
class AppConfig:
    """What the app serves and how."""

    pair: str | None = None  # default pair preset key (None: the offline pair when installed)
    device: str = "auto"
    dtype: str = "auto"
    custom_models: bool = True  # show the custom target/draft boxes (switch off for hosted use)
    presets: dict[str, PairPreset] = field(default_factory=lambda: dict(PRESETS))
    loader: Loader = load_model
    #: called when the pair changes, with the cache keys of the new pair's models, to free every other model
    #: (None: keep everything)
    forget_models: Callable[[frozenset[CacheKey]], None] | None = release_models
    update_interval: float = 0.25  # seconds between UI updates during a race (the final state is always sent)
    max_new_tokens: int = 128
    draft_tokens: str = "adaptive"  # the draft-tokens control's initial value: adaptive, heuristic or "1".."12"
    max_new_tokens_limit: int = 2048
    max_prompt_tokens: int | None = None  # cap on prompt tokens; None: 2,048 on a CPU, more on a GPU
    race_time_budget: float | None = None  # seconds of wall clock per race before it stops; None: no limit
    medusa_heads: str | None = None  # Medusa heads folder for the medusa modes; None: the target's shipped heads
    calibrate: bool = True  # measure (once per machine, model and format) and chart what a pass costs here
    warmup_tokens: int = 16  # an untimed warm-up race of this many tokens the first time a pair runs (0: none)
    examples: list[Prompt] | None = None  # None: the bundled prompt set
    quantization_reason: str | None = "auto"  # "auto": detect; None: available; text: why it is disabled
    gpu_duration: int = 120  # ZeroGPU seconds per race
    max_queue: int | None = 32
    title: str = "Speculative decoding race"

    def default_pair(self) -> str:
        if self.pair:
            if self.pair not in self.presets:
                raise ValueError(f"unknown pair preset {self.pair!r}; known: {', '.join(self.presets)}")
            return self.pair
        if set(PRESETS) <= set(self.presets):
            return default_preset_key()
        return next(iter(self.presets))

    def prompt_token_limit(self) -> int:
        """The cap on prompt tokens: the configured one, else the default for this app's device."""
        if self.max_prompt_tokens is not None:
            return self.max_prompt_tokens
        try:
            device_type = resolve_device(self.device).type
        except (ModelLoadError, RuntimeError, ValueError):
            device_type = "cpu"
        return default_max_prompt_tokens(device_type)

    def quantization_unavailable(self) -> str | None:
        if self.quantization_reason == "auto":
            if self.device.strip().lower() in ("cpu", "mps"):
                return f"4-bit/8-bit needs a CUDA GPU; this app runs on {self.device}"
            return cuda_quantization_reason()
        return self.quantization_reason


@dataclass
class RaceRequest:
    """Everything one Run asks for, as the UI sends it."""

    prompt: str
    pair: str | None = None
    target: str = ""
    draft: str = ""
    mode: str = "draft"
    draft_tokens: str | int = "adaptive"
    max_new_tokens: Any = 128
    temperature: float = 0.0
    top_p: float = 1.0
    seed: Any = 0
    dtype: str = "auto"
    quantization: str | None = "none"
    chat: bool = True


@dataclass
class Prepared:
    """A validated request with its models loaded and its prompt encoded."""

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


@dataclass(frozen=True)
class Checked:
    """A request that passed every check that needs no model (see :meth:`Racer.check`)."""

    settings: GenerationSettings
    spec: SpecSettings
    dtype: str
    quantization: str | None
    target_source: str
    draft_source: str | None
    preset: PairPreset | None
    max_prompt_tokens: int


@contextmanager
def _blame(field: str) -> Iterator[None]:
    """Turn an InputError or ValueError raised inside into an InputError that names ``field``."""
    try:
        yield
    except InputError as error:
        raise InputError(str(error), error.field or field) from None
    except ValueError as error:
        raise InputError(_first_line(error), field) from None


def parse_draft_tokens(value: str | int | None) -> str | int:
    """``"adaptive"``, ``"heuristic"`` or a whole number k >= 1."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return "adaptive"
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("adaptive", "heuristic"):
            return text
        if text.lstrip("-").isdigit():
            value = int(text)
        else:
            raise InputError(f"draft tokens must be 'adaptive', 'heuristic' or a number, got {value!r}")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 32:
        raise InputError(f"draft tokens must be between 1 and 32 (or adaptive), got {value!r}")
    return value


def parse_max_new_tokens(value: Any, limit: int) -> int:
    if value is None or value == "":
        raise InputError("max new tokens is empty: give a number of tokens")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise InputError(f"max new tokens must be a number, got {value!r}") from None
    if not number.is_integer() or not 1 <= number <= limit:
        raise InputError(f"max new tokens must be a whole number between 1 and {limit}, got {value!r}")
    return int(number)


def parse_seed(value: Any) -> int | None:
    if value is None or value == "":
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise InputError(f"the seed must be a whole number, got {value!r}") from None
    if not number.is_integer() or number < 0:
        raise InputError(f"the seed must be a whole number >= 0, got {value!r}")
    return int(number)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


# ----------------------------------------------------------------------------------------------------------------
# the racer: validation, loading, one race


class Racer:
    """Validates requests, loads pairs, and runs races (one at a time: the app's queue sees to that)."""

    def __init__(self, config: AppConfig) -> None:
        self.config = config
        self._warm: set[tuple[int, int | None, str]] = set()
        self._pair: frozenset[CacheKey] | None = None  # cache keys of the pair that ran last

    # -- validation and loading ------------------------------------------------------------------------------

    def sources(self, request: RaceRequest) -> tuple[str, str | None, PairPreset | None]:
        """(target, draft, preset) sources for a request; custom boxes override the preset."""
        custom_target = (request.target or "").strip()
        custom_draft = (request.draft or "").strip()
        if (custom_target or custom_draft) and not self.config.custom_models:
            raise InputError("custom models are switched off on this server: pick a pair preset")
        preset = None
        pair = (request.pair or "").strip() or self.config.default_pair()
        if pair not in self.config.presets:
            if not custom_target:
                raise InputError(f"unknown pair {pair!r}; choose one of: {', '.join(self.config.presets)}")
        else:
            preset = self.config.presets[pair]
        target = custom_target or (preset.target if preset else "")
        draft = custom_draft or (preset.draft if preset else None)
        if request.mode not in MODES_NEEDING_DRAFT:
            draft = None
        elif not draft:
            raise InputError(f"mode {request.mode!r} needs a draft model: pick a pair or fill in the custom draft")
        return target, draft, preset

    def prepare(self, request: RaceRequest, on_progress: Callable[[float, str], None] | None = None) -> Prepared:
        """Validate, load (reporting progress in [0, 1]), encode; InputError with one plain line otherwise."""
        try:
            return self._prepare(request, on_progress)
        except InputError as error:
            log_refusal(str(error))
            raise

    def check(self, request: RaceRequest) -> Checked:
        """Every check that needs no model (milliseconds): InputError naming the input at fault otherwise.

        The app runs it as the queue's validator too, so bad input is refused at once, never after waiting
        behind other visitors' races.
        """
        config = self.config
        with _blame("prompt"):
            if not isinstance(request.prompt, str) or not request.prompt.strip():
                raise InputError("the prompt is empty: type something or pick an example")
            max_prompt_tokens = config.prompt_token_limit()
            check_prompt_chars(request.prompt, max_prompt_tokens)
        with _blame("max_new_tokens"):
            max_new_tokens = parse_max_new_tokens(request.max_new_tokens, config.max_new_tokens_limit)
        with _blame("mode"):
            if request.mode not in SPEC_MODES:
                raise InputError(f"unknown mode {request.mode!r}; choose one of: {', '.join(SPEC_MODES)}")
        with _blame("draft_tokens"):
            spec = SpecSettings(
                mode=request.mode, draft_length=parse_draft_tokens(request.draft_tokens),
                medusa_heads=config.medusa_heads,
            )
            spec.validate()
        with _blame("temperature"):
            try:
                temperature = float(request.temperature or 0.0)
                top_p = float(request.top_p if request.top_p is not None else 1.0)
            except (TypeError, ValueError):
                raise InputError("temperature and top-p must be numbers") from None
        with _blame("seed"):
            sampling = SamplingSettings(temperature=temperature, top_p=top_p, seed=parse_seed(request.seed))
        with _blame("temperature"):
            settings = GenerationSettings(max_new_tokens=max_new_tokens, sampling=sampling)
            settings.validate()
        with _blame("dtype"):
            dtype = (request.dtype or config.dtype or "auto").strip().lower()
            if dtype not in DTYPES:
                raise InputError(f"unknown dtype {request.dtype!r}; choose one of: {', '.join(DTYPES)}")
        with _blame("quantization"):
            quant_key = (request.quantization or "none").strip().lower()
            if quant_key not in QUANTIZATIONS:
                raise InputError(f"unknown quantization {request.quantization!r}; use none, 8bit or 4bit")
            quantization = QUANTIZATIONS[quant_key]
            if quantization is not None:
                reason = config.quantization_unavailable()
                if reason:
                    raise InputError(reason)
        with _blame("pair"):
            target_source, draft_source, preset = self.sources(request)
        return Checked(settings, spec, dtype, quantization, target_source, draft_source, preset, max_prompt_tokens)

    def _prepare(self, request: RaceRequest, on_progress: Callable[[float, str], None] | None) -> Prepared:
        config = self.config
        report = on_progress or (lambda fraction, message: None)
        checked = self.check(request)
        settings, spec, dtype, quantization = checked.settings, checked.spec, checked.dtype, checked.quantization
        target_source, draft_source, preset = checked.target_source, checked.draft_source, checked.preset
        max_prompt_tokens = checked.max_prompt_tokens

        # loading (the first offline load joins and converts the pack: minutes, with progress)
        started = time.perf_counter()
        target_settings = LoadSettings(dtype=dtype, device=config.device, quantization=quantization)
        format_reason = None
        if dtype == "auto" and config.calibrate:
            report(0.0, "Choosing the target's format: each candidate measured once on this machine")
            try:
                choice = choose_format(target_source, target_settings, load=config.loader)
            except (ModelLoadError, OfflinePackError) as error:
                raise InputError(_first_line(error)) from None
            dtype, format_reason = choice.format, choice.reason
            target_settings = replace(target_settings, dtype=dtype)
        draft_settings = LoadSettings(dtype=draft_dtype(dtype), device=config.device)
        # the pair's draft stays loaded in a draft-free mode, so flipping modes on one pair reloads nothing
        self._switch_pair(target_source, target_settings, draft_source or (preset and preset.draft), draft_settings)
        share = 0.5 if draft_source else 1.0
        target = self._load(target_source, target_settings, lambda f, m: report(share * f, m), "target")
        # the prompt is measured with the target's tokenizer before the draft loads or any pass runs
        prompt_ids = encode_prompt(target, request.prompt, chat=bool(request.chat))
        check_prompt_tokens(prompt_ids, max_prompt_tokens)
        check_lengths(target, prompt_ids, settings)
        if spec.mode in MEDUSA_MODES:
            medusa_heads(target, spec.medusa_heads)  # none shipped for this target, or misfit: one line, now
        draft = None
        if draft_source:
            draft = self._load(draft_source, draft_settings, lambda f, m: report(0.5 + 0.5 * f, m), "draft")
        load_seconds = time.perf_counter() - started
        check_pair(spec.mode, target, draft)

        warnings: list[str] = []
        if draft is not None and (draft is target or draft.model is target.model):
            warnings.append(
                "The draft is the target itself: every draft is accepted, but each costs a full target pass, "
                "so expect no speedup."
            )
        if preset is not None and target.device.type == "cpu" and preset.hardware.lower().startswith("gpu"):
            warnings.append(f"{preset.label} is meant for a GPU ({preset.hardware}); on this CPU it will be slow.")
        if not settings.sampling.greedy:
            warnings.append(
                "Sampling (temperature > 0): both sides draw from the same distribution, but not the same tokens, "
                "so the texts will differ."
            )
        as_preset = preset is not None and (target_source, draft_source or preset.draft) == (preset.target, preset.draft)
        prepared = Prepared(
            request, target, draft, target_source, draft_source, prompt_ids, settings, spec, warnings, load_seconds,
            pair=preset.key if as_preset else None, format_reason=format_reason,
        )
        try:
            prepared.warmup_seconds = self.warm_up(prepared, report)
        except (RuntimeError, ValueError) as error:
            logger.exception("The warm-up run failed")
            raise InputError(f"the warm-up run failed: {_first_line(error)}") from None
        if config.calibrate:
            report(1.0, "Measuring what a pass costs on this machine (once per model and format)")
            try:
                # uag drafts in the draft's own dtype unless beside an int8 target or asked otherwise
                draft_int8 = uag_draft_int8(spec, target, draft) if spec.mode == "uag" else spec.draft_int8
                prepared.calibration = calibrate(target, draft, draft_int8=draft_int8)
            except (RuntimeError, ValueError, OSError):  # the race runs without the chart
                logger.exception("Calibration failed")
        return prepared

    def _switch_pair(
        self, target_source: str, target_settings: LoadSettings, draft_source: str | None, draft_settings: LoadSettings
    ) -> None:
        """When the pair changes, free every model the new pair does not use (the int8 copies go with them)."""
        try:
            keys = {cache_key(target_source, target_settings)}
            if draft_source:
                keys.add(cache_key(draft_source, draft_settings))
        except ModelLoadError as error:
            raise InputError(_first_line(error)) from None
        pair = frozenset(keys)
        if self._pair is not None and pair != self._pair and self.config.forget_models is not None:
            logger.info("Switching pair to %s: freeing the models it does not use", " + ".join(sorted(k[0] for k in pair)))
            self._warm.clear()
            self.config.forget_models(pair)
        self._pair = pair

    def _load(self, source: str, settings: LoadSettings, report: Callable[[float, str], None], role: str) -> LoadedModel:
        report(0.0, f"Loading the {role}: {source}")
        try:
            return self.config.loader(source, settings, progress=False, on_progress=report)
        except (ModelLoadError, OfflinePackError) as error:
            raise InputError(_first_line(error)) from None
        except (OSError, RuntimeError, ValueError, ImportError, KeyError) as error:
            logger.exception("Loading %s failed", source)
            raise InputError(f"cannot load {source!r}: {_first_line(error)}") from None

    def warm_up(self, prepared: Prepared, report: Callable[[float, str], None]) -> float:
        """One short untimed race the first time a pair and mode run, so neither side pays first-call costs."""
        tokens = min(self.config.warmup_tokens, prepared.settings.max_new_tokens)
        key = (id(prepared.target.model), id(prepared.draft.model) if prepared.draft else None, prepared.spec.mode)
        if tokens <= 0 or key in self._warm:
            return 0.0
        report(1.0, "Warming up (untimed)")
        started = time.perf_counter()
        warm = GenerationSettings(max_new_tokens=tokens, sampling=prepared.settings.sampling, collect_probs=False)
        collect(plain_events(prepared.target, prepared.prompt_ids, warm))
        collect(spec_events(prepared.target, prepared.draft, prepared.prompt_ids, warm, prepared.spec))
        self._warm.add(key)
        return time.perf_counter() - started

    # -- the race ----------------------------------------------------------------------------------------------

    def run(self, prepared: Prepared) -> Iterator[RaceState]:
        """One race; yields the state after every round, and once more when the figures are final.

        Closing this generator (the Stop button, a cancelled or disconnected API client) closes the race, which
        closes both decoders. When the race outlives the configured time budget it stops there, with the figures
        of what both sides wrote so far. Every race ends with one line in the server log (:func:`log_race`).
        """
        state = RaceState(prepared)
        plain = plain_events(prepared.target, prepared.prompt_ids, prepared.settings)
        spec = spec_events(
            prepared.target, prepared.draft, prepared.prompt_ids, prepared.settings, prepared.spec, prepared.calibration
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
            self.finish(state)
            ended = state.stop_reason or "done"
            yield state
        except Exception:
            ended = "error"
            raise
        finally:
            events.close()
            seconds = time.perf_counter() - started
            return_free_memory(collect=False)  # the race's caches and activations: a long session stays flat
            log_race(state, ended, seconds)

    def finish(self, state: RaceState) -> None:
        prepared = state.prepared
        assert prepared is not None
        plain_ids, spec_ids = state.plain.output_ids(), state.spec.output_ids()
        if state.stop_reason is not None:  # compare what both sides wrote
            plain_ids, spec_ids = plain_ids[: len(spec_ids)], spec_ids[: len(plain_ids)]
        position = divergence(plain_ids, spec_ids)
        state.divergence = position
        if position is not None and position < len(plain_ids) and state.greedy:
            try:
                state.margin = divergence_margin(prepared.target, prepared.prompt_ids, plain_ids, position)
            except RuntimeError:  # pragma: no cover - out of memory and the like: the badge says less
                logger.exception("Could not compute the divergence margin")
        state.done = True


def log_race(state: RaceState, ended: str, seconds: float) -> None:
    """One structured line (JSON) about a race that ran: never the prompt's text."""
    prepared = state.prepared
    comparison = state.comparison if ended != "error" else None
    record: dict[str, Any] = {
        "ended": ended,
        "seconds": round(seconds, 3),
        "new_tokens": {"plain": state.plain.counters.new_tokens, "spec": state.spec.counters.new_tokens},
        "speedup": None if comparison is None or comparison.speedup is None else round(comparison.speedup, 4),
        "identical": state.identical,
        "rss_gb": None if (rss := resident_gb()) is None else round(rss, 2),
    }
    if prepared is not None:
        record = {
            "pair": prepared.pair,
            "target": prepared.target_source,
            "draft": prepared.draft_source,
            "mode": prepared.spec.mode,
            "dtype": prepared.target.format,
            "device": str(prepared.target.device),
            "prompt_tokens": len(prepared.prompt_ids),
            "max_new_tokens": prepared.settings.max_new_tokens,
            **record,
        }
    race_logger.info("race %s", json.dumps(record, sort_keys=False))


def log_refusal(reason: str) -> None:
    """One structured line about a request refused before it raced (the reason, never the prompt's text)."""
    race_logger.info("race %s", json.dumps({"ended": "refused", "reason": reason}))


def status_text(state: RaceState | None) -> str:
    if state is None:
        return ""
    prepared = state.prepared
    if not state.done:
        return "Racing… each side is timed only on its own work."
    comparison = state.comparison
    speed = f"{comparison.speedup:.2f}×" if comparison and comparison.speedup else "–"
    load = f" Models ready in {prepared.load_seconds:.1f} s." if prepared and prepared.load_seconds > 1 else ""
    if state.stop_reason is not None:
        return (
            f"Stopped ({state.stop_reason}): so far speculative decoding ran {speed} as fast as plain decoding "
            f"({state.plain.counters.new_tokens} and {state.spec.counters.new_tokens} tokens written).{load}"
        )
    return f"Done: speculative decoding ran {speed} as fast as plain decoding.{load}"


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


def _token_dict(token: TokenEvent) -> dict[str, Any]:
    return {
        "id": token.id,
        "text": token.text,
        "kind": token.kind,
        "round": token.round,
        "draft_prob": token.draft_prob,
        "target_prob": token.target_prob,
    }


def result_dict(state: RaceState, stopped: bool = False) -> dict[str, Any]:
    """The run as JSON: final texts, per-token kinds and metrics (what the ``/race`` API returns)."""
    prepared = state.prepared
    comparison = state.comparison

    def side(pane: PaneState) -> dict[str, Any]:
        return {
            "text": pane.text if pane.finished else "".join(t.text for t in pane.tokens),
            "kinds": [t.kind for t in pane.tokens],
            "tokens": [_token_dict(t) for t in pane.tokens],
            "finish_reason": pane.finish_reason,
            "metrics": pane.metrics().as_dict(),
        }

    spec_side = side(state.spec)
    spec_side["rejected"] = [_token_dict(t) for t in state.spec.rejected]
    result: dict[str, Any] = {
        "plain": side(state.plain),
        "spec": spec_side,
        "comparison": comparison.as_dict() if comparison else None,
        "speedup": comparison.speedup if comparison else None,
        "identical": state.identical,
        "divergence": None
        if state.divergence is None
        else {"position": state.divergence, "logit_margin": state.margin},
        "stopped": stopped or state.stop_reason is not None,
        "stop_reason": state.stop_reason,
    }
    if prepared is not None:
        sampling = prepared.settings.sampling
        result.update(
            {
                "target": prepared.target_source,
                "draft": prepared.draft_source,
                "mode": prepared.spec.mode,
                "draft_tokens": prepared.spec.draft_length,
                "max_new_tokens": prepared.settings.max_new_tokens,
                "temperature": sampling.temperature,
                "top_p": sampling.top_p,
                "seed": sampling.seed,
                "dtype": prepared.target.format,
                "format_reason": prepared.format_reason,
                "device": str(prepared.target.device),
                "prompt_tokens": len(prepared.prompt_ids),
                "calibration": prepared.calibration.as_dict() if prepared.calibration is not None else None,
            }
        )
        result["log"] = state.log().to_json()
    return result


def progress_dict(state: RaceState) -> dict[str, Any]:
    """What the ``/race`` API streams while a race runs: tokens written and own compute seconds per side."""
    return {
        "running": True,
        "plain": {"new_tokens": state.plain.counters.new_tokens, "seconds": state.plain.counters.seconds},
        "spec": {"new_tokens": state.spec.counters.new_tokens, "seconds": state.spec.counters.seconds},
    }


def view(state: RaceState, final: bool, running: bool = True) -> tuple:
    """The Run handler's outputs (see :data:`OUTPUTS`); charts and JSON only with the final state."""
    (plain_title, plain_sub), (spec_title, spec_sub) = pane_titles(state.settings)
    live = running and not final
    values = [
        pane_stats_html(state.plain, plain_title, plain_sub, live and not state.plain.finished),
        state.plain.html(),
        pane_stats_html(state.spec, spec_title, spec_sub, live and not state.spec.finished),
        state.spec.html(),
        speedup_html(state),
        figures_html(state),
        identical_html(state),
        status_text(state),
    ]
    if final:
        values += [
            race_frame(state),
            accepted_length_frame(state.spec.counters),
            acceptance_position_frame(state.spec.counters),
            result_dict(state),
        ]
    else:
        values += [gr.skip(), gr.skip(), gr.skip(), gr.skip()]
    values.append(gr.skip())  # the cost curve: set once, when the race starts
    return tuple(values)


def starting_view(prepared: Prepared) -> tuple:
    """The first update of a race: empty panes, cleared charts."""
    state = RaceState(prepared)
    values = list(view(state, final=False))
    for name in ("race_plot", "length_plot", "position_plot", "result"):
        values[OUTPUTS.index(name)] = None
    values[OUTPUTS.index("status")] = "Racing… each side is timed only on its own work."
    values[OUTPUTS.index("cost_plot")] = cost_plot_update(prepared)
    return tuple(values)


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
    draft_cost = 0.0 if prepared.spec.mode == "ngram" else None  # an n-gram draft costs nothing to make
    title = f"On this machine a pass over k tokens costs this much of a one-token pass ({curve.hardware.describe()}, " \
        f"{curve.dtype})"
    return gr.update(value=cost_frame(curve, draft_cost), visible=True, title=title)


# ----------------------------------------------------------------------------------------------------------------
# handlers


@dataclass
class Handlers:
    """The app's event handlers, bound to one :class:`Racer` (tests drive these directly)."""

    racer: Racer
    race: Callable[..., Iterator[tuple]]
    api: Callable[..., Iterator[dict]]
    race_validator: Callable[..., list[dict]]  # the queue runs these before queueing: bad input never waits
    api_validator: Callable[..., list[dict]]


def example_prompts(config: AppConfig) -> list[tuple[str, str]]:
    """(label, text) of one prompt per example category, from the bundled prompt set."""
    try:
        prompts = config.examples if config.examples is not None else load_prompts()
    except PromptFileError as error:
        logger.warning("No examples: %s", error)
        return []
    chosen: list[tuple[str, str]] = []
    for category in EXAMPLE_CATEGORIES:
        for prompt in prompts:
            if prompt.category == category:
                words = " ".join(prompt.text.split()[:6])
                label = f"{category.replace('-', ' ').capitalize()}: {words}…"
                chosen.append((label, prompt.text))
                break
    return chosen


def make_handlers(config: AppConfig) -> Handlers:
    racer = Racer(config)

    def race_handler(
        prompt: str,
        pair: str,
        target: str,
        draft: str,
        mode: str,
        draft_tokens: str,
        max_new_tokens: float,
        temperature: float,
        top_p: float,
        seed: float,
        dtype: str,
        quantization: str,
        chat: bool,
        progress: gr.Progress = gr.Progress(),
    ) -> Iterator[tuple]:
        """One Run: load, then one race; yields the panes a few times a second and always the final state."""
        request = RaceRequest(
            prompt, pair, target, draft, mode, draft_tokens, max_new_tokens, temperature, top_p, seed, dtype,
            quantization, chat,
        )

        def report(fraction: float, message: str) -> None:
            progress(max(0.0, min(1.0, fraction)), desc=message)

        try:
            prepared = racer.prepare(request, report)
        except InputError as error:
            raise gr.Error(str(error), print_exception=False) from None
        for warning in prepared.warnings:
            gr.Warning(warning)
        yield starting_view(prepared)
        states = racer.run(prepared)
        interval = config.update_interval
        last = time.monotonic()
        state: RaceState | None = None
        try:
            for state in states:
                if state.done:
                    break
                now = time.monotonic()
                if now - last >= interval:
                    yield view(state, final=False)
                    last = now
        except (RuntimeError, ValueError) as error:
            logger.exception("The race failed")
            raise gr.Error(f"the race failed: {_first_line(error)}", print_exception=False) from None
        finally:
            states.close()  # on Stop, Gradio closes this generator: the race and both decoders close with it
        if state is not None:
            yield view(state, final=True)

    def api_race(
        prompt: str,
        pair: str = "",
        mode: str = "draft",
        draft_tokens: str = "adaptive",
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
        chat: bool = True,
        target: str = "",
        draft: str = "",
        dtype: str = "",
    ) -> Iterator[dict]:
        """Run one race to the end: a short progress object after every round, then the final texts, per-token
        kinds and metrics as JSON (``client.predict`` returns that last one).

        Yielding every round lets the queue close the race within one round when the client cancels or
        disconnects, so the worker is free for the next visitor.
        """
        request = api_request(
            prompt, pair, mode, draft_tokens, max_new_tokens, temperature, top_p, seed, chat, target, draft, dtype
        )
        try:
            prepared = racer.prepare(request)
        except InputError as error:
            raise gr.Error(str(error), print_exception=False) from None
        states = racer.run(prepared)
        state = None
        try:
            for state in states:
                if state.done:
                    break
                yield progress_dict(state)
        except (RuntimeError, ValueError) as error:
            logger.exception("The race failed")
            raise gr.Error(f"the race failed: {_first_line(error)}", print_exception=False) from None
        finally:
            states.close()
        assert state is not None
        yield result_dict(state)

    def validation(request: RaceRequest, names: Sequence[str]) -> list[dict]:
        """One ``gr.validate`` per input: the cheap checks of :meth:`Racer.check`, the message on the input at
        fault (or on the prompt)."""
        try:
            racer.check(request)
        except InputError as error:
            log_refusal(str(error))
            blamed = error.field if error.field in names else names[0]
            return [gr.validate(name != blamed, str(error) if name == blamed else "") for name in names]
        return [gr.validate(True, "") for _ in names]

    def race_validator(*values: Any) -> list[dict]:
        return validation(RaceRequest(*values), INPUTS)

    def api_request(
        prompt: str,
        pair: str = "",
        mode: str = "draft",
        draft_tokens: str = "adaptive",
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
        chat: bool = True,
        target: str = "",
        draft: str = "",
        dtype: str = "",
    ) -> RaceRequest:
        """The request behind a ``/race`` call (its inputs in :data:`API_INPUTS` order)."""
        return RaceRequest(
            prompt, pair or None, target, draft, mode, draft_tokens, max_new_tokens, temperature, top_p, seed,
            dtype or config.dtype, "none", chat,
        )

    def api_validator(*values: Any, **named: Any) -> list[dict]:
        return validation(api_request(*values, **named), API_INPUTS)

    return Handlers(
        racer,
        gpu(race_handler, duration=config.gpu_duration),
        gpu(api_race, duration=config.gpu_duration),
        race_validator,
        api_validator,
    )


# ----------------------------------------------------------------------------------------------------------------
# recordings of a finished race

#: the files of the download row, in order: the cheap ones (written as soon as a race ends), then the videos
RECORD_FILES = ("json", "html")
RECORD_VIDEOS = ("mp4", "gif")
RECORD_LABELS = {"json": "JSON log", "html": "HTML replay", "mp4": "MP4 video", "gif": "GIF"}


class Recorder:
    """Writes a finished race's recordings for download, from the ``/race`` JSON the page holds (its ``"log"``).

    Runs after the race has ended (chained to it, on the device's queue, so it never competes with a race). Each
    call writes into a fresh folder under one temporary folder per app and removes all but the latest few (Gradio
    has copied the files it serves into its own cache by then). A failed render warns in one line and leaves the
    buttons off; the app keeps serving.
    """

    def __init__(self, keep: int = 4) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="specdemo-recordings-"))
        weakref.finalize(self, shutil.rmtree, self.root, ignore_errors=True)
        self.keep = keep
        self.made = 0

    def _folder(self) -> Path:
        self.made += 1
        folder = self.root / f"race-{self.made:05d}"
        folder.mkdir()
        for old in sorted(self.root.iterdir())[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        return folder

    def _write(self, result: dict | None, kinds: Sequence[str]) -> list[Path] | None:
        """The files of ``kinds`` for the race in ``result``; None when there is none or rendering failed."""
        if not isinstance(result, dict) or "log" not in result:
            return None
        try:
            log = RaceLog.from_json(result["log"], source="the race's JSON")
            folder = self._folder()
            return [write_recording(log, kind, folder / f"specdemo-race.{kind}") for kind in kinds]
        except (RaceLogError, OSError, ValueError, RuntimeError) as error:
            logger.exception("Recording the race failed")
            gr.Warning(f"recording failed: {_first_line(error)}")
            return None

    @staticmethod
    def _buttons(kinds: Sequence[str], paths: list[Path] | None) -> list[gr.DownloadButton]:
        if paths is None:
            return [gr.DownloadButton(RECORD_LABELS[kind], value=None, interactive=False) for kind in kinds]
        return [
            gr.DownloadButton(f"{RECORD_LABELS[kind]} ({path.stat().st_size / 1e6:.2f} MB)", value=str(path),
                              interactive=True)
            for kind, path in zip(kinds, paths)
        ]

    def files(self, result: dict | None) -> tuple:
        """The JSON log and the HTML replay (milliseconds)."""
        return tuple(self._buttons(RECORD_FILES, self._write(result, RECORD_FILES)))

    def videos(self, result: dict | None) -> tuple:
        """The MP4 and the GIF (seconds on a CPU), and the MP4 again for the preview player."""
        paths = self._write(result, RECORD_VIDEOS)
        return (*self._buttons(RECORD_VIDEOS, paths), str(paths[0]) if paths else None)

    @classmethod
    def clear(cls) -> tuple:
        """Every download off and the preview empty (a new race is starting)."""
        return (*cls._buttons(RECORD_FILES + RECORD_VIDEOS, None), None)


# ----------------------------------------------------------------------------------------------------------------
# the page

# A stream update already on its way when Stop is pressed can land after the cancel and redraw a "running…" chip, so
# the page stays marked as stopped (until the next Run) and an observer re-marks whatever such a late update draws.
STOP_JS = (
    "() => { window.specdemoStopped = true; const mark = () => { "
    "document.querySelectorAll('.chip-running').forEach(c => "
    "{ c.textContent = 'stopped'; c.className = 'chip chip-idle'; }); "
    "document.querySelectorAll('#identical .badge-pending').forEach(b => { "
    "const text = 'stopped before the end: no comparison'; if (b.textContent !== text) b.textContent = text; }); }; "
    "window.specdemoMarkStopped = mark; mark(); if (!window.specdemoStopObserver) { window.specdemoStopObserver = new MutationObserver("
    "() => { if (window.specdemoStopped) window.specdemoMarkStopped(); }); "
    "window.specdemoStopObserver.observe(document.body, {childList: true, subtree: true}); } return []; }"
)
RUN_JS = "(...inputs) => { window.specdemoStopped = false; return inputs; }"  # runs before the race, inputs unchanged
STOPPED_TEXT = "Stopped: the race was cancelled; the panes show how far each side got."

SHOW_REJECTED_JS = "(show) => { document.body.classList.toggle('show-rejected', !!show); return []; }"

INTRO = """\
# ⚡ Speculative decoding race
Plain decoding (left) and speculative decoding (right) write **the same text with the same target model**, in
one fair race: the two decoders take turns, each timed only on its own work, so each pane fills at the speed it
would have alone. A small draft model (or an n-gram lookup in the prompt) proposes a few tokens; the target
checks them all in one forward pass and keeps the longest correct prefix plus one token of its own.
"""


def _pair_info(config: AppConfig, key: str) -> str:
    preset = config.presets.get(key)
    if preset is None:
        return ""
    memory = preset.resident_memory or "not measured yet (Hub models); see the hardware line"
    info = f"{preset.description}  \n*Hardware:* {preset.hardware}  \n*Measured memory:* {memory}"
    return f"{info}  \n*Target format:* {_format_note(config, preset.target)}"


def _format_note(config: AppConfig, target: str) -> str:
    """The format the target runs in here, as far as it is known before a race."""
    if config.dtype != "auto":
        return config.dtype
    try:
        device = resolve_device(config.device)
    except ModelLoadError:
        return "auto"
    if device.type != "cpu" or not config.calibrate:
        return f"auto ({resolve_format('auto', device)} on {device.type})"
    choice = cached_format_choice(target, LoadSettings(dtype="auto", device=config.device))
    if choice is None:
        return ("auto: w8a8, int8 or bfloat16, whichever decodes faster here where speculation can pay (measured at "
                "the first race)")
    return f"{choice.format} ({choice.reason})"


def mode_for_pair(config: AppConfig, key: str, current: str) -> str:
    """The mode a preset is meant for ("uag" for a pair with different tokenizers); keeps ``current`` otherwise,
    except that a same-tokenizer pair leaves the uag mode for draft mode."""
    preset = config.presets.get(key)
    if preset is None:
        return current
    if preset.mode == "uag":
        return "uag"
    return "draft" if current == "uag" else current


def build_app(config: AppConfig | None = None) -> gr.Blocks:
    """The whole page: controls, the two panes, the run figures, the charts and the ``/race`` API."""
    config = config or AppConfig()
    handlers = make_handlers(config)
    default_pair = config.default_pair()
    quant_reason = config.quantization_unavailable()
    examples = example_prompts(config)
    initial_titles = pane_titles(None)

    with gr.Blocks(title=config.title, analytics_enabled=False) as demo:
        gr.Markdown(INTRO)
        with gr.Row(equal_height=False):
            with gr.Column(scale=3):
                prompt = gr.Textbox(
                    label="Prompt",
                    placeholder="Type a prompt, or pick an example below",
                    lines=6,
                    max_lines=14,
                    elem_id="prompt",
                )
                with gr.Row():
                    run = gr.Button("Run the race", variant="primary", elem_id="run", scale=3)
                    stop = gr.Button("Stop", variant="stop", elem_id="stop", scale=1)
            with gr.Column(scale=2):
                pair = gr.Dropdown(
                    choices=[(p.label, p.key) for p in config.presets.values()],
                    value=default_pair,
                    label="Target + draft pair",
                    elem_id="pair",
                )
                pair_info = gr.Markdown(_pair_info(config, default_pair), elem_id="pair-info")
                with gr.Row():
                    mode = gr.Dropdown(
                        choices=[(f"{label}", key) for key, label in SPEC_MODES.items()],
                        value=next(iter(SPEC_MODES)),
                        label="Speculative mode",
                        elem_id="mode",
                    )
                    draft_tokens = gr.Dropdown(
                        choices=[("adaptive (cost-aware)", "adaptive"), ("heuristic (+2/−1)", "heuristic")]
                        + [(k, k) for k in DRAFT_LENGTHS[2:]],
                        value=config.draft_tokens if config.draft_tokens in DRAFT_LENGTHS else "adaptive",
                        label="Draft tokens per round",
                        elem_id="draft-tokens",
                    )
                max_new_tokens = gr.Slider(
                    1,
                    config.max_new_tokens_limit,
                    value=config.max_new_tokens,
                    step=1,
                    label="Max new tokens",
                    elem_id="max-new-tokens",
                )
        with gr.Accordion("More settings", open=False):
            with gr.Row(visible=config.custom_models):
                target = gr.Textbox(
                    label="Custom target (Hub id, local folder, .gguf or offline:NAME)",
                    placeholder="empty: the pair's target",
                    visible=config.custom_models,
                    elem_id="custom-target",
                )
                draft = gr.Textbox(
                    label="Custom draft (must share the target's tokenizer)",
                    placeholder="empty: the pair's draft",
                    visible=config.custom_models,
                    elem_id="custom-draft",
                )
            with gr.Row():
                temperature = gr.Slider(0.0, 2.0, value=0.0, step=0.05, label="Temperature (0 = greedy)")
                top_p = gr.Slider(0.05, 1.0, value=1.0, step=0.05, label="Top-p")
                seed = gr.Number(value=0, precision=0, label="Seed")
            with gr.Row():
                dtype = gr.Dropdown(
                    choices=list(DTYPES), value=config.dtype if config.dtype in DTYPES else "auto", label="dtype"
                )
                quantization = gr.Radio(
                    choices=[("none", "none"), ("8-bit", "8bit"), ("4-bit", "4bit")],
                    value="none",
                    label="Target quantization",
                    info=quant_reason or "bitsandbytes, target only",
                    interactive=quant_reason is None,
                    elem_id="quantization",
                )
                chat = gr.Checkbox(value=True, label="Chat template", info="wrap the prompt as one user turn")
        if examples:
            gr.Examples(
                examples=[[text] for _, text in examples],
                inputs=[prompt],
                example_labels=[label for label, _ in examples],
                cache_examples=False,
                label="Examples",
            )
        with gr.Row(equal_height=True):
            gr.HTML(legend_html(), elem_id="legend")
            show_rejected = gr.Checkbox(value=False, label="Show rejected drafts (struck through)", scale=0,
                                        min_width=260, elem_id="show-rejected")
        with gr.Row(equal_height=False):
            with gr.Column():
                plain_stats = gr.HTML(
                    pane_stats_html(PaneState("plain"), *initial_titles[0], running=False), elem_id="plain-stats"
                )
                plain_output = gr.HTML(
                    "", html_template="<div class='tok-box'>${value}</div>", elem_id="plain-output",
                    max_height=520, autoscroll=True,
                )
            with gr.Column():
                spec_stats = gr.HTML(
                    pane_stats_html(PaneState("spec"), *initial_titles[1], running=False), elem_id="spec-stats"
                )
                spec_output = gr.HTML(
                    "", html_template="<div class='tok-box'>${value}</div>", elem_id="spec-output",
                    max_height=520, autoscroll=True,
                )
        with gr.Row(equal_height=True):
            with gr.Column(scale=1, min_width=200):
                speedup = gr.HTML(speedup_html(None), elem_id="speedup")
            with gr.Column(scale=2, min_width=380):
                figures = gr.HTML(figures_html(None), elem_id="figures")
            with gr.Column(scale=1, min_width=200):
                identical = gr.HTML(identical_html(None), elem_id="identical")
        status = gr.Markdown("", elem_id="status")
        with gr.Accordion("Recording of the race (after a run)", open=True):
            with gr.Row(equal_height=True):
                downloads = {
                    kind: gr.DownloadButton(RECORD_LABELS[kind], interactive=False, elem_id=f"download-{kind}")
                    for kind in RECORD_FILES + RECORD_VIDEOS
                }
            video_preview = gr.Video(label="The race as a video (MP4)", interactive=False, format="mp4", height=400,
                                     elem_id="video-preview")
        with gr.Accordion("Charts (after a run)", open=True):
            with gr.Row():
                race_plot = gr.LinePlot(
                    x="seconds",
                    y="tokens",
                    color="side",
                    color_map=SIDE_COLOURS,
                    title="The race: tokens over own compute time",
                    x_title="seconds of own compute",
                    y_title="tokens",
                    elem_id="race-plot",
                )
                length_plot = gr.BarPlot(
                    x="tokens per pass",
                    y="rounds",
                    title="Tokens per target pass (histogram)",
                    sort=[str(k) for k in range(1, 65)],
                    elem_id="length-plot",
                )
                position_plot = gr.BarPlot(
                    x="draft position",
                    y="acceptance rate",
                    title="Acceptance by draft position (Medusa: head k drafts position k)",
                    y_lim=[0, 1],
                    sort=[str(k) for k in range(1, 65)],
                    elem_id="position-plot",
                )
            cost_plot = gr.BarPlot(
                x="tokens in the pass",
                y="cost (one-token passes)",
                color="speculation",
                color_map=COST_COLOURS,
                tooltip="all",
                title="On this machine a pass over k tokens costs this much of a one-token pass",
                sort=[str(k) for k in PASS_LENGTHS],
                visible=False,
                elem_id="cost-plot",
            )
        with gr.Accordion("Run data (JSON, as the /race API returns it)", open=False):
            result = gr.JSON(elem_id="result")

        inputs = [prompt, pair, target, draft, mode, draft_tokens, max_new_tokens, temperature, top_p, seed, dtype,
                  quantization, chat]
        outputs = [plain_stats, plain_output, spec_stats, spec_output, speedup, figures, identical, status, race_plot,
                   length_plot, position_plot, result, cost_plot]
        assert len(inputs) == len(INPUTS) and len(outputs) == len(OUTPUTS)
        run_event = run.click(
            handlers.race,
            inputs=inputs,
            outputs=outputs,
            concurrency_limit=1,
            concurrency_id="device",
            api_visibility="undocumented",
            api_name="race_stream",
            show_progress="minimal",
            validator=handlers.race_validator,
            js=RUN_JS,
        )
        # recordings: only once the race has ended, on the device's queue so that no race runs meanwhile
        recorder = Recorder()
        run.click(Recorder.clear, outputs=[*downloads.values(), video_preview], queue=False, api_visibility="private")
        run_event.success(
            recorder.files,
            inputs=result,
            outputs=[downloads[kind] for kind in RECORD_FILES],
            concurrency_limit=1,
            concurrency_id="device",
            api_visibility="private",
            show_progress="hidden",
        ).success(
            recorder.videos,
            inputs=result,
            outputs=[*(downloads[kind] for kind in RECORD_VIDEOS), video_preview],
            concurrency_limit=1,
            concurrency_id="device",
            api_visibility="private",
            show_progress="minimal",
        )
        # the status after the cancel, so that it comes after the race's last update
        stop.click(fn=None, cancels=[run_event], js=STOP_JS).then(
            lambda: STOPPED_TEXT, outputs=status, queue=False, api_visibility="private"
        )
        pair.change(lambda key: _pair_info(config, key), inputs=pair, outputs=pair_info, queue=False,
                    api_visibility="private")
        pair.change(lambda key, current: mode_for_pair(config, key, current), inputs=[pair, mode], outputs=mode,
                    queue=False, api_visibility="private")
        show_rejected.change(fn=None, inputs=show_rejected, js=SHOW_REJECTED_JS)
        api = gr.api(handlers.api, api_name="race", concurrency_limit=1, concurrency_id="device")
        demo.fns[api["id"]].validator = handlers.api_validator  # gr.api takes no validator argument (Gradio 6)
    demo.queue(max_size=config.max_queue, default_concurrency_limit=1)
    demo.specdemo_handlers = handlers  # for tests and embedding
    demo.specdemo_recorder = recorder
    return demo


def preload(demo: gr.Blocks) -> None:
    """Load the default pair now (ZeroGPU Spaces want models loaded before serving); failures only log."""
    racer: Racer = demo.specdemo_handlers.racer
    config = racer.config
    key = config.default_pair()
    preset = config.presets[key]
    settings = LoadSettings(dtype=config.dtype, device=config.device)
    try:
        racer._switch_pair(preset.target, settings, preset.draft, settings)
        racer._load(preset.target, settings, lambda f, m: None, "target")
        racer._load(preset.draft, settings, lambda f, m: None, "draft")
    except InputError as error:
        logger.warning("Preloading %s failed: %s", key, error)


def launch(demo: gr.Blocks, **kwargs: Any) -> Any:
    """``demo.launch`` with the page's CSS (Gradio 6 takes CSS at launch)."""
    kwargs.setdefault("css", CSS)
    kwargs.setdefault("footer_links", ["api", "gradio"])
    return demo.launch(**kwargs)
