"""Glue between loaded models and the engine: prompt encoding, drafter construction, decoder pairs.

The bench and the app both go through here, so a mode means the same thing everywhere.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, replace
from typing import Collection, Iterator

import torch

from .calibration import CostCurve
from ..methods.draft_length import DraftLengthPolicy, TreeBudget, make_policy
from ..methods.base import NGRAM_PREFERENCES, DraftModelDrafter, Drafter, NgramDrafter
from ..core.loop import GenerationSettings, RoundEvent, plain_decode, seeded_generator, speculative_decode
from ..backends.formats import ROW_WISE_MAX_QUERIES, is_int8_format, output_rows, output_weight
from ..backends.transformers_lm import CachedLM
from ..methods.medusa import MedusaDrafter, MedusaHeads, MedusaLoadError, load_heads, shipped_heads_for
from ..backends.memory import return_free_memory
from ..backends.loading import CacheKey, LoadedModel, clear_model_cache, same_tokenizer
from ..methods.uag import UniversalDrafter, shared_vocabulary, token_bytes

logger = logging.getLogger(__name__)

#: speculative modes; "plain" is the baseline every mode is compared with
SPEC_MODES: dict[str, str] = {
    "draft": "draft model (same tokenizer)",
    "ngram": "n-gram prompt lookup (no draft model)",
    "uag": "draft model with a different tokenizer (universal assisted generation)",
    "medusa": "Medusa heads on the target, a tree of candidates (no draft model)",
    "medusa-chain": "Medusa heads on the target, each head's top token (no draft model)",
}
MODES_NEEDING_DRAFT = {"draft", "uag"}
MEDUSA_MODES = {"medusa", "medusa-chain"}

#: default cap on prompt tokens: a prompt pass is cheap on a GPU, tens of seconds per thousand tokens on a CPU
DEFAULT_MAX_PROMPT_TOKENS = {"cpu": 2048, "mps": 4096, "cuda": 8192}
#: no real text averages more characters per token than this, so a longer prompt is over the cap for certain
MAX_CHARS_PER_TOKEN = 12


class InputError(ValueError):
    """Bad user input, with a message fit to show as is; ``field`` names the input at fault when one is."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


#: the longest draft: its verify pass (the draft and the last token) fits the int8 format's per-query attention
MAX_DRAFT_LENGTH = ROW_WISE_MAX_QUERIES - 1


@dataclass(frozen=True)
class SpecSettings:
    """How the speculative side drafts."""

    mode: str = "draft"
    draft_length: int | str = "adaptive"  # k, "adaptive" (cost-aware) or "heuristic" (+2/-1)
    max_draft_length: int = 12
    head_tokens: int | None = None  # draft LM head restricted to this many frequent ids; None = auto, 0 = full
    confidence_stop: float = 0.0
    draft_int8: bool | None = None  # int8 draft copy; None = on for a CPU draft (uag: only beside an int8 target)
    ngram_min: int = 1
    ngram_max: int = 4
    ngram_prefer: str = "follow"  # which earlier occurrence an n-gram draft copies: "follow", "recent" or "first"
    medusa_heads: str | None = None  # folder of Medusa heads; None = the heads shipped for the target

    def validate(self) -> None:
        if self.mode not in SPEC_MODES:
            raise InputError(f"unknown mode {self.mode!r}; choose one of: {', '.join(SPEC_MODES)}")
        make_policy(self.draft_length, self.max_draft_length)
        if not 1 <= self.max_draft_length <= MAX_DRAFT_LENGTH:
            raise InputError(
                f"the longest draft must be between 1 and {MAX_DRAFT_LENGTH} tokens, got {self.max_draft_length}"
            )
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise InputError(f"n-gram sizes must satisfy 1 <= min <= max, got {self.ngram_min}..{self.ngram_max}")
        if self.ngram_prefer not in NGRAM_PREFERENCES:
            raise InputError(f"n-gram preference must be one of: {', '.join(NGRAM_PREFERENCES)}")


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


