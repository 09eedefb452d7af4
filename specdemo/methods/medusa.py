"""Medusa drafting (Cai et al. 2024, Medusa-1): a chain of each head's top token, or under greedy settings a tree of
the heads' likeliest candidates, from heads on the target's own last hidden state (the heads' model is
:mod:`specdemo.backends.medusa_heads`, their checkpoints :mod:`specdemo.backends.medusa_checkpoint`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ..backends.formats import output_weight
from ..backends.loading import LoadedModel
from ..backends.medusa_checkpoint import heads_for
from ..backends.medusa_heads import MedusaHeads
from ..backends.passes import EAGER, Passes
from ..core.acceptance import target_distribution
from ..core.clock import now
from ..core.protocol import DraftLengthPolicy, Proposal, RoundResult, TargetPass
from ..core.settings import SamplingSettings
from ..core.tree import build_tree
from .base import (
    BuildContext,
    Method,
    PolicyContext,
    drafter_generator,
    head_token_ids,
    heads_policy,
    to_target_vocab,
    tree_verify_cost,
)
from .draft_length import TreeSizer, lean_low

logger = logging.getLogger(__name__)


class MedusaDrafter:
    """Drafts from Medusa heads on the hidden state of the target's last accepted position: no second model.

    Head k's guess is the token k + 1 places after that position, i.e. k places after the token the target has
    just written. ``tree=False`` drafts a chain of each head's top token (sampled from each head's warped
    distribution under sampling settings, which rejection sampling makes exact); ``tree=True`` (greedy only)
    drafts the most likely nodes of the tree of the heads' top ``top_width`` tokens. ``verify_cost`` (seconds of a
    verify pass over n tokens, from the measured cost curve) sizes each tree: the node count that maximises
    expected tokens per second, none when a plain step is better; without it a tree uses its whole budget.
    ``head_tokens``: score this many of the lowest token ids plus the prompt's and EOS (None = the heads' own
    setting; 0 = the whole vocabulary).
    """

    name = "medusa"
    needs_hidden_states = True
    hidden_layers: tuple[int, ...] | None = None

    def __init__(
        self,
        heads: MedusaHeads,
        lm_head_weight: torch.Tensor | None,
        sampling: SamplingSettings,
        target_vocab_size: int,
        eos_token_ids: Sequence[int] = (),
        tree: bool = False,
        top_width: int = 4,
        head_tokens: int | None = None,
        generator: torch.Generator | None = None,
        verify_cost: Callable[[int], float] | None = None,
        passes: Passes = EAGER,
    ) -> None:
        if tree and not sampling.greedy:
            raise ValueError("a Medusa tree is verified greedily only; sampled runs use the chain")
        self.heads = heads
        self._features = passes.medusa_features(heads)
        self.lm_head_weight = lm_head_weight
        self.sampling = sampling
        self.target_vocab_size = target_vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.tree = tree
        self.top_width = top_width
        self.head_tokens = heads.config.head_tokens if head_tokens is None else head_tokens
        self.generator = generator
        self.sizer = TreeSizer(verify_cost)
        self._hidden: torch.Tensor | None = None
        self._token_ids: torch.Tensor | None = None
        self._weight: torch.Tensor | None = None
        self._heads_seconds: float | None = None  # scoring the heads, seconds a round (an average that leans low)

    @property
    def num_heads(self) -> int:
        return self.heads.config.num_heads

    def start(self, prompt_ids: Sequence[int], prefill: TargetPass | None = None) -> None:
        if prefill is None or prefill.hidden_states is None:
            raise ValueError("Medusa heads need the target's hidden states from the prompt's pass")
        self._hidden = prefill.hidden_states[-1]
        self.sizer.start()
        device = self._hidden.device
        vocab = self.target_vocab_size
        self._token_ids = None
        if self.head_tokens and self.head_tokens < vocab:
            ids = head_token_ids(self.head_tokens, vocab, prompt_ids, self.eos_token_ids)
            self._token_ids = torch.tensor(ids, dtype=torch.long, device=device)
        self._weight = None
        if self.heads.lm_heads is None:
            assert self.lm_head_weight is not None
            with torch.inference_mode():
                weight = self.lm_head_weight[:vocab]
                self._weight = weight if self._token_ids is None else weight.index_select(0, self._token_ids)

    @torch.inference_mode()
    def _head_logits(self) -> torch.Tensor:
        assert self._hidden is not None
        features = self._features(self._hidden.view(1, -1))
        if self._weight is not None:
            return self.heads.scores(features, self._weight)[:, 0]
        return self.heads.scores(features, None, self._token_ids)[:, 0]

    def _vocab_id(self, index: torch.Tensor) -> torch.Tensor:
        return index if self._token_ids is None else self._token_ids[index]

    @torch.inference_mode()
    def propose(self, context: Sequence[int], num_draft_tokens: int) -> Proposal:
        if num_draft_tokens <= 0 or self._hidden is None:
            return Proposal()
        if self.sizer.resting():  # the last trees did not pay for the heads: a plain step, heads not even scored
            return Proposal()
        started = now(self._hidden.device)
        logits = self._head_logits()[: min(self.num_heads, num_draft_tokens) if not self.tree else self.num_heads]
        if self.tree:
            probs = logits.float().softmax(-1)
            top = probs.topk(min(self.top_width, probs.shape[-1]), dim=-1)
            tokens, parents, scores = build_tree(top.values, self._vocab_id(top.indices), num_draft_tokens)
            self._heads_seconds = lean_low(self._heads_seconds, now(self._hidden.device) - started)
            count = self.sizer.keep(scores, self._heads_seconds)
            self.sizer.proposed(sum(scores[:count]), count)
            return Proposal(tokens[:count], None, 0.0, parents[:count])
        if self.sampling.greedy:
            return Proposal([int(t) for t in self._vocab_id(logits.argmax(-1)).tolist()])
        rows, tokens = [], []
        for head_logits in logits:
            probs = target_distribution(head_logits, self.sampling)
            choice = torch.multinomial(probs, 1, generator=self.generator)
            tokens.append(int(self._vocab_id(choice)[0]))
            rows.append(to_target_vocab(probs, self._token_ids, self.target_vocab_size))
        return Proposal(tokens, torch.stack(rows))

    def feedback(self, result: RoundResult) -> None:
        if result.target_pass is None or result.target_pass.hidden_states is None:
            raise ValueError("Medusa heads need the target's hidden states from every verify pass")
        self._hidden = result.target_pass.hidden_states[result.verdict.last_row]
        if self.tree:
            self.sizer.observe(result.num_drafted, result.num_accepted)



@dataclass(frozen=True)
class MedusaOptions:
    """``medusa_heads``: a folder of heads (FasterDecoding's layout); None: the heads shipped for the target."""

    medusa_heads: str | None = None

    def validate(self) -> None:
        pass


def _check(target: LoadedModel, draft: LoadedModel | None, options: Any) -> None:
    heads_for(target, options.medusa_heads)  # none shipped for this target, or misfit: one line, before any pass


def _build(context: BuildContext, tree: bool) -> MedusaDrafter:
    target, settings = context.target, context.settings
    weight = output_weight(target.model)
    tree = tree and settings.sampling.greedy  # sampling is exact on a chain only
    policy = context.policy
    return MedusaDrafter(
        heads_for(target, context.options.medusa_heads),
        weight,
        settings.sampling,
        target_vocab_size=weight.shape[0],
        eos_token_ids=target.eos_token_ids,
        tree=tree,
        generator=drafter_generator(settings.sampling.seed, target.device),
        verify_cost=tree_verify_cost(policy, tree),
        passes=context.passes,
    )


def _policy(context: PolicyContext, tree: bool) -> DraftLengthPolicy:
    # a chain is at most one token per head
    return heads_policy(context, tree, heads_for(context.target, context.options.medusa_heads).config.num_heads)


METHODS = (
    Method(
        name="medusa",
        label="Medusa heads on the target, a tree of candidates (no draft model)",
        build=lambda context: _build(context, tree=True),
        options=MedusaOptions,
        drafts_for_free=True,
        proposes_trees=True,
        needs_hidden_states=True,
        check=_check,
        make_policy=lambda context: _policy(context, tree=True),
        drafting_model=lambda target, draft, options: heads_for(target, options.medusa_heads),
    ),
    Method(
        name="medusa-chain",
        label="Medusa heads on the target, each head's top token (no draft model)",
        build=lambda context: _build(context, tree=False),
        options=MedusaOptions,
        drafts_for_free=True,
        needs_hidden_states=True,
        check=_check,
        make_policy=lambda context: _policy(context, tree=False),
        drafting_model=lambda target, draft, options: heads_for(target, options.medusa_heads),
    ),
)
