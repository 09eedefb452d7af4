"""Token trees: a draft is a tree of candidates in topological order (``parents[i] < i``, -1 = a root).

A chain is the tree whose parents are ``[-1, 0, 1, ...]``. These helpers build a tree from per-depth candidates,
give each node's depth (its position offset) and the attention mask a tree's verify pass needs.
"""

from __future__ import annotations

import heapq
import logging
from dataclasses import dataclass
from typing import Sequence

import torch

logger = logging.getLogger(__name__)


def chain_parents(num_tokens: int) -> list[int]:
    """The parents of a chain of ``num_tokens`` tokens: ``[-1, 0, 1, ...]``."""
    return list(range(-1, num_tokens - 1))


def tree_depths(parents: Sequence[int]) -> list[int]:
    """Depth of each node of a tree given in topological order (``parents[i] < i``; -1 = a root, depth 0)."""
    depths: list[int] = []
    for index, parent in enumerate(parents):
        if not -1 <= parent < index:
            raise ValueError(f"node {index} has parent {parent}: parents must come before their children")
        depths.append(0 if parent < 0 else depths[parent] + 1)
    return depths


def is_chain(parents: Sequence[int] | None) -> bool:
    """Whether ``parents`` (None = a chain) describe a chain."""
    return parents is None or all(parent == index - 1 for index, parent in enumerate(parents))


def tree_attention_mask(
    parents: Sequence[int], cached: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A 4D additive mask (1, 1, n, cached + n): each new token sees the cached prefix, its ancestors and itself."""
    count = len(parents)
    visible = torch.zeros(count, cached + count, dtype=torch.bool)
    visible[:, :cached] = True
    for index, parent in enumerate(parents):
        if parent >= 0:
            visible[index, cached : cached + count] = visible[parent, cached : cached + count]
        visible[index, cached + index] = True
    mask = torch.zeros(count, cached + count, dtype=dtype)
    mask.masked_fill_(~visible, torch.finfo(dtype).min)
    return mask.view(1, 1, count, cached + count).to(device)


def build_tree(
    head_probs: torch.Tensor, head_ids: torch.Tensor, num_draft_tokens: int
) -> tuple[list[int], list[int], list[float]]:
    """The ``num_draft_tokens`` most likely nodes of the tree of candidate continuations, best first.

    ``head_probs`` / ``head_ids``: [K, w] each head's top-w probabilities and token ids (head k guesses depth k).
    A node's score is the product of its path's probabilities (heads taken as independent), so every ancestor
    scores at least as high as its descendants and the ``num_draft_tokens`` best nodes form a tree. Returns (tokens,
    parents, scores), parents before children; with w = 1 the tree is a chain.
    """
    num_heads, width = head_probs.shape
    probs = head_probs.tolist()
    ids = head_ids.tolist()
    tokens: list[int] = []
    parents: list[int] = []
    scores: list[float] = []
    # candidates: (-score, tie-breaker, depth, rank, parent node, parent's score)
    frontier = [(-probs[0][0], 0, 0, 0, -1, 1.0)]
    counter = 1
    while frontier and len(tokens) < num_draft_tokens:
        negative, _, depth, rank, parent, parent_score = heapq.heappop(frontier)
        node = len(tokens)
        tokens.append(int(ids[depth][rank]))
        parents.append(parent)
        scores.append(-negative)
        if rank + 1 < width:  # the next sibling
            heapq.heappush(frontier, (-parent_score * probs[depth][rank + 1], counter, depth, rank + 1, parent,
                                      parent_score))
            counter += 1
        if depth + 1 < num_heads:  # the first child
            heapq.heappush(frontier, (negative * probs[depth + 1][0], counter, depth + 1, 0, node, -negative))
            counter += 1
    return tokens, parents, scores


def best_path_first(parents: Sequence[int]) -> tuple[list[int], list[int]]:
    """A tree given best first (``parents[i]`` < i, -1 for a root) in depth-first order, each node's children best
    first: (the nodes in that order, their parents renumbered). The best path comes first, so its nodes read a
    prefix of the verify pass's keys and share them (the other nodes' keys are gathered, see
    :func:`~specdemo.backends.formats.row_wise_attention`)."""
    children: dict[int, list[int]] = {-1: []}
    for node, parent in enumerate(parents):
        children.setdefault(parent, []).append(node)
    order: list[int] = []
    stack = children[-1][::-1]
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(children.get(node, [])[::-1])
    place = {node: index for index, node in enumerate(order)}
    return order, [place[parents[node]] if parents[node] >= 0 else -1 for node in order]


@dataclass
class MergedTree:
    """A tree of candidates joined with a branch from another source (see :func:`add_branch`), best first: each
    node's token, parent, path probability, source ("tree", "branch" or "both") and index in the tree it came from
    (-1 for a node of the branch alone)."""

    tokens: list[int]
    parents: list[int]
    probs: list[float]
    sources: list[str]
    tree_nodes: list[int]

    def cut(self, count: int) -> "MergedTree":
        """The first ``count`` nodes (a tree again: parents come first)."""
        return MergedTree(self.tokens[:count], self.parents[:count], self.probs[:count], self.sources[:count],
                          self.tree_nodes[:count])


def add_branch(
    tokens: Sequence[int],
    parents: Sequence[int],
    probs: Sequence[float],
    branch_tokens: Sequence[int],
    branch_probs: Sequence[float],
) -> MergedTree:
    """A tree of candidates (best first: ``parents[i]`` < i, path probabilities ``probs`` that never rise from a
    parent to its child) with one more chain of candidates from another source, ``branch_tokens`` from the root
    with their path probabilities ``branch_probs`` (falling along the chain).

    Where the branch follows the tree's nodes it joins them (a node both hold keeps the higher of its two
    probabilities); where it leaves them it grows new nodes. The result is best first again, parents before
    children; ties keep the tree's order and put shallower nodes first.
    """
    merged_tokens, merged_parents, merged_probs = list(tokens), list(parents), [float(p) for p in probs]
    sources = ["tree"] * len(merged_tokens)
    depths = tree_depths(merged_parents)
    child = {(parent, token): node for node, (parent, token) in enumerate(zip(merged_parents, merged_tokens))}
    at = -1
    for token, prob in zip(branch_tokens, branch_probs):
        node = child.get((at, int(token)))
        if node is None:
            node = len(merged_tokens)
            merged_tokens.append(int(token))
            merged_parents.append(at)
            merged_probs.append(float(prob))
            sources.append("branch")
            depths.append(0 if at < 0 else depths[at] + 1)
            child[(at, int(token))] = node
        else:
            merged_probs[node] = max(merged_probs[node], float(prob))
            sources[node] = "both"
        at = node
    order = sorted(range(len(merged_tokens)), key=lambda node: (-merged_probs[node], depths[node], node))
    rank = {node: index for index, node in enumerate(order)}
    return MergedTree(
        [merged_tokens[node] for node in order],
        [rank[merged_parents[node]] if merged_parents[node] >= 0 else -1 for node in order],
        [merged_probs[node] for node in order],
        [sources[node] for node in order],
        [node if node < len(tokens) else -1 for node in order],
    )
