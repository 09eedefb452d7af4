"""What one race may ask for, and every check that needs no model (or only the target's tokenizer).

:class:`RaceRequest` is a race as a front end sends it (the app's controls, the ``/race`` API, the recorder's
options); :func:`check_request` turns it into a :class:`Checked` request, or refuses it with one plain line (an
:class:`~specdemo.core.errors.InputError` that names the input at fault). The prompt checks run in two steps: by
characters before anything loads (:func:`check_prompt_chars`), then by tokens once the target's tokenizer has
counted it (:func:`check_prompt_tokens`, :func:`check_lengths`). The parsers are shared with the bench, so every
front end takes the same values within the same limits.
"""

from __future__ import annotations

import logging
import math
import os
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator, Sequence

from ..backends.loading import FORMATS, HUB_ID, LoadedModel
from ..backends.offline import is_offline_source
from ..core.errors import InputError, first_line
from ..core.settings import MAX_NEW_TOKENS, GenerationSettings, SamplingSettings
from ..methods import MAX_NUM_DRAFT_TOKENS, METHODS, SpecSettings, get_method
from ..methods.draft_length import NUM_DRAFT_TOKENS_SCHEDULES
from .config import SessionConfig
from .presets import PairPreset, preset_eagle_head

logger = logging.getLogger(__name__)

#: the target formats every front end offers (the app's dropdown, ``app.py --dtype``, the bench, the recorder)
DTYPES = ("auto", *FORMATS)
#: bitsandbytes quantisation of the target, by the name the front ends take
QUANTIZATIONS: dict[str, str | None] = {"none": None, "8bit": "8bit", "4bit": "4bit"}
#: no real text averages more characters per token than this, so a longer prompt is over the cap for certain
MAX_CHARS_PER_TOKEN = 12


@dataclass
class RaceRequest:
    """Everything one race asks for, as the front end sends it (unparsed)."""

    prompt: str
    pair: str | None = None
    target: str = ""
    draft: str = ""
    mode: str = "draft"
    num_draft_tokens_schedule: str | None = None  # None or empty: "fixed" when num_draft_tokens is given, else adaptive
    num_draft_tokens: Any = None
    max_new_tokens: Any = 128
    temperature: float = 0.0
    top_p: float = 1.0
    seed: Any = 0
    dtype: str = "auto"
    quantization: str | None = "none"
    chat: bool = True


@dataclass(frozen=True)
class Checked:
    """A request that passed every check that needs no model (see :func:`check_request`)."""

    settings: GenerationSettings
    spec: SpecSettings
    dtype: str
    quantization: str | None
    target_source: str
    draft_source: str | None
    preset: PairPreset | None
    max_prompt_tokens: int
    #: the sources that must not be read from this machine's disk (a hosted app's custom Hub ids)
    remote_only: frozenset[str] = field(default_factory=frozenset)


@contextmanager
def _blame(name: str) -> Iterator[None]:
    """Turn an InputError or ValueError raised inside into an InputError that names the input ``name``."""
    try:
        yield
    except InputError as error:
        raise InputError(str(error), error.field or name) from None
    except ValueError as error:
        raise InputError(first_line(error), name) from None


# ----------------------------------------------------------------------------------------------------------------
# parsers (shared with the bench)


def _blank(value: Any) -> bool:
    return value is None or (isinstance(value, str) and not value.strip())


