"""Universal assisted generation: a draft model with a different tokenizer drafts through text.

The draft keeps its own token stream and KV cache. Each round the target's new text is re-encoded with the draft
tokenizer behind a short anchor of recent draft tokens (so a token that spans the seam re-forms correctly), the
draft cache is cropped at the first changed token (never rebuilt from the start), the draft writes k tokens in its
own vocabulary, and its text is encoded back into target tokens behind an anchor of recent target tokens.

Verification treats the result as a point mass (like n-gram lookup): the draft's probabilities are over another
vocabulary, so they are not used, and rejection sampling with a point mass keeps sampled output exact. Greedy
output is exactly the target's, as in every mode.
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .drafters import Proposal
from .lm import CachedLM
from .sampling import SamplingSettings, target_distribution

logger = logging.getLogger(__name__)

_REPLACEMENT = "\ufffd"
ANCHOR_SIZES = (4, 8, 16)


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
    """Target ids that continue ``context`` with ``text``; [] when the text cannot be appended at a token seam
    (it would merge with the context's last token)."""
    if not text:
        return []
    for size in anchor_sizes:
        if size > len(context):
            continue
        anchor = list(context[-size:])
        encoded = _encode(tokenizer, _decode(tokenizer, anchor) + text)
        if encoded[:size] == anchor:
            return encoded[size:]
    return []


class UniversalDrafter:
    """Drafts with a model whose tokenizer differs from the target's (mode ``uag``)."""

    name = "uag"

    def __init__(
        self,
        model: PreTrainedModel,
        draft_tokenizer: PreTrainedTokenizerBase,
        target_tokenizer: PreTrainedTokenizerBase,
        sampling: SamplingSettings,
        draft_eos_ids: Sequence[int] = (),
        generator: torch.Generator | None = None,
    ) -> None:
        self.lm = CachedLM(model)
        self.draft_tokenizer = draft_tokenizer
        self.target_tokenizer = target_tokenizer
        self.sampling = sampling
        self.draft_eos_ids = set(draft_eos_ids)
        self.generator = generator
        self.start(())

    def start(self, prompt_ids: Sequence[int]) -> None:
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
    @torch.inference_mode()
    def propose(self, context: Sequence[int], max_tokens: int) -> Proposal:
        if max_tokens <= 0 or not self._sync_text(context) or not self.stream:
            return Proposal()
        feed = self._sync_cache()
        drafted: list[int] = []
        # draft tokens rarely map one to one; a few extra draft tokens give about max_tokens target tokens
        for step in range(max_tokens + 1):
            logits = self.lm.forward(feed, all_logits=False)[-1]
            if self.sampling.greedy:
                token = int(logits.argmax().item())
            else:
                probs = target_distribution(logits, self.sampling)
                token = int(torch.multinomial(probs, 1, generator=self.generator).item())
            drafted.append(token)
            if token in self.draft_eos_ids or step == max_tokens:
                break
            feed = torch.tensor([token], dtype=torch.long, device=self.lm.device)
            self._cached.append(token)
        anchor = self.stream[-4:]
        draft_text = text_after(self.draft_tokenizer, anchor, drafted)
        if not draft_text:
            return Proposal()
        draft_text = draft_text.rstrip(_REPLACEMENT)
        tokens = to_target_tokens(self.target_tokenizer, context, draft_text)
        ended = drafted[-1] in self.draft_eos_ids
        if not ended and len(tokens) > 1:
            tokens = tokens[:-1]  # the last piece may be a word cut short: the target would merge it further
        return Proposal(tokens[:max_tokens], None)

    def feedback(self, num_drafted: int, num_accepted: int) -> None:
        pass
