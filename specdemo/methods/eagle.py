"""EAGLE-3 drafting (Li et al. 2025, arXiv 2503.01840): EAGLE-2's dynamic tree under greedy settings and a chain
under sampling, from an EAGLE-3 head on the target's own features (the head's model is
:mod:`specdemo.backends.eagle3_head`, its checkpoints :mod:`specdemo.backends.eagle3_checkpoint`).

Each draft step feeds the head's own output (before the final norm) back as the next position's feature, with the
token it has just drafted. After verification the target's features of the accepted rows (and of the row that chose
the correction or bonus) become the head's next inputs: its cache keeps committed positions only (target features,
accepted tokens) and drops the drafted ones. Under greedy settings the tree also holds prompt lookup's continuation
as one more branch (:class:`~specdemo.methods.ngram.LookupBranch`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ..backends.eagle3_checkpoint import head_for
from ..backends.eagle3_head import EagleHead
from ..backends.formats import output_rows
from ..backends.loading import LoadedModel
from ..backends.passes import EAGER, Passes
from ..core.acceptance import target_distribution
from ..core.clock import now
from ..core.errors import InputError
from ..core.events import DRAFTED_BY_BOTH, DRAFTED_BY_HEAD, DRAFTED_BY_LOOKUP
from ..core.protocol import DraftLengthPolicy, Proposal, RoundResult, TargetPass
from ..core.settings import SamplingSettings
from ..core.tree import add_branch, best_path_first
from .base import (
    BuildContext,
    Method,
    PolicyContext,
    drafter_generator,
    heads_policy,
    to_target_vocab,
    tree_verify_cost,
)
from .draft_length import TreeSizer, lean_low
from .ngram import LookupBranch, NgramOptions

logger = logging.getLogger(__name__)

#: a tree's candidates per node: each expanded node's top tokens, and the nodes expanded at each depth
TOP_K = 4
#: the deepest a tree grows (draft steps after the first)
MAX_TREE_DEPTH = 8

#: who drafted a node of a tree: the head, the prompt-lookup branch, or both
_SOURCES = {"tree": DRAFTED_BY_HEAD, "branch": DRAFTED_BY_LOOKUP, "both": DRAFTED_BY_BOTH}


class EagleDrafter:
    """Drafts with an EAGLE-3 head on the target's features: no second model.

    ``tree=True`` (greedy only) grows EAGLE-2's dynamic tree: the head's ``top_k`` tokens after the last accepted
    position, then at each depth the ``top_k`` newest nodes with the best path probability expanded by their own
    ``top_k`` tokens (one head step over all of them, a tree mask inside the head); the ``num_draft_tokens`` best
    nodes of all are proposed, a tree in topological order. ``verify_cost`` (seconds of a verify pass over n tokens,
    from the measured cost curve) sizes each tree through the :class:`~specdemo.methods.draft_length.TreeSizer`
    every tree drafter shares: the node count that maximises expected tokens per second, the drafting counted; none
    when a plain step is better (and then the head rests a few rounds), and a tree stops growing when its best new
    node is worth less than a head step. ``tree=False`` drafts a chain: the
    head's top token at each step, or under sampling a token drawn from the head's warped distribution over the
    draft vocabulary, spread onto the target's (zero elsewhere), which rejection sampling makes exact.
    """

    name = "eagle"
    needs_hidden_states = True

    def __init__(
        self,
        head: EagleHead,
        embed_tokens: nn.Module,
        sampling: SamplingSettings,
        target_vocab_size: int,
        tree: bool = False,
        top_k: int = TOP_K,
        max_depth: int = MAX_TREE_DEPTH,
        generator: torch.Generator | None = None,
        verify_cost: Callable[[int], float] | None = None,
        lookup: LookupBranch | None = None,
        passes: Passes = EAGER,
        max_new_tokens: int = 0,
    ) -> None:
        if tree and not sampling.greedy:
            raise ValueError("an EAGLE tree is verified greedily only; sampled runs use the chain")
        if lookup is not None and not tree:
            raise ValueError("the prompt-lookup branch joins an EAGLE tree only")
        self.head = head
        self.embed_tokens = embed_tokens
        self.sampling = sampling
        self.target_vocab_size = target_vocab_size
        self.tree = tree
        self.top_k = max(1, min(top_k, head.config.draft_vocab_size)) if tree else 1
        self.max_depth = max_depth
        self.generator = generator
        self.sizer = TreeSizer(verify_cost)
        self.lookup = lookup
        #: the target layers whose states the loop asks every pass for (see LanguageModel.run)
        self.hidden_layers: tuple[int, ...] = tuple(head.hidden_layers)
        self._width = head.config.num_features * head.config.hidden_size
        self.passes = passes
        self.max_new_tokens = max_new_tokens
        self._cache = EAGER.head_cache(head, 0)  # each sequence gets its own in start()
        self._committed = 0  # head positions in the cache: target features paired with accepted tokens
        self._pending: torch.Tensor | None = None  # target states of the next positions, not yet run
        self._pending_plain = 0  # how many of them came from rounds without a draft
        self._root: tuple[torch.Tensor, torch.Tensor] | None = None  # the last committed position: output, logits
        self._step_seconds: float | None = None  # one tree step, seconds (an average that leans low)

    @property
    def device(self) -> torch.device:
        return self.head.device

    def start(self, prompt_ids: Sequence[int], prefill: TargetPass | None = None) -> None:
        states = prefill.hidden_states if prefill is not None else None
        if states is None or states.shape[0] != len(prompt_ids) or states.shape[-1] != self._width:
            raise ValueError(f"an EAGLE head needs the target's states of layers {list(self.hidden_layers)} at "
                             "every prompt position (run the target with hidden_layers)")
        self._cache = self.passes.head_cache(self.head, len(prompt_ids) + self.max_new_tokens)
        self._committed, self._pending, self._pending_plain, self._root = 0, states, 0, None
        self.sizer.start()
        if self.lookup is not None:
            self.lookup.start()

    def _embed(self, token_ids: Sequence[int]) -> torch.Tensor:
        return self.embed_tokens(torch.tensor(list(token_ids), dtype=torch.long, device=self.device))

    def _positions(self, start: int, count: int) -> torch.Tensor:
        return torch.arange(start, start + count, device=self.device)

    @torch.inference_mode()
    def _catch_up(self, context: Sequence[int]) -> float:
        """Run the head over the positions the target has written since its last round (their features and the
        accepted tokens after them), committing them; the seconds it took when some came from plain steps."""
        if self._pending is None:
            return 0.0
        count = self._pending.shape[0]
        if len(context) != self._committed + count + 1:
            raise ValueError(f"the EAGLE head is at position {self._committed + count}, the context at "
                             f"{len(context) - 1}: every target pass must reach the drafter's feedback")
        started = now(self.device)
        tokens = context[self._committed + 1 : self._committed + count + 1]
        features = self.head.features(self._pending)
        outputs, logits = self._cache.step(self.head, features, self._embed(tokens),
                                           self._positions(self._committed, count), all_logits=False)
        self._committed += count
        self._root = (outputs[-1], logits[0])
        self._pending = None
        plain, self._pending_plain = self._pending_plain, 0
        return now(self.device) - started if plain else 0.0

    @torch.inference_mode()
    def propose(self, context: Sequence[int], num_draft_tokens: int) -> Proposal:
        if num_draft_tokens <= 0:
            return Proposal()
        started = now(self.device)
        branch = self.lookup.propose(context, num_draft_tokens) if self.lookup is not None else ([], [])
        if self.sizer.resting():  # the last trees did not pay for the head: the head is not even run
            return self._choose([], [], [], branch, num_draft_tokens, now(self.device) - started, 0.0)
        catch_up_seconds = self._catch_up(context)
        try:
            if not self.sampling.greedy:
                tokens, draft_probs = self._sample_chain(num_draft_tokens)
                return Proposal(tokens, draft_probs, catch_up_seconds)
            started = now(self.device)
            candidates, parents, probs = self._grow_tree(num_draft_tokens)
        finally:
            self._cache.crop(self._committed)  # the drafted positions are never committed
        if not self.tree:
            return Proposal([token for _, token in candidates], None, catch_up_seconds)
        tokens = [token for _, token in candidates]
        seconds = now(self.device) - started
        return self._choose(tokens, parents, probs, branch, num_draft_tokens, seconds, catch_up_seconds)

    def _choose(
        self,
        tokens: list[int],
        parents: list[int],
        probs: list[float],
        branch: tuple[list[int], list[float]],
        num_draft_tokens: int,
        draft_seconds: float,
        catch_up_seconds: float,
    ) -> Proposal:
        """The tree to verify: the head's candidates (best first, with their path probabilities) and the lookup
        branch merged, the nodes that pay for their place in the verify pass kept (all, without a cost model), in
        best-path-first order; the head's pacing and calibration updated."""
        ratio = self.sizer.calibration
        calibrated = [min(1.0, ratio * prob) for prob in probs]  # the branch's rates are calibrated already
        tree = add_branch(tokens, parents, calibrated, *branch).cut(num_draft_tokens)
        tree = tree.cut(self.sizer.keep(tree.probs, draft_seconds, ratio=1.0))
        head_nodes = [node for node in tree.tree_nodes if node >= 0]
        # paced only when the head ran this round
        self.sizer.proposed(sum(probs[node] for node in head_nodes), len(head_nodes) if probs else None)
        chosen, node_parents = best_path_first(tree.parents)
        sources = [_SOURCES[tree.sources[rank]] for rank in chosen] if self.lookup is not None else None
        return Proposal([tree.tokens[rank] for rank in chosen], None, catch_up_seconds, node_parents, sources)

    def _grow_tree(self, num_draft_tokens: int) -> tuple[list[tuple[int, int]], list[int], list[float]]:
        """The ``num_draft_tokens`` best candidates, best first: ((creation index, token), parent's index among them,
        path probability); every prefix of the list is a tree (a parent scores at least as high as its children
        and comes first on ties)."""
        assert self._root is not None
        root_output, root_logits = self._root
        draft_ids = self.head.draft_ids
        top = root_logits.float().log_softmax(-1).topk(self.top_k)
        tokens: list[int] = draft_ids[top.indices].tolist()
        parents: list[int] = [-1] * len(tokens)
        depths: list[int] = [0] * len(tokens)
        scores: list[float] = top.values.tolist()
        frontier = list(range(len(tokens)))  # the nodes the next step runs
        run_at: dict[int, int] = {}  # node -> its place in the cache's drafted positions
        outputs: list[torch.Tensor] = []
        grown = now(self.device)
        for step in range(min(num_draft_tokens - 1, self.max_depth)):
            if not self._step_may_pay(scores, frontier, num_draft_tokens, now(self.device) - grown):
                break  # no child the next step could draft would make the tree pay more than it does now
            started = now(self.device)
            done = len(outputs)
            base = self._committed
            visible = torch.zeros(len(frontier), base + done + len(frontier), dtype=torch.bool)
            visible[:, :base] = True
            for row, node in enumerate(frontier):
                ancestor = parents[node]
                while ancestor >= 0:
                    visible[row, base + run_at[ancestor]] = True
                    ancestor = parents[ancestor]
                visible[row, base + done + row] = True
            features = torch.stack([root_output if parents[n] < 0 else outputs[run_at[parents[n]]] for n in frontier])
            stepped, logits = self._cache.step(self.head, features, self._embed([tokens[n] for n in frontier]),
                                               self._positions(base + step, 1).expand(len(frontier)),
                                               visible.to(self.device))
            for row, node in enumerate(frontier):
                run_at[node] = done + row
                outputs.append(stepped[row])
            top = logits.float().log_softmax(-1).topk(self.top_k, dim=-1)
            children_ids, children_scores = draft_ids[top.indices].tolist(), top.values.tolist()
            children = []
            for row, node in enumerate(frontier):
                for token, score in zip(children_ids[row], children_scores[row]):
                    children.append(len(tokens))
                    tokens.append(token)
                    parents.append(node)
                    depths.append(step + 1)
                    scores.append(scores[node] + score)
            frontier = sorted(children, key=lambda child: (-scores[child], child))[: self.top_k]
            self._step_seconds = lean_low(self._step_seconds, now(self.device) - started)
        order = sorted(range(len(tokens)), key=lambda node: (-scores[node], depths[node], node))[:num_draft_tokens]
        rank = {node: index for index, node in enumerate(order)}
        probs = torch.tensor([scores[node] for node in order]).exp().tolist()
        return ([(node, tokens[node]) for node in order], [rank.get(parents[node], -1) for node in order], probs)

    def _sample_chain(self, num_draft_tokens: int) -> tuple[list[int], torch.Tensor]:
        """A chain drawn from the head's warped distributions, and those distributions on the target's vocabulary."""
        assert self._root is not None
        output, logits = self._root
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        for step in range(num_draft_tokens):
            probs = target_distribution(logits, self.sampling)
            index = torch.multinomial(probs, 1, generator=self.generator)
            tokens.append(int(self.head.draft_ids[index][0]))
            rows.append(to_target_vocab(probs, self.head.draft_ids, self.target_vocab_size))
            if step + 1 == num_draft_tokens:
                break
            stepped, scores = self._cache.step(self.head, output.view(1, -1), self._embed(tokens[-1:]),
                                               self._positions(self._committed + step, 1))
            output, logits = stepped[0], scores[0]
        return tokens, torch.stack(rows)

    def _step_may_pay(self, scores: list[float], frontier: list[int], num_draft_tokens: int, spent: float) -> bool:
        """Whether one more tree step could make the tree pay more than the best tree of the nodes already drafted
        (log path probabilities ``scores``; ``spent`` seconds of growing), as the tree sizer bounds it."""
        probs = [math.exp(score) for score in scores]
        return self.sizer.step_may_pay(probs, [probs[node] for node in frontier], self.top_k * len(frontier),
                                       num_draft_tokens, spent, self._step_seconds)

    def feedback(self, result: RoundResult) -> None:
        states = result.target_pass.hidden_states if result.target_pass is not None else None
        if states is None or states.shape[-1] != self._width:
            raise ValueError(f"an EAGLE head needs the target's states of layers {list(self.hidden_layers)} from "
                             "every verify pass")
        path = result.verdict.accepted_nodes
        rows = torch.tensor([0] + [node + 1 for node in path], device=states.device)
        accepted = states.index_select(0, rows)
        self._pending = accepted if self._pending is None else torch.cat([self._pending, accepted])
        if self.lookup is not None:
            tokens = result.proposal.tokens
            self.lookup.feedback([tokens[node] for node in path])
        if result.num_drafted == 0:
            self._pending_plain += 1
        elif self.tree:
            sources = result.proposal.sources  # None: the head drafted every node
            from_head = sum(1 for node in path if sources is None or sources[node] != DRAFTED_BY_LOOKUP)
            self.sizer.observe(result.num_drafted, from_head)


