"""What the decoding loop talks to: a language model (the target), a drafter and a draft-length policy, and the
data they exchange each round.

The loop (:mod:`specdemo.core.loop`) knows these protocols only: the transformers target
(:class:`specdemo.backends.transformers_lm.CachedLM`), the drafting methods (:mod:`specdemo.methods`) and a stub
target on simulated time (:mod:`specdemo.replay`) all implement them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import torch

from .acceptance import Verdict

logger = logging.getLogger(__name__)


@dataclass
class TargetPass:
    """What one target forward pass gives: logits [n, V] and hidden states: the final (post-norm) ones [n, H], or,
    for a pass asked for ``hidden_layers``, those layers' states side by side [n, len(hidden_layers) * H]."""

    logits: torch.Tensor
    hidden_states: torch.Tensor | None = None


class LanguageModel(Protocol):
    """A causal LM seen as "ids in, logits out", over one sequence whose cache keeps any subset of new rows."""

    #: tokens in the cache
    length: int
    device: torch.device

    def reset(self) -> None:
        """Start a new sequence (an empty cache)."""
        ...

    def run(
        self,
        input_ids: torch.Tensor,
        all_logits: bool = True,
        parents: Sequence[int] | None = None,
        with_hidden: bool = True,
        hidden_layers: Sequence[int] | None = None,
    ) -> TargetPass:
        """One pass over ``input_ids`` after the cached sequence: logits for every new token (``all_logits``) or
        the last one; ``parents``: the new tokens form a tree (None or ``[-1, 0, 1, ...]``: a chain); the final
        hidden states too when ``with_hidden``. ``hidden_layers`` (with ``with_hidden``): instead of the final
        hidden states, the states of these layers (indices into transformers' ``output_hidden_states``: 0 the
        embeddings, i the output of decoder layer i), concatenated, for every new token whatever ``all_logits``
        says (a drafter on the target's features reads the whole prompt)."""
        ...

    def keep(self, num_new: int, rows: Sequence[int]) -> None:
        """Of the last ``num_new`` cached positions keep only ``rows`` (ascending indices among them)."""
        ...


@dataclass
class Proposal:
    """Draft tokens and, for drafters that sample, the distribution each was drawn from ([n, V_target]).

    ``parents``: None for a chain (token i follows token i - 1); for a tree, each token's parent index among the
    tokens (-1 = it follows the context), parents before children, siblings with different tokens.
    """

    tokens: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None
    #: seconds the drafter spent catching up on text written since its last round (after plain steps), which is
    #: part of drafting's cost but not of its cost per drafted token
    catch_up_seconds: float = 0.0
    parents: list[int] | None = None
    #: for a drafter with several parts, which proposed each token (None: the drafter is one part)
    sources: list[str] | None = None


@dataclass
class RoundResult:
    """What a drafter hears after a round: its proposal (as verified), the verdict and the target's pass."""

    proposal: Proposal
    verdict: Verdict
    target_pass: TargetPass | None = None

    @property
    def num_drafted(self) -> int:
        return len(self.proposal.tokens)

    @property
    def num_accepted(self) -> int:
        return self.verdict.num_accepted


class Drafter(Protocol):
    """A drafting strategy. ``context`` is the whole sequence so far (prompt + accepted output)."""

    name: str
    #: the drafter reads the target's hidden states (from the prompt pass and every verify pass); the loop asks the
    #: target for them only then
    needs_hidden_states: bool
    #: with ``needs_hidden_states``: the target layers whose states it reads (indices, see
    #: :meth:`LanguageModel.run`), which the loop passes on to every target pass; None: the final hidden states
    hidden_layers: tuple[int, ...] | None

    def start(self, prompt_ids: Sequence[int], prefill: TargetPass | None = None) -> None: ...

    def propose(self, context: Sequence[int], num_draft_tokens: int) -> Proposal:
        """At most ``num_draft_tokens`` tokens after ``context`` (tree nodes, for a drafter that proposes trees)."""
        ...

    def feedback(self, result: RoundResult) -> None: ...


class DraftLengthPolicy(Protocol):
    """How many tokens to draft each round, learning from each round's outcome and costs."""

    def next_num_draft_tokens(self, remaining: int | None = None) -> int:
        """Tokens to draft this round; ``remaining``: how many more tokens the run may write (None: unknown)."""
        ...

    def update(
        self,
        num_draft_tokens: int,
        num_accepted: int,
        draft_seconds: float,
        verify_seconds: float,
        catch_up_seconds: float = 0.0,
    ) -> None:
        """The round drafted ``num_draft_tokens``, ``num_accepted`` of them were accepted, at these costs."""
        ...
