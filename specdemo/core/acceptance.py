"""Logit warping and the acceptance rules of speculative decoding.

The same :func:`target_distribution` is used by the plain baseline and by verification, so sampled speculative
output follows exactly the distribution the target alone would sample from.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .settings import SamplingSettings

logger = logging.getLogger(__name__)


def warp_logits(logits: torch.Tensor, sampling: SamplingSettings) -> torch.Tensor:
    """Temperature, then top-k, then top-p on the last dimension; filtered entries become -inf (float32)."""
    scores = logits.float()
    if sampling.greedy:
        return scores
    scores = scores / sampling.temperature
    vocab_size = scores.shape[-1]
    if 0 < sampling.top_k < vocab_size:
        kth_best = torch.topk(scores, sampling.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth_best, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_scores, sorted_idx = torch.sort(scores, dim=-1, descending=False)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        # drop the low tail whose mass is at most 1 - top_p; the best token always stays
        remove_sorted = cumulative <= (1.0 - sampling.top_p)
        remove_sorted[..., -1] = False
        remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)
        scores = scores.masked_fill(remove, float("-inf"))
    return scores


def target_distribution(logits: torch.Tensor, sampling: SamplingSettings) -> torch.Tensor:
    """Probabilities the next token is drawn from (float32). For greedy settings: plain softmax (display only)."""
    return warp_logits(logits, sampling).softmax(dim=-1)


def sample_token(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Draw one token id from a 1-D probability vector."""
    return int(torch.multinomial(probs, 1, generator=generator).item())


def choose_token(logits: torch.Tensor, sampling: SamplingSettings, generator: torch.Generator | None) -> int:
    """The baseline's choice for one position: argmax when greedy, else a draw from the warped distribution."""
    if sampling.greedy:
        return int(logits.argmax(dim=-1).item())
    return sample_token(target_distribution(logits, sampling), generator)


@dataclass(frozen=True)
class Verdict:
    """Outcome of one verification: how many draft tokens were accepted, the target's own next token and, for a
    tree, the indices of the accepted nodes from the root down (for a chain: the first ``num_accepted``)."""

    num_accepted: int
    next_token: int
    path: tuple[int, ...] | None = None

    @property
    def accepted_nodes(self) -> tuple[int, ...]:
        return self.path if self.path is not None else tuple(range(self.num_accepted))

    @property
    def last_row(self) -> int:
        """The verify pass's row whose logits chose ``next_token`` (row 0 is the token before the draft)."""
        nodes = self.accepted_nodes
        return nodes[-1] + 1 if nodes else 0


def accept_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> Verdict:
    """Longest prefix of the draft that matches the target's argmax, then the target's argmax after it.

    ``draft_tokens``: [k] ids; ``target_logits``: [k + 1, V] logits at [last token + draft].
    """
    target_choice = target_logits.argmax(dim=-1)
    num_drafted = draft_tokens.shape[0]
    matches = (draft_tokens == target_choice[:num_drafted]).to(torch.int64)
    num_accepted = int(matches.cumprod(dim=0).sum().item()) if num_drafted else 0
    return Verdict(num_accepted, int(target_choice[num_accepted].item()))


def accept_greedy_tree(draft_tokens: torch.Tensor, parents: list[int], target_logits: torch.Tensor) -> Verdict:
    """The deepest path of a token tree that matches the target's argmax all the way, then the target's token.

    ``draft_tokens``: [n] node tokens in topological order; ``parents[i]``: node i's parent (-1 = the root, the
    token before the draft); ``target_logits``: [n + 1, V], row 0 for the root and row i + 1 for node i. A node is
    accepted when its parent is and its token is the target's argmax after the parent. Siblings carry different
    tokens, so at most one child of each node matches and the accepted path is unique.
    """
    target_choice = target_logits.argmax(dim=-1)
    parent_rows = torch.tensor(parents, dtype=torch.long, device=target_choice.device) + 1
    matches = (draft_tokens == target_choice[parent_rows]).tolist()
    accepted = [False] * len(parents)
    depth = [0] * len(parents)
    best = -1
    for node, parent in enumerate(parents):
        accepted[node] = bool(matches[node]) and (parent < 0 or accepted[parent])
        if accepted[node]:
            depth[node] = 1 + (depth[parent] if parent >= 0 else 0)
            if best < 0 or depth[node] > depth[best]:
                best = node
    path: list[int] = []
    node = best
    while node >= 0:
        path.append(node)
        node = parents[node]
    path.reverse()
    row = best + 1 if best >= 0 else 0
    return Verdict(len(path), int(target_choice[row].item()), tuple(path))


def accept_sampling(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> Verdict:
    """Rejection sampling (Leviathan et al. 2023; Chen et al. 2023), vectorised over the draft positions.

    ``draft_probs`` is [k, V] (the distribution each draft token was sampled from) or None for drafters without
    probabilities (n-gram lookup), which propose a point mass. ``target_probs`` is [k + 1, V]. Draft token i is
    kept with probability min(1, target/draft); at the first rejection the token is drawn from the residual
    max(0, target - draft) renormalised; when all are kept a bonus token is drawn from the last target row.
    """
    num_drafted = draft_tokens.shape[0]
    positions = torch.arange(num_drafted, device=target_probs.device)
    target_at_draft = target_probs[positions, draft_tokens]
    if draft_probs is None:
        draft_at_draft = torch.ones_like(target_at_draft)
    else:
        draft_at_draft = draft_probs[positions, draft_tokens]
    uniforms = torch.rand(num_drafted, generator=generator, device=target_probs.device)
    # u < t/d  <=>  u * d < t  (avoids dividing by a zero draft probability)
    kept = (uniforms * draft_at_draft < target_at_draft).to(torch.int64)
    num_accepted = int(kept.cumprod(dim=0).sum().item()) if num_drafted else 0
    if num_accepted == num_drafted:
        return Verdict(num_accepted, sample_token(target_probs[num_drafted], generator))
    row = target_probs[num_accepted]
    if draft_probs is None:
        residual = row.clone()
        residual[draft_tokens[num_accepted]] = 0.0
    else:
        residual = (row - draft_probs[num_accepted]).clamp_min(0.0)
    total = residual.sum()
    if float(total) <= 0.0:  # only reachable through rounding: target == draft there
        residual, total = row, row.sum()
    return Verdict(num_accepted, sample_token(residual / total, generator))