def parse_draft_length(schedule: Any, num_draft_tokens: Any) -> tuple[str, int | None]:
    """(``num_draft_tokens_schedule``, ``num_draft_tokens``) of a request: the schedule one of
    :data:`~specdemo.methods.draft_length.NUM_DRAFT_TOKENS_SCHEDULES` (empty: "fixed" when a number is given, else
    "adaptive"), the number a whole number from 1 to :data:`~specdemo.methods.MAX_NUM_DRAFT_TOKENS` or None (empty:
    the schedule's own start). InputError naming the setting at fault otherwise."""
    count = None
    if not _blank(num_draft_tokens):
        text = num_draft_tokens.strip().lower() if isinstance(num_draft_tokens, str) else None
        if text in NUM_DRAFT_TOKENS_SCHEDULES:
            raise InputError(f"num_draft_tokens is a number of tokens; {text!r} is a schedule: give it as "
                             "num_draft_tokens_schedule", field="num_draft_tokens")
        try:
            number = math.nan if isinstance(num_draft_tokens, bool) else float(num_draft_tokens)
        except (TypeError, ValueError):
            number = math.nan
        if not number.is_integer() or not 1 <= number <= MAX_NUM_DRAFT_TOKENS:
            raise InputError(f"num_draft_tokens must be a whole number from 1 to {MAX_NUM_DRAFT_TOKENS}, got "
                             f"{num_draft_tokens!r}", field="num_draft_tokens")
        count = int(number)
    if _blank(schedule):
        return ("adaptive" if count is None else "fixed"), count
    name = schedule.strip().lower() if isinstance(schedule, str) else schedule
    if name not in NUM_DRAFT_TOKENS_SCHEDULES:
        raise InputError(f"num_draft_tokens_schedule must be one of {', '.join(NUM_DRAFT_TOKENS_SCHEDULES)}, got "
                         f"{schedule!r}", field="num_draft_tokens_schedule")
    if name == "fixed" and count is None:
        raise InputError("num_draft_tokens_schedule 'fixed' needs num_draft_tokens, the tokens drafted every round "
                         f"(1 to {MAX_NUM_DRAFT_TOKENS})", field="num_draft_tokens")
    return name, count


def parse_max_new_tokens(value: Any, limit: int = MAX_NEW_TOKENS) -> int:
    """A whole number of new tokens from 1 to ``limit``."""
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
    """A whole number >= 0, or None (empty: unseeded)."""
    if value is None or value == "":
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise InputError(f"the seed must be a whole number, got {value!r}") from None
    if not number.is_integer() or number < 0:
        raise InputError(f"the seed must be a whole number >= 0, got {value!r}")
    return int(number)


# ----------------------------------------------------------------------------------------------------------------
# the prompt


def check_prompt_chars(text: str, max_prompt_tokens: int) -> None:
    """Refuse, before any model work, a prompt too long in characters to fit ``max_prompt_tokens`` tokens."""
    if len(text) > max_prompt_tokens * MAX_CHARS_PER_TOKEN:
        raise InputError(
            f"the prompt is too long: {len(text):,} characters, far over the limit of {max_prompt_tokens:,} prompt "
            "tokens on this server; shorten it"
        )


def check_prompt_tokens(prompt_ids: list[int], max_prompt_tokens: int) -> None:
    """Refuse a prompt of more than ``max_prompt_tokens`` tokens (checked before any forward pass)."""
    if len(prompt_ids) > max_prompt_tokens:
        raise InputError(
            f"the prompt is too long: {len(prompt_ids):,} tokens, over the limit of {max_prompt_tokens:,} prompt "
            "tokens on this server; shorten it"
        )


def check_lengths(target: LoadedModel, prompt_ids: list[int], settings: GenerationSettings) -> None:
    """Refuse runs that cannot fit the target's context window, with one clear line."""
    try:
        settings.validate()
    except ValueError as error:
        raise InputError(str(error)) from None
    limit = target.max_context
    if limit is not None and len(prompt_ids) + settings.max_new_tokens > limit:
        raise InputError(
            f"prompt ({len(prompt_ids)} tokens) + max new tokens ({settings.max_new_tokens}) exceeds the model's "
            f"context of {limit} tokens; shorten the prompt or lower max new tokens"
        )


# ----------------------------------------------------------------------------------------------------------------
# the whole request


