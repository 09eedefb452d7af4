"""Universal assisted generation: a draft model with a different tokenizer drafts through text.

The draft keeps its own token stream and KV cache. Each round the target's new text is re-encoded with the draft
tokenizer behind a short anchor of recent draft tokens (so a token that spans the seam re-forms correctly), the
draft cache is cropped at the first changed token (never rebuilt from the start), the draft writes k tokens in its
own vocabulary, and its text is encoded back into target tokens behind an anchor of recent target tokens.

Greedy decoding verifies the re-encoded draft as a point mass (as for n-gram lookup): output is exactly the
target's, as in every mode. Sampling drafts from the tokens the two vocabularies share (vocabulary intersection,
Timor et al. 2025): the draft's distribution is restricted to tokens whose bytes are the same in both tokenizers,
each sampled draft token is one target token, and its probability moves with it, so ordinary rejection sampling
keeps the output's distribution exactly the target's. Where the vocabularies share too little (or a tokenizer's
pieces cannot be read as bytes), sampling falls back to text drafts verified as a point mass, also exact.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from dataclasses import dataclass, replace
from typing import Any, Sequence

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..backends.formats import is_int8_format, output_rows
from ..backends.int8 import head_rows, int8_copy
from ..backends.loading import LoadedModel
from ..backends.transformers_lm import CachedLM
from ..core.acceptance import target_distribution
from ..core.clock import now
from ..core.errors import InputError
from ..core.protocol import Proposal, RoundResult, TargetPass
from ..core.settings import SamplingSettings
from .base import BuildContext, Method, catch_up, drafter_generator

logger = logging.getLogger(__name__)

_REPLACEMENT = "\ufffd"
ANCHOR_SIZES = (4, 8, 16)
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
#: vocabulary intersection is used for sampling when it covers at least this share of the draft's vocabulary
MIN_SHARED_FRACTION = 0.25


def _decode(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _encode(tokenizer: PreTrainedTokenizerBase, text: str, add_special_tokens: bool = False) -> list[int]:
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def text_after(tokenizer: PreTrainedTokenizerBase, anchor: Sequence[int], ids: Sequence[int]) -> str | None:
    """Text that ``ids`` add after ``anchor`` (decoded together, so leading-space markers and byte pieces resolve
    as in context); None when it cannot be told (the anchor's text is not a prefix, or text ends mid-character)."""
    before = _decode(tokenizer, anchor)
    after = _decode(tokenizer, list(anchor) + list(ids))
    if not after.startswith(before):
        return None
    return after[len(before) :]


def reencode_after(
    tokenizer: PreTrainedTokenizerBase, stream: list[int], text: str, full_text: str, add_bos: bool
) -> list[int]:
    """``stream`` (ids whose text is ``full_text[:-len(text)]``) extended by ``text``, re-tokenised at the seam.

    Tries anchors of the last 4, 8, 16 tokens: the anchor's text plus the new text is encoded, and the result is
    used when its first token is the anchor's first token (the seam before the anchor is then undisturbed; the
    anchor's later tokens may merge with the new text). Falls back to encoding the whole text.
    """
    for size in ANCHOR_SIZES:
        if size >= len(stream):
            break
        anchor = stream[-size:]
        encoded = _encode(tokenizer, _decode(tokenizer, anchor) + text)
        if encoded and encoded[0] == anchor[0]:
            return stream[:-size] + encoded
    return _encode(tokenizer, full_text, add_special_tokens=add_bos)


def to_target_tokens(
    tokenizer: PreTrainedTokenizerBase, context: Sequence[int], text: str, anchor_sizes: Sequence[int] = (4, 2, 1, 6)
) -> list[int]:
    """Target ids that continue ``context`` with ``text``, tokenised together with the context's last tokens.

    Where the text would merge with the context's last token (a newline after a newline, "gan" after "Ve"), the
    target, having written that token, goes on with the text's own tokens: those, when they decode to the text
    after the context; [] when nothing continues the context exactly."""
    if not text:
        return []
    for size in anchor_sizes:
        if size > len(context):
            continue
        anchor = list(context[-size:])
        encoded = _encode(tokenizer, _decode(tokenizer, anchor) + text)
        if encoded[:size] == anchor:
            return encoded[size:]
    alone = _encode(tokenizer, text)
    anchor = list(context[-1:])
    if alone and _decode(tokenizer, anchor + alone) == _decode(tokenizer, anchor) + text:
        return alone
    return []


@functools.lru_cache(maxsize=16)
def token_bytes(tokenizer: PreTrainedTokenizerBase) -> dict[int, bytes]:
    """The bytes each ordinary token stands for (special and added tokens left out).

    Byte-level BPE pieces (``Ġ`` for a space, ``Ċ`` for a newline) go through the GPT-2 byte table; SentencePiece
    pieces turn ``▁`` into a space and byte-fallback pieces ``<0xNN>`` into their byte. Other tokenizers (WordPiece,
    slow Python tokenizers) give an empty map: their pieces do not carry their bytes.
    """
    try:
        decoder = json.loads(tokenizer.backend_tokenizer.to_str()).get("decoder") or {}
    except (AttributeError, ValueError):
        return {}
    kinds = {decoder.get("type")} | {part.get("type") for part in decoder.get("decoders", [])}
    skip = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    if "ByteLevel" in kinds:
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        table = {char: byte for byte, char in bytes_to_unicode().items()}

        def as_bytes(piece: str) -> bytes | None:
            if not all(char in table for char in piece):
                return None
            return bytes(table[char] for char in piece)

    elif kinds & {"Metaspace", "Replace", "ByteFallback"}:

        def as_bytes(piece: str) -> bytes | None:
            byte = _BYTE_PIECE.fullmatch(piece)
            return bytes([int(byte.group(1), 16)]) if byte else piece.replace("\u2581", " ").encode("utf-8")

    else:
        return {}
    result: dict[int, bytes] = {}
    for piece, token_id in tokenizer.get_vocab().items():
        if token_id in skip:
            continue
        value = as_bytes(piece)
        if value:
            result[token_id] = value
    return result


@functools.lru_cache(maxsize=16)
def shared_vocabulary(
    draft_tokenizer: PreTrainedTokenizerBase, target_tokenizer: PreTrainedTokenizerBase
) -> dict[int, int]:
    """Draft token id -> target token id for every token whose bytes both vocabularies have.

    Where the target has two ids for the same bytes (a byte-fallback piece and an ordinary one), the lower id wins,
    so the map is a function; several draft ids may map to one target id (their probabilities then add up).
    """
    by_bytes: dict[bytes, int] = {}
    for token_id, value in sorted(token_bytes(target_tokenizer).items()):
        by_bytes.setdefault(value, token_id)
    return {
        draft_id: by_bytes[value]
        for draft_id, value in token_bytes(draft_tokenizer).items()
        if value in by_bytes
    }


class UniversalDrafter:
    """Drafts with a model whose tokenizer differs from the target's (mode ``uag``)."""

    name = "uag"
    needs_hidden_states = False
    hidden_layers: tuple[int, ...] | None = None

    def __init__(
        self,
        model: PreTrainedModel,
        draft_tokenizer: PreTrainedTokenizerBase,
        target_tokenizer: PreTrainedTokenizerBase,
        sampling: SamplingSettings,
        draft_eos_ids: Sequence[int] = (),
        generator: torch.Generator | None = None,
        target_vocab_size: int | None = None,
        intersection: bool | None = None,
        int8: bool | None = None,
    ) -> None:
        """``intersection``: sample from the shared vocabulary (None: when sampling and enough tokens are shared).

        ``int8``: draft with an int8 copy of the model, LM head included (None: on for a CPU draft); only the draft
        is quantised, so the output stays the target's.
        """
        if int8 is None:
            int8 = next(model.parameters()).device.type == "cpu"
        quantized = int8_copy(model) if int8 else None
        self._head = head_rows(model) if quantized is not None else None
        if self._head is not None:
            model = quantized
        self.lm = CachedLM(model)
        self.draft_tokenizer = draft_tokenizer
        self.target_tokenizer = target_tokenizer
        self.sampling = sampling
        self.draft_eos_ids = set(draft_eos_ids)
        self.generator = generator
        self.shared: tuple[torch.Tensor, torch.Tensor] | None = None  # (allowed draft ids mask, draft -> target id)
        self.target_vocab_size = target_vocab_size or len(target_tokenizer)
        if intersection is not False and not sampling.greedy:
            self.shared = self._shared_tensors(model, intersection is True)
        self.start(())

    def _shared_tensors(self, model: PreTrainedModel, required: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
        mapping = shared_vocabulary(self.draft_tokenizer, self.target_tokenizer)
        ordinary = max(1, len(token_bytes(self.draft_tokenizer)))
        if not mapping or (not required and len(mapping) < MIN_SHARED_FRACTION * ordinary):
            logger.info("uag: vocabularies share %d tokens; sampling verifies text drafts as a point mass", len(mapping))
            return None
        draft_vocab = model.get_output_embeddings().weight.shape[0]
        draft_ids = torch.tensor(list(mapping.keys()), dtype=torch.long, device=self.lm.device)
        target_ids = torch.tensor(list(mapping.values()), dtype=torch.long, device=self.lm.device)
        usable = (draft_ids < draft_vocab) & (target_ids < self.target_vocab_size)
        allowed = torch.zeros(draft_vocab, dtype=torch.bool, device=self.lm.device)
        to_target = torch.zeros(draft_vocab, dtype=torch.long, device=self.lm.device)
        allowed[draft_ids[usable]] = True
        to_target[draft_ids[usable]] = target_ids[usable]
        logger.info("uag: sampling from the %d tokens both vocabularies share", int(allowed.sum()))
        return allowed, to_target

    def start(self, prompt_ids: Sequence[int], prefill: TargetPass | None = None) -> None:
        self.lm.reset()
        self.stream: list[int] = []  # draft ids whose text is exactly self.text
        self.text = ""  # target text synced so far
        self.synced = 0  # target tokens whose text is in self.text
        self._cached: list[int] = []  # draft ids in the draft KV cache

    # -- keeping the draft stream in step with the target's text ------------------------------------------------
    def _sync_text(self, context: Sequence[int]) -> bool:
        """Append the target's new text to the draft stream; False while the context ends mid-character."""
        if self.synced == len(context):
            return True
        if self.synced == 0:
            new_text = _decode(self.target_tokenizer, context)
            if new_text.endswith(_REPLACEMENT):
                return False
            self.text = new_text
            self.stream = _encode(self.draft_tokenizer, new_text, add_special_tokens=True)
            self.synced = len(context)
            return True
        anchor = context[max(0, self.synced - 4) : self.synced]
        new_text = text_after(self.target_tokenizer, anchor, context[self.synced :])
        if new_text is None or new_text.endswith(_REPLACEMENT):
            return False
        self.text += new_text
        self.stream = reencode_after(self.draft_tokenizer, self.stream, new_text, self.text, add_bos=True)
        self.synced = len(context)
        return True

    def _sync_cache(self) -> torch.Tensor:
        """Crop the draft cache at the first token that differs from the stream; return the ids to feed."""
        cached, stream = self._cached, self.stream
        keep = 0
        limit = min(len(cached), len(stream) - 1)
        while keep < limit and cached[keep] == stream[keep]:
            keep += 1
        self.lm.rollback(self.lm.length - keep)
        del cached[keep:]
        fresh = stream[keep:]
        cached.extend(fresh)
        return torch.tensor(fresh, dtype=torch.long, device=self.lm.device)

    # -- drafting -------------------------------------------------------------------------------------------------
    def _next_logits(self, feed: torch.Tensor) -> torch.Tensor:
        """The draft's logits after ``feed`` (through the int8 head when the draft is quantised)."""
        if self._head is None:
            return self.lm.forward(feed, all_logits=False)[-1]
        hidden = self.lm.hidden_states(feed)[-1]
        return self._head(hidden.unsqueeze(0))[0]

    @torch.inference_mode()
    def propose(self, context: Sequence[int], num_draft_tokens: int) -> Proposal:
        if num_draft_tokens <= 0:
            return Proposal()
        started = now(self.lm.device)
        if not self._sync_text(context) or not self.stream:
            return Proposal()
        feed = self._sync_cache()
        synced = now(self.lm.device)
        feed, pass_seconds = catch_up(self.lm, feed)
        catch_up_seconds = synced - started + pass_seconds  # the text sync too grows with the text behind
        if self.shared is not None:
            return replace(self._propose_shared(feed, num_draft_tokens), catch_up_seconds=catch_up_seconds)
        drafted: list[int] = []
        # k draft steps for k target tokens: the draft's pieces are shorter than the target's as often as not, and
        # its last piece is proposed as it stands. An extra step so that the last word comes out whole (a token the
        # target might extend further dropped) doubled the cost of a one-token draft for no gain in acceptance
        # (measured: 43 of 79 accepted either way on chat-03, drafting 58 against 31 ms a round)
        for step in range(num_draft_tokens):
            logits = self._next_logits(feed)
            if self.sampling.greedy:
                token = int(logits.argmax().item())
            else:
                probs = target_distribution(logits, self.sampling)
                token = int(torch.multinomial(probs, 1, generator=self.generator).item())
            drafted.append(token)
            if token in self.draft_eos_ids or step == num_draft_tokens - 1:
                break
            feed = torch.tensor([token], dtype=torch.long, device=self.lm.device)
            self._cached.append(token)
        anchor = self.stream[-4:]
        draft_text = text_after(self.draft_tokenizer, anchor, drafted)
        if not draft_text:
            return Proposal(catch_up_seconds=catch_up_seconds)
        draft_text = draft_text.rstrip(_REPLACEMENT)
        tokens = to_target_tokens(self.target_tokenizer, context, draft_text)
        return Proposal(tokens[:num_draft_tokens], None, catch_up_seconds)

    def _propose_shared(self, feed: torch.Tensor, num_draft_tokens: int) -> Proposal:
        """Sample k draft tokens from the shared vocabulary; each is one target token, with its probability row."""
        assert self.shared is not None
        allowed, to_target = self.shared
        target_ids: list[int] = []
        rows: list[torch.Tensor] = []
        for step in range(num_draft_tokens):
            logits = self._next_logits(feed)
            draft_probs = target_distribution(logits.float().masked_fill(~allowed, float("-inf")), self.sampling)
            token = int(torch.multinomial(draft_probs, 1, generator=self.generator).item())
            target_ids.append(int(to_target[token]))
            rows.append(draft_probs)
            if step == num_draft_tokens - 1:
                break
            feed = torch.tensor([token], dtype=torch.long, device=self.lm.device)
            self._cached.append(token)
        stacked = torch.stack(rows)
        in_target = torch.zeros(len(rows), self.target_vocab_size, dtype=stacked.dtype, device=stacked.device)
        in_target.index_add_(1, to_target[allowed], stacked[:, allowed])
        return Proposal(target_ids, in_target)

    def feedback(self, result: RoundResult) -> None:
        pass


@dataclass(frozen=True)
class UagOptions:
    """``draft_int8``: draft with an int8 copy of the draft model (None: only on a CPU beside an int8 target)."""

    draft_int8: bool | None = None

    def validate(self) -> None:
        pass


def uag_draft_int8(options: Any, target: LoadedModel, draft: LoadedModel | None) -> bool:
    """Whether a universal drafter drafts with an int8 copy of its draft: as asked, else only on a CPU beside an
    int8-weight target (int8 or w8a8). There a bfloat16 draft step costs a quarter of a target step under AVX2-only
    kernels and the drafts do not pay (measured: uag 1.00x against 1.08x with the int8 copy); beside a bfloat16
    target the draft keeps its own dtype, as the published bfloat16 figures were measured."""
    if options.draft_int8 is not None:
        return options.draft_int8
    return draft is not None and draft.device.type == "cpu" and is_int8_format(target.model)


def _check(target: LoadedModel, draft: LoadedModel | None, options: Any) -> None:
    if draft is None:
        raise InputError("mode 'uag' needs a draft model")


def _build(context: BuildContext) -> UniversalDrafter:
    draft, target, settings = context.draft, context.target, context.settings
    assert draft is not None
    return UniversalDrafter(
        draft.model,
        draft.tokenizer,
        target.tokenizer,
        settings.sampling,
        draft_eos_ids=draft.eos_token_ids,
        generator=drafter_generator(settings.sampling.seed, draft.device),
        target_vocab_size=output_rows(target.model),
        int8=uag_draft_int8(context.options, target, draft),
    )


METHOD = Method(
    name="uag",
    label="draft model with a different tokenizer (universal assisted generation)",
    build=_build,
    options=UagOptions,
    needs_draft_model=True,
    other_tokenizer=True,
    check=_check,
    draft_int8=uag_draft_int8,
)