def default_max_prompt_tokens(device_type: str) -> int:
    """The prompt cap that fits the hardware: 2,048 tokens on a CPU, more on a GPU."""
    return DEFAULT_MAX_PROMPT_TOKENS.get(device_type, DEFAULT_MAX_PROMPT_TOKENS["cuda"])


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


def release_models(keep: Collection[CacheKey] = ()) -> None:
    """Free every loaded model but those under the cache keys in ``keep``, with what was made from them.

    The int8 copies and heads of drafts are keyed weakly by their model and go with it; the tokenizer tables of
    different-tokenizer drafting are cleared; freed heap pages go back to the system (glibc) so the process's
    resident memory falls, not only Python's.
    """
    clear_model_cache(keep)
    token_bytes.cache_clear()
    shared_vocabulary.cache_clear()
    return_free_memory()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def check_pair(mode: str, target: LoadedModel, draft: LoadedModel | None) -> None:
    if mode in MODES_NEEDING_DRAFT:
        if draft is None:
            raise InputError(f"mode {mode!r} needs a draft model")
        if mode == "draft" and not same_tokenizer(target.tokenizer, draft.tokenizer):
            raise InputError(
                f"the draft {draft.source!r} uses a different tokenizer from the target {target.source!r}: "
                "draft mode compares token ids, so it needs the same tokenizer; use mode 'uag' (different "
                "tokenizers) for this pair"
            )


def _seeded(seed: int | None, device: torch.device) -> torch.Generator | None:
    """The drafter's stream is its own, never the target's: seed + 1."""
    return seeded_generator(None if seed is None else seed + 1, device)


#: Medusa heads loaded per target model (freed with it), by source folder and format
_HEADS: "weakref.WeakKeyDictionary[torch.nn.Module, dict[str, MedusaHeads]]" = weakref.WeakKeyDictionary()


def medusa_heads(target: LoadedModel, source: str | None = None) -> MedusaHeads:
    """The Medusa heads for ``target`` in its format and on its device: from ``source`` (a folder), or the heads
    shipped for an offline target (sha256-checked); InputError with one line when there are none or they misfit."""
    expected_sha256 = None
    if source is None:
        shipped = shipped_heads_for(target.source)
        if shipped is None:
            raise InputError(
                f"no Medusa heads ship for {target.source}: name a heads folder (--medusa-heads PATH), or use "
                "offline:qwen2.5-coder-1.5b",
                field="medusa_heads",
            )
        folder, expected_sha256 = shipped
        source = str(folder)
    per_model = _HEADS.setdefault(target.model, {})
    if source in per_model:
        return per_model[source]
    head = target.model.get_output_embeddings()
    try:
        heads = load_heads(source, head.in_features, head.out_features, expected_sha256)
    except MedusaLoadError as error:
        raise InputError(str(error), field="medusa_heads") from None
    heads = heads.to(device=target.device, dtype=target.dtype)
    per_model[source] = heads
    return heads


def uag_draft_int8(spec: SpecSettings, target: LoadedModel, draft: LoadedModel | None) -> bool:
    """Whether a universal drafter drafts with an int8 copy of its draft: as asked, else only on a CPU beside an
    int8-weight target (int8 or w8a8). There a bfloat16 draft step costs a quarter of a target step under AVX2-only
    kernels and the drafts do not pay (measured: uag 1.00x against 1.08x with the int8 copy); beside a bfloat16
    target the draft keeps its own dtype, as the published bfloat16 figures were measured."""
    if spec.draft_int8 is not None:
        return spec.draft_int8
    return draft is not None and draft.device.type == "cpu" and is_int8_format(target.model)


