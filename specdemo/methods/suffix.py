"""Suffix decoding (Oliaro et al. 2024, arXiv 2411.04975; vLLM's ``suffix`` method): drafts from suffix trees over
the race's prompt and output and over the answers of earlier races (the memory), with no model at all.

Each round both trees match the context's longest suffixes and propose the likeliest continuations as a tree, sized
by the match (``suffix_factor`` tokens per matched token, none less likely than ``suffix_min_token_prob``, as
SuffixDecoding's ``max_spec_factor`` and ``min_token_prob``); the tree with the larger expected number of accepted
tokens is drafted. Under greedy settings it also holds prompt lookup's continuation as one more branch
(``suffix_lookup``, as EAGLE's tree does: :class:`~specdemo.methods.ngram.LookupBranch` follows the last accepted
copy on, where a tree's short match after an edit drafts little). The tree is cut by the machine's cost curve like
the other tree modes (:class:`~specdemo.methods.draft_length.TreeSizer`) and verified in one pass. Under sampling a
chain is drafted and verified with the point-mass rule the n-gram mode uses. The trees are
:mod:`specdemo.backends.suffix_trees`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from ..backends.loading import LoadedModel
from ..backends.suffix_trees import DEFAULT_MAX_DEPTH, DraftLimits, PromptTree, SuffixDraft, SuffixMemory, suffix_tree
from ..core.errors import InputError
from ..core.events import (
    DRAFTED_BY_LOOKUP,
    DRAFTED_FROM_OUTPUT,
    DRAFTED_FROM_PROMPT,
    EARLIER_ANSWER,
    drafted_from_answer,
)
from ..core.protocol import Proposal, RoundResult, TargetPass
from ..core.tree import add_branch, best_path_first
from .base import BuildContext, Method, heads_policy, tree_verify_cost
from .draft_length import TREE_DECAY, TreeSizer
from .ngram import LookupBranch, NgramOptions, match_bucket

logger = logging.getLogger(__name__)

#: a tree's record of how well its counts predict acceptance is kept apart for matches of 1, 2, 3 and 4 or more
#: tokens
MATCH_BUCKETS = 4


class _MatchRecord:
    """One tree's record of how well its counts predict acceptance, apart for matches of 1, 2, 3 and 4 or more
    tokens: predicted and accepted tree tokens of recent rounds (decayed)."""

    def __init__(self) -> None:
        self.predicted = [0.0] * MATCH_BUCKETS
        self.accepted = [0.0] * MATCH_BUCKETS

    def ratio(self, match_len: int) -> float:
        """Accepted over predicted tokens after a match of ``match_len`` tokens (1 before anything is known)."""
        bucket = match_bucket(match_len, MATCH_BUCKETS)
        return (self.accepted[bucket] + 1.0) / (self.predicted[bucket] + 1.0)

    def observe(self, bucket: int, predicted: float, accepted: int) -> None:
        self.predicted[bucket] = TREE_DECAY * self.predicted[bucket] + predicted
        self.accepted[bucket] = TREE_DECAY * self.accepted[bucket] + accepted

    def decay(self, bucket: int) -> None:
        """A round that kept none of this tree's draft: drift back toward trusting it."""
        self.predicted[bucket] *= TREE_DECAY
        self.accepted[bucket] *= TREE_DECAY


