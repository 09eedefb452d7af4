"""Glue between loaded models and the engine: prompt encoding, the two decoders of a run, freeing models.

The bench and the racer both go through here, and every mode is what :mod:`specdemo.methods` says it is. The
prompt checks live in :mod:`specdemo.session.request`.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Collection, Iterator

import torch

from ..backends.loading import CacheKey, LoadedModel, clear_model_cache
from ..backends.memory import return_free_memory
from ..backends.static_lm import forget_compiled
from ..backends.suffix_trees import SuffixMemory
from ..core.economics import CostCurve
from ..core.errors import InputError
from ..core.events import RoundEvent
from ..core.loop import plain_decode, speculative_decode
from ..core.settings import GenerationSettings
from ..methods import SpecSettings, get_method, make_drafter, make_spec_policy
from ..methods.uag import shared_vocabulary, token_bytes
from ..backends.passes import EAGER, PLAIN_ROLE, SPEC_ROLE, Passes

logger = logging.getLogger(__name__)


def encode_prompt(target: LoadedModel, text: str, chat: bool = True) -> list[int]:
    """Token ids of a prompt: one user turn through the chat template (when the tokenizer has one), or raw text."""
    if not text or not text.strip():
        raise InputError("the prompt is empty: type something to continue")
    tokenizer = target.tokenizer
    if chat and getattr(tokenizer, "chat_template", None):
        encoded = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=True
        )
        ids = list(encoded["input_ids"])
    else:
        ids = list(tokenizer(text, add_special_tokens=True)["input_ids"])
    if not ids:
        raise InputError("the prompt encodes to no tokens")
    return [int(i) for i in ids]


def release_models(keep: Collection[CacheKey] = ()) -> None:
    """Free every loaded model but those under the cache keys in ``keep``, with what was made from them.

    The int8 copies and heads of drafts are keyed weakly by their model and go with it; the tokenizer tables of
    different-tokenizer drafting are cleared; compiled graphs are dropped (they may hold the models they were made
    for; the next run compiles what it uses in its warm-up); freed heap pages go back to the system (glibc) so the
    process's resident memory falls, not only Python's.
    """
    clear_model_cache(keep)
    forget_compiled()
    token_bytes.cache_clear()
    shared_vocabulary.cache_clear()
    return_free_memory()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def policy_prior(
    calibration: CostCurve | None, target: LoadedModel, draft: LoadedModel | None, mode: str
) -> CostCurve | None:
    """The part of a cost curve that holds for this run: none for another target or format; its draft step only
    for draft mode with the draft it timed (a uag draft's step leaves out its text re-encoding)."""
    if calibration is None or calibration.target != target.source:
        return None
    if calibration.dtype != target.format:
        return None
    if not get_method(mode).calibrated_draft_cost or draft is None or calibration.draft != draft.source:
        return replace(calibration, draft_seconds_per_token=None, draft=None)
    return calibration


def plain_events(
    target: LoadedModel, prompt_ids: list[int], settings: GenerationSettings, passes: Passes = EAGER
) -> Iterator[RoundEvent]:
    """The plain side of a run; ``passes``: how the target's passes run (the same for both sides)."""
    lm = passes.language_model(target, prompt_ids, settings, PLAIN_ROLE)
    return plain_decode(lm, prompt_ids, settings, target.eos_token_ids, target.tokenizer)


def spec_events(
    target: LoadedModel,
    draft: LoadedModel | None,
    prompt_ids: list[int],
    settings: GenerationSettings,
    spec: SpecSettings,
    calibration: CostCurve | None = None,
    memory: SuffixMemory | None = None,
    passes: Passes = EAGER,
) -> Iterator[RoundEvent]:
    """The speculative side of a run; ``calibration`` (this machine's cost curve for this target and format, see
    :mod:`specdemo.session.calibration`) gives the adaptive draft length somewhere to start from; ``memory``: the
    answers of earlier races, for a mode that drafts from them (suffix decoding); ``passes``: how the target's
    passes run."""
    prior = policy_prior(calibration, target, draft, spec.mode)
    policy = make_spec_policy(spec, target, settings, prior)
    drafter = make_drafter(spec, target, draft, settings, policy, memory, passes)
    lm = passes.language_model(target, prompt_ids, settings, SPEC_ROLE)
    return speculative_decode(lm, drafter, policy, prompt_ids, settings, target.eos_token_ids, target.tokenizer)
