"""Draft model with the target's tokenizer: a small causal LM drafts k tokens one by one (mode ``draft``)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from transformers import PreTrainedModel

from ..backends.formats import output_rows
from ..backends.int8 import head_rows, int8_copy, linear_rows
from ..backends.loading import LoadedModel, same_tokenizer
from ..backends.passes import EAGER, Passes
from ..core.acceptance import target_distribution
from ..core.errors import InputError
from ..core.protocol import Proposal, RoundResult, TargetPass
from ..core.settings import SamplingSettings
from .base import (
    BuildContext,
    Method,
    catch_up,
    drafter_generator,
    head_token_ids,
    to_target_vocab,
)

logger = logging.getLogger(__name__)


def drafting_model(model: PreTrainedModel, int8: bool | None) -> PreTrainedModel:
    """The model a draft drafts with: an int8 copy of ``model`` (see :func:`int8_copy`) when ``int8`` (None: for a
    CPU draft) and the copy can be made, else ``model`` itself."""
    if int8 is None:
        int8 = next(model.parameters()).device.type == "cpu"
    quantized = int8_copy(model) if int8 else None
    return model if quantized is None else quantized


def _auto_head_tokens(vocab_size: int) -> int:
    """How many of the most frequent token ids the draft head scores by default (0 = the whole vocabulary)."""
    return 32768 if vocab_size > 65536 else 0


class DraftModelDrafter:
    """A small causal LM with the target's tokenizer drafts k tokens one by one.

    It keeps its own KV cache across rounds and rolls back only the drafted tokens the target rejected. Greedy
    settings draft the argmax; sampling settings sample (with the drafter's own generator) and report the draft
    distribution, as rejection sampling needs.

    ``head_tokens``: score only this many token ids in the draft's LM head (the lowest ids, which in BPE
    vocabularies are the earliest merges, i.e. the most frequent tokens) plus every id of the prompt and the EOS
    ids. With a 151,936-token vocabulary the head is a quarter of a 0.5B draft's weights; restricting it makes
    every draft step cheaper. Verification by the target keeps the output exact either way. 0 = full head,
    None = automatic (32,768 for vocabularies over 65,536).

    ``confidence_stop``: stop drafting this round once the draft's probability of its own token falls below this
    value (0 = never); it only looks at the draft's side, so exactness holds.

    ``int8``: draft with an int8 copy of the model (see :func:`int8_copy`); None = automatic (on for a CPU draft).

    ``passes``: how the draft's passes run for each sequence of at most ``max_new_tokens`` after its prompt (eager,
    or on a static cache compiled as the target's are).
    """

    name = "draft"
    needs_hidden_states = False
    hidden_layers: tuple[int, ...] | None = None

    def __init__(
        self,
        model: PreTrainedModel,
        sampling: SamplingSettings,
        target_vocab_size: int,
        eos_token_ids: Sequence[int] = (),
        head_tokens: int | None = None,
        confidence_stop: float = 0.0,
        generator: torch.Generator | None = None,
        int8: bool | None = None,
        passes: Passes = EAGER,
        max_new_tokens: int = 0,
    ) -> None:
        drafting = drafting_model(model, int8)
        self.int8 = drafting is not model
        self.model = drafting
        self.passes = passes
        self.max_new_tokens = max_new_tokens
        self.lm = EAGER.draft_language_model(drafting, 0)  # each sequence gets its own in start()
        self.sampling = sampling
        self.target_vocab_size = target_vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.confidence_stop = confidence_stop
        self.generator = generator
        head = drafting.get_output_embeddings()
        self._head = head if isinstance(head, torch.nn.Linear) else None
        draft_vocab = self._head.weight.shape[0] if self._head is not None else target_vocab_size
        self.head_tokens = _auto_head_tokens(draft_vocab) if head_tokens is None else head_tokens
        if self._head is None:
            self.head_tokens = 0
        # a restricted head: the frequent ids' rows (the same for every prompt) and the prompt's rarer ids' rows
        self._sub_ids: torch.Tensor | None = None
        self._frequent_head: torch.nn.Module | None = None
        self._rare_head: torch.nn.Module | None = None
        self._cached_ids: list[int] = []

    # -- sequence state ------------------------------------------------------------------------------------------
    def start(self, prompt_ids: Sequence[int], prefill: TargetPass | None = None) -> None:
        self.lm = self.passes.draft_language_model(self.model, len(prompt_ids) + self.max_new_tokens)
        self.lm.reset()
        self._cached_ids = []
        self._sub_ids = None
        if not self.head_tokens or self._head is None:
            return
        draft_vocab = self._head.weight.shape[0]
        if self.head_tokens >= draft_vocab:
            return
        usable = min(draft_vocab, self.target_vocab_size)
        frequent = min(self.head_tokens, usable)
        # the same rows for every prompt: built once per model, not per request
        self._frequent_head = head_rows(self.model, frequent, self.int8)
        ids = head_token_ids(self.head_tokens, usable, prompt_ids, self.eos_token_ids)
        rare = torch.tensor(ids[frequent:], dtype=torch.long, device=self.lm.device)  # ids beyond the frequent ones
        self._rare_head = linear_rows(self._head, rare, self.int8) if rare.numel() else None
        self._sub_ids = torch.tensor(ids, dtype=torch.long, device=self.lm.device)

    def _sync(self, context: Sequence[int]) -> torch.Tensor:
        """Roll the draft cache back to the longest prefix it shares with ``context``; return the ids to feed."""
        cached = self._cached_ids
        keep = min(len(cached), len(context) - 1)
        # the context only grows between rounds, so only the tail (last round's drafts) can differ
        start = max(0, keep - 64)
        if start > 0 and int(context[start - 1]) != cached[start - 1]:
            keep = 0
        else:
            for i in range(start, keep):
                if cached[i] != context[i]:
                    keep = i
                    break
        self.lm.rollback(self.lm.length - keep)
        del cached[keep:]
        fresh = [int(t) for t in context[keep:]]
        cached.extend(fresh)
        return torch.tensor(fresh, dtype=torch.long, device=self.lm.device)

    # -- drafting ------------------------------------------------------------------------------------------------
    def _logits(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits at the last position (over the sub-vocabulary when the head is restricted) and its id map."""
        if self._sub_ids is None:
            logits = self.lm.forward(input_ids, all_logits=False)[-1]
            if logits.shape[0] > self.target_vocab_size:  # padded draft embeddings: never propose those ids
                logits = logits[: self.target_vocab_size]
            return logits, None
        hidden = self.lm.hidden_states(input_ids)[-1]
        assert self._frequent_head is not None
        with torch.inference_mode():
            logits = self._frequent_head(hidden.unsqueeze(0))[0]
            if self._rare_head is not None:
                logits = torch.cat([logits, self._rare_head(hidden.unsqueeze(0))[0]])
        return logits, self._sub_ids

    @torch.inference_mode()
    def propose(self, context: Sequence[int], num_draft_tokens: int) -> Proposal:
        if num_draft_tokens <= 0:
            return Proposal()
        feed, catch_up_seconds = catch_up(self.lm, self._sync(context))
        tokens: list[int] = []
        prob_rows: list[torch.Tensor] = []
        for step in range(num_draft_tokens):
            logits, id_map = self._logits(feed)
            if self.sampling.greedy:
                choice = int(logits.argmax().item())
                if self.confidence_stop > 0.0 and step > 0:
                    confidence = float(logits.float().softmax(-1)[choice])
                    if confidence < self.confidence_stop:
                        break
            else:
                probs = target_distribution(logits, self.sampling)
                choice = int(torch.multinomial(probs, 1, generator=self.generator).item())
                if self.confidence_stop > 0.0 and step > 0 and float(probs[choice]) < self.confidence_stop:
                    break
                prob_rows.append(to_target_vocab(probs, id_map, self.target_vocab_size))
            token = choice if id_map is None else int(id_map[choice])
            tokens.append(token)
            if step + 1 < num_draft_tokens:
                feed = torch.tensor([token], dtype=torch.long, device=self.lm.device)
                self._cached_ids.append(token)
        draft_probs = torch.stack(prob_rows) if prob_rows else None
        return Proposal(tokens, draft_probs, catch_up_seconds)

    def feedback(self, result: RoundResult) -> None:
        pass


