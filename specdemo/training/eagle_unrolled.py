"""The EAGLE-3 trainer's training-time test (:mod:`specdemo.training.eagle`): the cached sequences in batches, the
head unrolled over them as the drafter drafts, its loss, and the held-out figures.

Row i of a sequence is the draft root the drafter has after committing position i: step 1 reads fc(target states
at i) and the embedding of token i+1 at position i; step j > 1 reads the head's own output of step j - 1 at row i
and the embedding of token i+j, at position i+j-1, and attends to the step-1 keys of positions 0..i and the keys
of its own earlier steps at row i only.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..backends.eagle3_head import EagleHead
from .common import distribution_cross_entropy, read_shards


class StateRows:
    """The cached states of consecutive positions [P, k*H], kept as the shards' own tensors (mapped from the cache's
    files by :func:`load_split`, so that a corpus larger than the memory trains): rows ``start:stop`` of one shard
    at a time, which holds every sequence whole."""

    def __init__(self, parts: list[torch.Tensor]) -> None:
        self.parts = parts
        self.starts = [0]
        for part in parts:
            self.starts.append(self.starts[-1] + part.shape[0])

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, rows: slice) -> torch.Tensor:
        start, stop, _ = rows.indices(len(self))
        part = max(bisect.bisect_right(self.starts, start) - 1, 0)
        if part >= len(self.parts) or stop > self.starts[part + 1]:
            raise IndexError(f"rows {start}:{stop} are not inside one shard")
        return self.parts[part][start - self.starts[part] : stop - self.starts[part]]


@dataclass
class Split:
    """Cached sequences, concatenated: ``ids``, ``greedy`` [P], ``states`` [P, k*H] (a tensor or the shards'
    :class:`StateRows`); sequence s is ``offsets[s] : offsets[s] + lengths[s]``, its answer starting at
    ``answer_starts[s]``. ``finals``, where the cache holds them (the prompt pool's): the target's final hidden
    states [F, H] from each answer's first prediction on (position ``answer_starts[s] - 1``), sequence s's at
    ``final_offsets[s]``; None where any sequence lacks them."""

    ids: torch.Tensor
    greedy: torch.Tensor
    states: StateRows | torch.Tensor
    lengths: torch.Tensor
    answer_starts: torch.Tensor
    finals: StateRows | None = None

    def __post_init__(self) -> None:
        if isinstance(self.states, torch.Tensor):
            self.states = StateRows([self.states] if len(self.states) else [])

    @property
    def offsets(self) -> torch.Tensor:
        return torch.cumsum(self.lengths, 0) - self.lengths

    @property
    def final_offsets(self) -> torch.Tensor:
        counts = self.lengths - self.answer_starts + 1
        return torch.cumsum(counts, 0) - counts

    def __len__(self) -> int:
        return int(self.lengths.numel())

    def labels(self) -> torch.Tensor:
        """The greedy tokens a head learns: those after the answer's first token, per sequence."""
        keep = torch.zeros(self.ids.numel(), dtype=torch.bool)
        for offset, length, start in zip(self.offsets.tolist(), self.lengths.tolist(), self.answer_starts.tolist()):
            keep[offset + start : offset + length] = True
        return self.greedy[keep]

    @staticmethod
    def empty() -> Split:
        """A split of no sequences."""
        no_ids, no_counts = torch.zeros(0, dtype=torch.int32), torch.zeros(0, dtype=torch.long)
        return Split(no_ids, no_ids, StateRows([]), no_counts, no_counts)

    @staticmethod
    def join(parts: list[Split]) -> Split:
        """The sequences of ``parts`` in order (their states' shards listed, not copied); finals where every part
        with sequences has them."""
        holding = [p for p in parts if len(p)]
        finals = StateRows([shard for p in holding for shard in p.finals.parts]) \
            if all(p.finals is not None for p in holding) else None
        return Split(*(torch.cat([getattr(p, name) for p in parts]) for name in ("ids", "greedy")),
                     StateRows([shard for p in parts for shard in p.states.parts]),
                     *(torch.cat([getattr(p, name) for p in parts]) for name in ("lengths", "answer_starts")),
                     finals)


def load_split(folder: Path, name: str) -> Split:
    """The cached sequences of ``name`` (none: an empty split), their states mapped from the files."""
    if not any(folder.glob(f"{name}_*.pt")):
        return Split.empty()
    shards = read_shards(folder, name, mmap=True)
    return Split(*(torch.cat([s[key] for s in shards]) for key in ("ids", "greedy")),
                 StateRows([s["states"] for s in shards]),
                 *(torch.cat([s[key] for s in shards]) for key in ("lengths", "answer_starts")))


# ----------------------------------------------------------------------------------------------------------------
# batches


@dataclass
class Batch:
    """Sequences side by side. Rows are positions 0..n-2 of each (a row needs the next token), flat in ``mask``'s
    row-major order. Per row: ``states``; ``tokens`` [S, N] (the token each step reads: token i+j at step j);
    ``labels`` [S, N] (the target's greedy token after it, -1 past the end or before the answer); ``active``
    (rows that learn: from the answer's first prediction on); with ``with_finals``, ``finals`` [S, N, H]: the
    target's final hidden state where it wrote each step's label (zeros where there is none), whose next-token
    distribution a step learns instead of its greedy token."""

    mask: torch.Tensor  # [B, L]
    states: torch.Tensor  # [N, k*H]
    positions: torch.Tensor  # [N]
    tokens: torch.Tensor  # [S, N]
    labels: torch.Tensor  # [S, N]
    active: torch.Tensor  # [N]
    finals: torch.Tensor | None = None  # [S, N, H]


def _step_finals(split: Split, s: int, count: int, steps: int) -> torch.Tensor:
    """Sequence ``s``'s final hidden states at position i + j for rows i < ``count`` and steps j (zeros before
    the answer's first prediction and past the end): [S, count, H]."""
    length, start = int(split.lengths[s]), int(split.answer_starts[s])
    offset = int(split.final_offsets[s])
    stored = split.finals[offset : offset + length - start + 1]
    by_position = torch.zeros(length, stored.shape[-1], dtype=stored.dtype)
    by_position[start - 1 :] = stored
    here = torch.arange(count)
    return torch.stack([torch.where((here + j < length)[:, None], by_position[(here + j).clamp(max=length - 1)], 0)
                        for j in range(1, steps + 1)])


def make_batch(split: Split, members: list[int], steps: int, with_finals: bool = False) -> Batch:
    if with_finals and split.finals is None:
        raise ValueError("these cached sequences hold no final hidden states (only the prompt pool's do)")
    offsets, lengths, starts = split.offsets, split.lengths, split.answer_starts
    rows = [int(lengths[s]) - 1 for s in members]
    mask = torch.zeros(len(members), max(rows), dtype=torch.bool)
    states, positions, tokens, labels, active = [], [], [], [], []
    finals = [_step_finals(split, s, count, steps) for s, count in zip(members, rows)] if with_finals else None
    for b, s in enumerate(members):
        offset, length, count = int(offsets[s]), int(lengths[s]), rows[b]
        mask[b, :count] = True
        ids = split.ids[offset : offset + length].long()
        greedy = split.greedy[offset : offset + length].long()
        states.append(split.states[offset : offset + count])
        here = torch.arange(count)
        positions.append(here)
        step_tokens, step_labels = [], []
        for j in range(1, steps + 1):
            inside = here + j < length
            at = (here + j).clamp(max=length - 1)
            step_tokens.append(torch.where(inside, ids[at], 0))
            step_labels.append(torch.where(inside, greedy[at], -1))
        tokens.append(torch.stack(step_tokens))
        labels.append(torch.stack(step_labels))
        active.append(here >= int(starts[s]) - 1)
    return Batch(mask, torch.cat(states), torch.cat(positions), torch.cat(tokens, 1), torch.cat(labels, 1),
                 torch.cat(active), torch.cat(finals, 1) if finals is not None else None)


def plan_batches(split: Split, order: list[int], batch_tokens: int) -> list[list[int]]:
    """Consecutive sequences of ``order`` grouped into batches of at most ``batch_tokens`` tokens (one sequence
    at least)."""
    batches: list[list[int]] = []
    current: list[int] = []
    size = 0
    for s in order:
        length = int(split.lengths[s])
        if current and size + length > batch_tokens:
            batches.append(current)
            current, size = [], 0
        current.append(s)
        size += length
    if current:
        batches.append(current)
    return batches


def epoch_order(count: int, seed: int, epoch: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(count, generator=generator).tolist()


# ----------------------------------------------------------------------------------------------------------------
# the training-time test


def _rope(head: EagleHead, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [N, 1, head_dim] at ``positions``, as :meth:`EagleHead.forward` computes them."""
    # the head's own tables (EagleHead keeps them private; a test checks this against EagleHead.forward)
    inv_freq, scaling = head._inv_freq, head._rope_scaling
    frequencies = positions.to(torch.float32)[:, None] * inv_freq.to(positions.device)[None]
    angles = torch.cat([frequencies, frequencies], dim=-1)
    return (angles.cos() * scaling).to(dtype)[:, None], (angles.sin() * scaling).to(dtype)[:, None]


def _rotate(states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = states.chunk(2, dim=-1)
    return states * cos + torch.cat((-second, first), dim=-1) * sin


def _padded(flat: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Rows [n, heads, d] placed at ``mask``'s True places of [B, L] -> [B, heads, L, d] (zeros elsewhere)."""
    where = mask.nonzero(as_tuple=True)
    out = flat.new_zeros(mask.shape[0], mask.shape[1], *flat.shape[1:]).index_put(where, flat)
    return out.transpose(1, 2)


def unrolled_forward(head: EagleHead, embed_weight: torch.Tensor, batch: Batch, steps: int) -> list[torch.Tensor]:
    """The head's outputs (before the final norm) at each of ``steps`` unrolled steps: [N, H] for step 1 (every
    row: later steps attend to its keys), then [A, H] for the active rows."""
    layer = head.midlayer
    attn = layer.self_attn
    dtype = head.dtype
    heads, kv_heads, head_dim = attn.heads, attn.kv_heads, attn.head_dim
    groups = heads // kv_heads
    scale = head_dim**-0.5
    mask = batch.mask
    B, L = mask.shape
    key_valid = mask[:, None, None, :]
    causal = torch.ones(L, L, dtype=torch.bool).tril()[None, None] & key_valid  # [B, 1, L, L]
    active_mask = torch.zeros_like(mask)
    active_mask[mask] = batch.active
    active = batch.active.nonzero(as_tuple=True)[0]

    def project(features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor):
        normed = layer.hidden_norm(features)
        residual = normed if layer.norm_before_residual else features
        embeds = embed_weight[tokens].to(dtype)
        inputs = torch.cat([layer.input_layernorm(embeds), normed], dim=-1)
        n = inputs.shape[0]
        queries = attn.q_proj(inputs).view(n, heads, head_dim)
        keys = attn.k_proj(inputs).view(n, kv_heads, head_dim)
        values = attn.v_proj(inputs).view(n, kv_heads, head_dim)
        if attn.q_norm is not None and attn.k_norm is not None:
            queries, keys = attn.q_norm(queries), attn.k_norm(keys)
        cos, sin = _rope(head, positions, dtype)
        return residual, _rotate(queries, cos, sin), _rotate(keys, cos, sin), values

    def finish(residual: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        hidden = residual + attn.o_proj(attended.reshape(attended.shape[0], heads * head_dim))
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))

    def expand(padded: torch.Tensor) -> torch.Tensor:
        return padded.repeat_interleave(groups, dim=1) if groups > 1 else padded

    # step 1: the target's features, causal over each sequence (the drafter's catch-up)
    residual, queries, keys, values = project(head.features(batch.states), batch.tokens[0], batch.positions)
    keys1, values1 = expand(_padded(keys, mask)), expand(_padded(values, mask))
    attended = F.scaled_dot_product_attention(_padded(queries, mask), keys1, values1, attn_mask=causal, scale=scale)
    output = finish(residual, attended.transpose(1, 2)[mask])
    outputs = [output]
    if steps == 1:
        return outputs
    # steps 2..S: the head's own output as the feature, one position further, attending to the step-1 keys up to
    # its root and to its own earlier steps' keys (the diagonal)
    features = output[active]
    own_keys: list[torch.Tensor] = []
    own_values: list[torch.Tensor] = []
    for j in range(2, steps + 1):
        residual, queries, keys, values = project(features, batch.tokens[j - 1, active],
                                                  batch.positions[active] + (j - 1))
        own_keys.append(expand(_padded(keys, active_mask)))
        own_values.append(expand(_padded(values, active_mask)))
        q = _padded(queries, active_mask)  # [B, heads, L, d]
        scores = (q @ keys1.transpose(-1, -2)) * scale
        scores = scores.masked_fill(~causal, float("-inf"))
        diagonal = torch.stack([(q * k).sum(-1) for k in own_keys], dim=-1) * scale  # [B, heads, L, j - 1]
        weights = torch.cat([scores, diagonal], dim=-1).float().softmax(-1).to(values1.dtype)
        attended = weights[..., :L] @ values1
        for m, v in enumerate(own_values):
            attended = attended + weights[..., L + m, None] * v
        output = finish(residual, attended.transpose(1, 2)[active_mask])
        outputs.append(output)
        features = output
    return outputs


def step_labels(batch: Batch, t2d: torch.Tensor) -> list[torch.Tensor]:
    """Per step, the active rows' labels as draft indices (-100: past the end, or outside the draft vocabulary)."""
    labels = batch.labels[:, batch.active]
    mapped = torch.where(labels >= 0, t2d[labels.clamp(min=0)], -1)
    return list(mapped.masked_fill(mapped < 0, -100))


def distribution_loss(head: EagleHead, logits: torch.Tensor, finals: torch.Tensor,
                      labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the head's ``logits`` against the target's own next-token distribution over the draft
    vocabulary (its final hidden states ``finals`` read by the head's LM head, which is the target's rows at the
    draft ids), over the rows whose greedy token is inside the draft vocabulary (``labels`` >= 0)."""
    keep = labels >= 0
    with torch.no_grad():
        target_logits = F.linear(finals[keep], head.lm_head.weight)
    return distribution_cross_entropy(logits[keep], target_logits)


def unrolled_loss(head: EagleHead, embed_weight: torch.Tensor, batch: Batch, t2d: torch.Tensor, steps: int,
                  decay: float) -> tuple[torch.Tensor | None, list[float]]:
    """The decayed sum over steps of each step's loss, and each step's: cross-entropy against the target's greedy
    token, or against its whole distribution where the batch holds its final states (:func:`distribution_loss`)."""
    outputs = unrolled_forward(head, embed_weight, batch, steps)
    outputs[0] = outputs[0][batch.active]
    total: torch.Tensor | None = None
    per_step = []
    for j, (output, labels) in enumerate(zip(outputs, step_labels(batch, t2d))):
        if not bool((labels >= 0).any()):
            per_step.append(float("nan"))
            continue
        logits = head.logits(output).float()
        if batch.finals is None:
            loss = F.cross_entropy(logits, labels, ignore_index=-100)
        else:
            loss = distribution_loss(head, logits, batch.finals[j][batch.active], labels)
        total = decay**j * loss if total is None else total + decay**j * loss
        per_step.append(float(loss.detach()))
    return total, per_step


@torch.inference_mode()
def evaluate(head: EagleHead, embed_weight: torch.Tensor, split: Split, steps: int,
             batch_tokens: int) -> dict:
    """Top-1 accuracy per step against the target's greedy token (tokens outside the draft vocabulary count as
    misses), and the mean accepted drafts of greedy chains of k = 1..steps drafts, over the rows that have a
    label at every step."""
    correct = torch.zeros(steps)
    counted = torch.zeros(steps)
    accepted = torch.zeros(steps)
    roots = 0
    for members in plan_batches(split, list(range(len(split))), batch_tokens):
        batch = make_batch(split, members, steps)
        outputs = unrolled_forward(head, embed_weight, batch, steps)
        outputs[0] = outputs[0][batch.active]
        predicted = torch.stack([head.draft_ids[head.logits(o).argmax(-1)] for o in outputs])  # [S, A]
        labels = batch.labels[:, batch.active]
        tokens = batch.tokens[:, batch.active]
        valid = labels >= 0
        correct += ((predicted == labels) & valid).sum(1).float()
        counted += valid.sum(1).float()
        whole = valid.all(0)
        right = predicted == labels
        # step j's draft is checked only if every earlier draft was right and was the text's token (the token
        # step j read): else the target's greedy token after the drafts is not known
        still = right[0].clone()
        chain = [still.clone()]
        for j in range(1, steps):
            still = still & (predicted[j - 1] == tokens[j]) & right[j]
            chain.append(still.clone())
        lengths = torch.stack(chain).long().cumsum(0)[:, whole]  # [S, roots]
        accepted += lengths.sum(1).float()
        roots += int(whole.sum())
    return {
        "top1_per_step": [round(float(c / n), 4) if n > 0 else 0.0 for c, n in zip(correct, counted)],
        "mean_accepted_drafts": [round(float(a / roots), 4) if roots else 0.0 for a in accepted],
        "positions": int(counted[0]),
        "chains": roots,
    }

