"""What a decoding run shows: the adapter that turns the loop's raw rounds into :mod:`~specdemo.core.events`.

The loop (:mod:`specdemo.core.loop`) only decodes: it drafts, verifies, accepts, keeps cache rows and writes ids.
Everything a viewer needs beside the ids happens here, outside the timed work: each token's text piece (through
the incremental detokenizer), how it came to be (accepted, corrected, bonus, plain), the draft and target
probabilities behind it, and the draft tokens the target turned down.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

import torch
from transformers import PreTrainedTokenizerBase

from .acceptance import Verdict, target_distribution
from .detok import IncrementalDetokenizer
from .events import (
    ACCEPTED,
    BONUS,
    CORRECTED,
    PLAIN,
    REJECTED,
    Counters,
    RoundEvent,
    TokenEvent,
)
from .protocol import Proposal
from .settings import GenerationSettings
from .tree import chain_parents, tree_depths

logger = logging.getLogger(__name__)


@dataclass
class VerifyRound:
    """One verify round as the loop saw it: the draft as verified, the pass's logits [n + 1, V] and the target
    distribution where acceptance computed it, the verdict, the ids written (after EOS and the length limit) and
    the round's seconds."""

    index: int
    proposal: Proposal
    logits: torch.Tensor
    target_probs: torch.Tensor | None
    verdict: Verdict
    written: list[int]
    draft_seconds: float
    verify_seconds: float


def _prob(probs: torch.Tensor | None, row: int, token: int) -> float | None:
    return None if probs is None else float(probs[row, token])


class EventMaker:
    """Makes one side's round events; ``finish_reason`` (None while running) is the output's, after each round's ids
    were written."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, settings: GenerationSettings, side: str) -> None:
        self.tokenizer = tokenizer
        self.detok = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self.sampling = settings.sampling
        self.collect_probs = settings.collect_probs
        self.side = side

    def _pieces(self, ids: Sequence[int], finish_reason: str | None) -> list[str]:
        if self.detok is None:
            return ["" for _ in ids]
        pieces = [self.detok.add(t) for t in ids]
        if finish_reason is not None and pieces:
            pieces[-1] += self.detok.flush()
        return pieces

    def _finish(self, event: RoundEvent, output_ids: Sequence[int], finish_reason: str | None) -> RoundEvent:
        if finish_reason is not None:
            event.finished = True
            event.finish_reason = finish_reason
            event.new_token_ids = list(output_ids)
            event.text = self.detok.text if self.detok is not None else ""
        return event

    def plain_step(
        self,
        index: int,
        token: int,
        logits: torch.Tensor,
        seconds: float,
        counters: Counters,
        output_ids: Sequence[int],
        finish_reason: str | None,
    ) -> RoundEvent:
        """A pass that wrote one token of its own (the prompt pass, or a plain step): ``logits`` [V] chose it."""
        target_prob = float(target_distribution(logits, self.sampling)[token]) if self.collect_probs else None
        shown = [TokenEvent(token, self._pieces([token], finish_reason)[0], PLAIN, index, None, target_prob)]
        event = RoundEvent(self.side, index, shown, [], 0, 0, 0.0, seconds, counters.snapshot())
        return self._finish(event, output_ids, finish_reason)

    def verify_round(
        self, done: VerifyRound, counters: Counters, output_ids: Sequence[int], finish_reason: str | None
    ) -> RoundEvent:
        """A verify round: the accepted draft tokens, the target's own token and the draft tokens turned down."""
        verdict, tokens, draft_probs = done.verdict, done.proposal.tokens, done.proposal.draft_probs
        sources = done.proposal.sources
        chain = done.proposal.parents is None
        parents = chain_parents(len(tokens)) if chain else done.proposal.parents
        target_probs = done.target_probs
        if self.collect_probs and target_probs is None:
            target_probs = target_distribution(done.logits, self.sampling)
        path = verdict.accepted_nodes
        rows = [0] + [node + 1 for node in path]  # the pass's row whose logits chose each written token
        last_node = path[-1] if path else -1
        if not tokens:
            last_kind = PLAIN
        elif last_node not in parents:  # the accepted path ran to a leaf: the target's token comes on top
            last_kind = BONUS
        else:
            last_kind = CORRECTED
        pieces = self._pieces(done.written, finish_reason)
        shown: list[TokenEvent] = []
        for position, (token_id, piece) in enumerate(zip(done.written, pieces)):
            is_draft = position < verdict.num_accepted
            shown.append(
                TokenEvent(
                    token_id,
                    piece,
                    ACCEPTED if is_draft else last_kind,
                    done.index,
                    _prob(draft_probs, path[position], token_id) if is_draft else None,
                    _prob(target_probs, rows[position], token_id),
                    sources[path[position]] if is_draft and sources is not None else None,
                )
            )
        rejected: list[TokenEvent] = []
        if self.tokenizer is not None and verdict.num_accepted < len(tokens) and finish_reason != "eos":
            if chain:  # every draft token after the accepted ones
                turned_down = list(range(verdict.num_accepted, len(tokens)))
            else:  # a tree: the candidates the target turned down where it wrote its own token
                turned_down = [node for node, parent in enumerate(parents) if parent == last_node]
            for order, node in enumerate(turned_down):
                token_id = tokens[node]
                rejected.append(
                    TokenEvent(
                        token_id,
                        self.tokenizer.decode([token_id]),
                        REJECTED,
                        done.index,
                        _prob(draft_probs, node, token_id),
                        _prob(target_probs, rows[-1], token_id) if order == 0 or not chain else None,
                        sources[node] if sources is not None else None,
                    )
                )
        event = RoundEvent(
            self.side,
            done.index,
            shown,
            rejected,
            len(tokens),
            verdict.num_accepted,
            done.draft_seconds,
            done.verify_seconds,
            counters.snapshot(),
            depth=None if chain else max(tree_depths(parents), default=-1) + 1,
        )
        return self._finish(event, output_ids, finish_reason)