def make_drafter(
    spec: SpecSettings,
    target: LoadedModel,
    draft: LoadedModel | None,
    settings: GenerationSettings,
    policy: DraftLengthPolicy | None = None,
) -> Drafter:
    spec.validate()
    check_pair(spec.mode, target, draft)
    if spec.mode in MEDUSA_MODES:
        weight = output_weight(target.model)
        tree = spec.mode == "medusa" and settings.sampling.greedy  # sampling is exact on a chain only
        return MedusaDrafter(
            medusa_heads(target, spec.medusa_heads),
            weight,
            settings.sampling,
            target_vocab_size=weight.shape[0],
            eos_token_ids=target.eos_token_ids,
            tree=tree,
            generator=_seeded(settings.sampling.seed, target.device),
            verify_cost=policy.verify_cost if tree and isinstance(policy, TreeBudget) else None,
        )
    if spec.mode == "ngram":
        return NgramDrafter(spec.ngram_min, spec.ngram_max, spec.ngram_prefer)
    assert draft is not None
    if spec.mode == "uag":
        return UniversalDrafter(
            draft.model,
            draft.tokenizer,
            target.tokenizer,
            settings.sampling,
            draft_eos_ids=draft.eos_token_ids,
            generator=_seeded(settings.sampling.seed, draft.device),
            target_vocab_size=output_rows(target.model),
            int8=uag_draft_int8(spec, target, draft),
        )
    return DraftModelDrafter(
        draft.model,
        settings.sampling,
        target_vocab_size=output_rows(target.model),
        eos_token_ids=target.eos_token_ids,
        head_tokens=spec.head_tokens,
        confidence_stop=spec.confidence_stop,
        generator=_seeded(settings.sampling.seed, draft.device),
        int8=spec.draft_int8,
    )


def policy_prior(
    calibration: CostCurve | None, target: LoadedModel, draft: LoadedModel | None, mode: str
) -> CostCurve | None:
    """The part of a cost curve that holds for this run: none for another target or format; its draft step only
    for draft mode with the draft it timed (a uag draft's step leaves out its text re-encoding)."""
    if calibration is None or calibration.target != target.source:
        return None
    if calibration.dtype != target.format:
        return None
    if mode != "draft" or draft is None or calibration.draft != draft.source:
        return replace(calibration, draft_seconds_per_token=None, draft=None)
    return calibration


def plain_events(target: LoadedModel, prompt_ids: list[int], settings: GenerationSettings) -> Iterator[RoundEvent]:
    return plain_decode(CachedLM(target.model), prompt_ids, settings, target.eos_token_ids, target.tokenizer)


def spec_events(
    target: LoadedModel,
    draft: LoadedModel | None,
    prompt_ids: list[int],
    settings: GenerationSettings,
    spec: SpecSettings,
    calibration: CostCurve | None = None,
) -> Iterator[RoundEvent]:
    """The speculative side of a run; ``calibration`` (this machine's cost curve for this target and format, see
    :mod:`specdemo.session.calibration`) gives the adaptive draft length somewhere to start from."""
    prior = policy_prior(calibration, target, draft, spec.mode)
    if spec.mode in MEDUSA_MODES:
        heads = medusa_heads(target, spec.medusa_heads)
        if spec.mode == "medusa" and settings.sampling.greedy and spec.draft_length == "adaptive":
            policy: DraftLengthPolicy = TreeBudget(k_max=spec.max_draft_length, prior=prior)
        else:  # a chain is at most one token per head; drafting it costs next to nothing
            policy = make_policy(spec.draft_length, min(spec.max_draft_length, heads.config.num_heads),
                                 free_drafts=True, prior=prior)
    else:
        policy = make_policy(spec.draft_length, spec.max_draft_length, free_drafts=spec.mode == "ngram", prior=prior)
    drafter = make_drafter(spec, target, draft, settings, policy)
    return speculative_decode(
        CachedLM(target.model), drafter, policy, prompt_ids, settings, target.eos_token_ids, target.tokenizer
    )
