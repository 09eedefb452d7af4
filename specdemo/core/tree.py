"""Token trees: a draft is a tree of candidates in topological order (``parents[i] < i``, -1 = a root).

A chain is the tree whose parents are ``[-1, 0, 1, ...]``. These helpers build a tree from per-depth candidates,
give each node's depth (its position offset) and the attention mask a tree's verify pass needs.
"""

from __future__ import annotations

import heapq
import logging
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