@dataclass(frozen=True)
class DraftModelOptions:
    """``draft_head_tokens``: the draft's LM head scores this many frequent ids (None: automatic, 0: the whole
    head); ``confidence_stop``: stop a round's drafting below this draft probability (0: never);
    ``draft_int8``: draft with an int8 copy (None: on for a CPU draft)."""

    draft_head_tokens: int | None = None
    confidence_stop: float = 0.0
    draft_int8: bool | None = None

    def validate(self) -> None:
        if self.draft_head_tokens is not None and self.draft_head_tokens < 0:
            raise InputError(f"draft head tokens must be >= 0 (0 = the whole head), got {self.draft_head_tokens}")
        if not 0.0 <= self.confidence_stop <= 1.0:
            raise InputError(f"the confidence stop must be in [0, 1], got {self.confidence_stop}")


def _check(target: LoadedModel, draft: LoadedModel | None, options: Any) -> None:
    if draft is None:
        raise InputError("mode 'draft' needs a draft model")
    if not same_tokenizer(target.tokenizer, draft.tokenizer):
        raise InputError(
            f"the draft {draft.source!r} uses a different tokenizer from the target {target.source!r}: "
            "draft mode compares token ids, so it needs the same tokenizer; use mode 'uag' (different "
            "tokenizers) for this pair"
        )


def _build(context: BuildContext) -> DraftModelDrafter:
    options: DraftModelOptions = context.options
    draft, target, settings = context.draft, context.target, context.settings
    assert draft is not None
    return DraftModelDrafter(
        draft.model,
        settings.sampling,
        target_vocab_size=output_rows(target.model),
        eos_token_ids=target.eos_token_ids,
        head_tokens=options.draft_head_tokens,
        confidence_stop=options.confidence_stop,
        generator=drafter_generator(settings.sampling.seed, draft.device),
        int8=options.draft_int8,
        passes=context.passes,
        max_new_tokens=settings.max_new_tokens,
    )


METHOD = Method(
    name="draft",
    label="draft model (same tokenizer)",
    build=_build,
    options=DraftModelOptions,
    needs_draft_model=True,
    calibrated_draft_cost=True,
    check=_check,
    draft_int8=lambda options, target, draft: options.draft_int8,
    drafting_model=lambda target, draft, options: drafting_model(draft.model, options.draft_int8) if draft else None,
)