# ----------------------------------------------------------------------------------------------------------------
# the two modes


@dataclass(frozen=True)
class EagleOptions(NgramOptions):
    """``eagle_head``: a head folder (any of the three layouts) or Hub id; None: the head shipped for the target.
    ``eagle_lookup``: the greedy tree also holds prompt lookup's continuation as one more branch (chosen by the
    n-gram settings it inherits, as in the ``ngram`` mode)."""

    eagle_head: str | None = None
    eagle_lookup: bool = True

    def validate(self) -> None:
        super().validate()
        if self.eagle_head is not None and not str(self.eagle_head).strip():
            raise InputError("the EAGLE head is empty: name a folder or Hub id, or leave it out", field="eagle_head")


def _check(target: LoadedModel, draft: LoadedModel | None, options: Any) -> None:
    head_for(target, options.eagle_head)  # none shipped for this target, or a misfit: one line, before any pass


def _describe(target: LoadedModel, options: Any) -> dict[str, Any]:
    """The head a results file records: the format it runs in (and the step times that chose it), its layers and
    draft vocabulary."""
    head = head_for(target, options.eagle_head)
    return {
        "eagle_head": options.eagle_head or "shipped",
        "lookup_branch": bool(options.eagle_lookup),
        "head_format": head.number_format,
        "head_step_seconds": head.format_seconds,
        "hidden_layers": list(head.hidden_layers),
        "draft_vocab_size": head.config.draft_vocab_size,
    }