class SuffixDrafter:
    """Drafts from the race's own suffix tree (its prompt and output) and from ``memory`` (earlier answers; None:
    the race's own tree only). ``tree``: draft a tree of candidates (greedy runs), else one path. ``verify_cost``
    (seconds of a verify pass over n tokens) cuts each tree to the nodes that pay; without it the whole draft goes.
    ``lookup`` (trees only): prompt lookup's continuation joins the tree as one more branch. Each drafted token says
    where it came from: the prompt, the output so far, which earlier answer, or prompt lookup alone."""

    name = "suffix"
    needs_hidden_states = False
    hidden_layers: tuple[int, ...] | None = None

    def __init__(
        self,
        memory: SuffixMemory | None = None,
        tree: bool = True,
        factor: float = 1.0,
        min_token_prob: float = 0.1,
        verify_cost: Callable[[int], float] | None = None,
        max_depth: int = DEFAULT_MAX_DEPTH,
        lookup: LookupBranch | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if lookup is not None and not tree:
            raise ValueError("the prompt-lookup branch joins a suffix tree only")
        self.memory = memory
        self.lookup = lookup
        self.clock = clock  # times the drafting a tree's cut weighs against the verify pass
        self.tree = tree
        self.factor = factor
        self.min_token_prob = min_token_prob
        self.own = PromptTree(max_depth)
        self.sizer = TreeSizer(verify_cost)  # the cut that pays (this drafter keeps its own record, by match)
        #: per tree (the race's own, the memory) and length of the match (1, 2, 3, 4 or more): predicted and accepted
        #: tree tokens of recent rounds (decayed), since a tree's counts after a short match promise more than they
        #: keep, and the memory's counts (other answers) promise differently from the race's own
        self._record = {from_memory: _MatchRecord() for from_memory in (False, True)}
        self._last: tuple[bool, int, float] | None = None  # the tree last proposed: memory?, bucket, predicted

    def start(self, prompt_ids: Sequence[int], prefill: TargetPass | None = None) -> None:
        self.own.start(prompt_ids)
        self.sizer.start()
        if self.lookup is not None:
            self.lookup.start()

    def propose(self, context: Sequence[int], num_draft_tokens: int) -> Proposal:
        if num_draft_tokens <= 0:
            return Proposal()
        started = self.clock()
        draft, from_memory = self._best_draft(context, num_draft_tokens)
        if not self.tree:  # a chain: all of it
            if not draft.tokens:
                return Proposal()
            nodes = range(len(draft.tokens))
            sources = self._sources(draft, from_memory, context, nodes)
            return Proposal(draft.tokens, None, 0.0, None, [sources[node] for node in nodes])
        branch = self.lookup.propose(context, num_draft_tokens) if self.lookup is not None else ([], [])
        calibrated = self._calibrated(draft, from_memory)
        tree = add_branch(draft.tokens, draft.parents, calibrated, *branch).cut(num_draft_tokens)
        tree = tree.cut(self.sizer.keep(tree.probs, self.clock() - started, ratio=1.0))
        kept = [node for node in tree.tree_nodes if node >= 0]
        self._proposed(draft, from_memory, kept)
        if not tree.tokens:
            return Proposal()
        sources = self._sources(draft, from_memory, context, kept)
        order, parents = best_path_first(tree.parents)
        named = [sources[tree.tree_nodes[rank]] if tree.tree_nodes[rank] >= 0 else DRAFTED_BY_LOOKUP
                 for rank in order]
        return Proposal([tree.tokens[rank] for rank in order], None, 0.0, parents, named)

    def _calibrated(self, draft: SuffixDraft, from_memory: bool) -> list[float]:
        """The draft's estimated probabilities scaled by its tree's record at its match length (at most 1); the
        lookup branch's rates are calibrated already."""
        ratio = self._record[from_memory].ratio(draft.match_len)
        return [min(1.0, ratio * prob) for prob in draft.probs]

    def _proposed(self, draft: SuffixDraft, from_memory: bool, kept: list[int]) -> None:
        """Remember what the kept nodes of the draft predicted, for :meth:`feedback`; when the record kept none of
        a draft, let it drift back toward trusting such drafts."""
        bucket = match_bucket(draft.match_len, MATCH_BUCKETS)
        self._last = (from_memory, bucket, sum(draft.probs[node] for node in kept)) if kept else None
        if draft.tokens and not kept:
            self._record[from_memory].decay(bucket)

    def _best_draft(self, context: Sequence[int], num_draft_tokens: int) -> tuple[SuffixDraft, bool]:
        """The draft of whichever tree expects more accepted tokens by its calibrated counts (the race's own on a
        tie), and whether it is the memory's."""
        limits = DraftLimits(num_draft_tokens, self.factor, self.min_token_prob, self.tree)
        self.own.extend(context)
        own = self.own.speculate(context, limits)
        if self.memory is None:
            return own, False
        remembered = self.memory.speculate(context, limits)
        own_score = self._record[False].ratio(own.match_len) * own.score
        remembered_score = self._record[True].ratio(remembered.match_len) * remembered.score
        return (remembered, True) if remembered_score > own_score else (own, False)

    def _sources(self, draft: SuffixDraft, from_memory: bool, context: Sequence[int], nodes: Iterable[int]
                 ) -> dict[int, str]:
        """Where each of the draft's ``nodes`` came from (worked out for the nodes proposed only)."""
        if from_memory:
            assert self.memory is not None
            numbers = self.memory.answers_holding(draft, context, nodes)
            return {node: EARLIER_ANSWER if n is None else drafted_from_answer(n) for node, n in numbers.items()}
        keys = draft.keys(context)
        return {node: DRAFTED_FROM_PROMPT if self.own.from_prompt(keys[node]) else DRAFTED_FROM_OUTPUT
                for node in nodes}

    def feedback(self, result: RoundResult) -> None:
        path = result.verdict.accepted_nodes
        if self.lookup is not None:
            self.lookup.feedback([result.proposal.tokens[node] for node in path])
        if self.tree and result.num_drafted and self._last is not None:
            sources = result.proposal.sources or ()
            from_trees = sum(1 for node in path if node >= len(sources) or sources[node] != DRAFTED_BY_LOOKUP)
            from_memory, bucket, predicted = self._last
            self._record[from_memory].observe(bucket, predicted, from_trees)
        self._last = None


@dataclass(frozen=True)
class SuffixOptions(NgramOptions):
    """How much a suffix tree drafts: at most ``suffix_factor`` tokens per token of the context it matched, none
    whose estimated probability (how often it followed that context) is below ``suffix_min_token_prob``;
    ``suffix_lookup``: the greedy tree also holds prompt lookup's continuation (chosen by the n-gram settings)."""

    suffix_factor: float = 1.0
    suffix_min_token_prob: float = 0.1
    suffix_lookup: bool = True

    def validate(self) -> None:
        super().validate()
        if not 0.0 < self.suffix_factor <= 64.0:
            raise InputError(f"suffix_factor (tokens drafted per matched token) must be in (0, 64], got "
                             f"{self.suffix_factor}", field="suffix_factor")
        if not 0.0 <= self.suffix_min_token_prob <= 1.0:
            raise InputError(f"suffix_min_token_prob must be in [0, 1], got {self.suffix_min_token_prob}",
                             field="suffix_min_token_prob")


def _check(target: LoadedModel, draft: LoadedModel | None, options: Any) -> None:
    suffix_tree(1)  # the package is missing: how to install it, in one line, before any pass


def _build(context: BuildContext) -> SuffixDrafter:
    options: SuffixOptions = context.options
    tree = context.settings.sampling.greedy  # sampling is exact on a chain only
    lookup = (LookupBranch(options.ngram_min, options.ngram_max, options.ngram_prefer)
              if tree and options.suffix_lookup else None)
    return SuffixDrafter(context.memory, tree, options.suffix_factor, options.suffix_min_token_prob,
                         tree_verify_cost(context.policy, tree), lookup=lookup, clock=context.clock or time.perf_counter)


METHOD = Method(
    name="suffix",
    label="suffix decoding: trees over the prompt and earlier answers (no draft model)",
    build=_build,
    options=SuffixOptions,
    drafts_for_free=True,
    proposes_trees=True,
    drafts_from_memory=True,
    check=_check,
    make_policy=lambda context: heads_policy(context, tree=True),
)