def hosted_source(text: str, roots: Sequence[str]) -> tuple[str, bool]:
    """(source, may be read from disk) of a custom source on a hosted app: a Hub id or an ``offline:`` name (never
    looked up on disk), or a folder or ``.gguf`` under one of the operator's model roots (as its real path, links
    resolved). Anything else is refused with the same words whether or not such a path exists."""
    if is_offline_source(text) or (HUB_ID.fullmatch(text) and ".." not in text):
        return text, False
    if text.startswith(("/", "~")) and roots:
        real = Path(os.path.realpath(os.path.expanduser(text)))
        for root in roots:
            if real.is_relative_to(os.path.realpath(os.path.expanduser(root))):
                return str(real), True
    allowed = "Hub ids (owner/name)" + (" and paths under this server's model roots" if roots else "")
    raise InputError(f"custom models on this server are {allowed} only")


def resolve_sources(
    request: RaceRequest, config: SessionConfig
) -> tuple[str, str | None, PairPreset | None, frozenset[str]]:
    """(target, draft, preset, remote-only sources) of a request; the custom sources override the preset's. On a
    hosted app a custom source is checked by :func:`hosted_source` before anything else."""
    custom_target = (request.target or "").strip()
    custom_draft = (request.draft or "").strip()
    if (custom_target or custom_draft) and not config.custom_models:
        raise InputError("custom models are switched off on this server: pick a pair preset")
    remote_only: set[str] = set()
    if config.hosted:  # strangers: Hub ids, or folders the operator named

        def hosted(text: str) -> str:
            if not text:
                return text
            source, local = hosted_source(text, config.model_roots)
            if not local:
                remote_only.add(source)
            return source

        custom_target, custom_draft = hosted(custom_target), hosted(custom_draft)
    preset = None
    pair = (request.pair or "").strip() or config.default_pair()
    if pair not in config.presets:
        if not custom_target:
            raise InputError(f"unknown pair {pair!r}; choose one of: {', '.join(config.presets)}")
    else:
        preset = config.presets[pair]
    target = custom_target or (preset.target if preset else "")
    draft = custom_draft or (preset.draft if preset else None)
    method = METHODS.get(request.mode)
    if method is None or not method.needs_draft_model:
        draft = None
    elif not draft:
        raise InputError(f"mode {request.mode!r} needs a draft model: pick a pair or fill in the custom draft")
    return target, draft, preset, frozenset(remote_only)


def check_request(request: RaceRequest, config: SessionConfig) -> Checked:
    """Every check that needs no model (milliseconds): InputError naming the input at fault otherwise.

    The app runs it as the queue's validator too, so bad input is refused at once, never after waiting behind
    other visitors' races.
    """
    with _blame("prompt"):
        if not isinstance(request.prompt, str) or not request.prompt.strip():
            raise InputError("the prompt is empty: type something or pick an example")
        max_prompt_tokens = config.prompt_token_limit()
        check_prompt_chars(request.prompt, max_prompt_tokens)
    with _blame("max_new_tokens"):
        max_new_tokens = parse_max_new_tokens(request.max_new_tokens, config.max_new_tokens_limit)
    with _blame("mode"):
        get_method(request.mode)
    with _blame("num_draft_tokens"):
        schedule, num_draft_tokens = parse_draft_length(request.num_draft_tokens_schedule, request.num_draft_tokens)
        spec = SpecSettings(
            mode=request.mode, num_draft_tokens_schedule=schedule, num_draft_tokens=num_draft_tokens,
            medusa_heads=config.medusa_heads,
            eagle_head=config.eagle_head,
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
        target_source, draft_source, preset, remote_only = resolve_sources(request, config)
    if spec.eagle_head is None and preset_eagle_head(preset, target_source) is not None:
        spec = replace(spec, eagle_head=preset_eagle_head(preset, target_source))  # the preset target's head
    return Checked(settings, spec, dtype, quantization, target_source, draft_source, preset, max_prompt_tokens,
                   remote_only)