def _build(context: BuildContext, tree: bool) -> EagleDrafter:
    target, settings = context.target, context.settings
    tree = tree and settings.sampling.greedy  # sampling is exact on a chain only
    policy, options = context.policy, context.options
    lookup = (LookupBranch(options.ngram_min, options.ngram_max, options.ngram_prefer)
              if tree and options.eagle_lookup else None)
    return EagleDrafter(
        head_for(target, context.options.eagle_head),
        target.model.get_input_embeddings(),
        settings.sampling,
        target_vocab_size=output_rows(target.model),
        tree=tree,
        generator=drafter_generator(settings.sampling.seed, target.device),
        verify_cost=tree_verify_cost(policy, tree),
        lookup=lookup,
        passes=context.passes,
        max_new_tokens=settings.max_new_tokens,
    )


def _policy(context: PolicyContext, tree: bool) -> DraftLengthPolicy:
    # a head step costs a few percent of a target pass: the adaptive policy learns it from the first rounds
    return heads_policy(context, tree)


METHODS = (
    Method(
        name="eagle",
        label="EAGLE-3 head on the target's features and prompt lookup, a tree of candidates (no draft model)",
        build=lambda context: _build(context, tree=True),
        options=EagleOptions,
        drafts_for_free=True,
        proposes_trees=True,
        needs_hidden_states=True,
        check=_check,
        describe=_describe,
        make_policy=lambda context: _policy(context, tree=True),
        drafting_model=lambda target, draft, options: head_for(target, options.eagle_head),
    ),
    Method(
        name="eagle-chain",
        label="EAGLE-3 head on the target's features, a chain of its top tokens (no draft model)",
        build=lambda context: _build(context, tree=False),
        options=EagleOptions,
        drafts_for_free=True,
        needs_hidden_states=True,
        check=_check,
        describe=_describe,
        make_policy=lambda context: _policy(context, tree=False),
        drafting_model=lambda target, draft, options: head_for(target, options.eagle_head),
    ),
)
