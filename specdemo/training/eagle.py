"""Train an EAGLE-3 head for a target by self-distillation, on a CPU: ``python -m specdemo.training.eagle``.

1. Corpus: the Medusa trainer's (:mod:`specdemo.training.common`): stretches of the Python standard library's
   sources as chat turns, files split into training and held-out sets by a hash of their path, and with
   ``--answers N`` the target's own greedy answers to N offline prompts (one in ``held_out_every`` held out; the
   Medusa trainer's cached answers to the same prompts are reused). The benchmark prompt files are never read.
2. Cache: the frozen target runs once over every sequence with teacher forcing; at every position the states of
   the three layers the head reads (bfloat16) and the target's greedy next token are stored with the token ids,
   in shards (a restart resumes where the cache stopped). The prompt's positions are stored too: at inference
   the head attends to them.
3. Draft vocabulary: the ``draft_vocab_size`` most frequent greedy target tokens of the training answers, plus
   the EOS ids. The head's LM head is the target's own rows at those ids, frozen and not stored
   (``shared_lm_head``); its final norm starts as the target's.
4. Train with EAGLE-3's training-time test, ``steps_unrolled`` steps deep. Row i of a sequence is the draft
   root the drafter has after committing position i: step 1 reads fc(target states at i) and the embedding of
   token i+1 at position i, as the drafter's catch-up does; step j > 1 reads the head's own output of step j - 1
   at row i and the embedding of token i+j, at position i+j-1, and attends to the step-1 keys of positions 0..i
   and the keys of its own earlier steps at row i only, exactly the cache the drafter has when it drafts (the
   dot-product form of EAGLE-3's reference code, with the drafter's positions). Step j learns the target's
   greedy token after token i+j (cross-entropy over the draft vocabulary, tokens outside it masked, weight
   ``loss_decay ** (j - 1)``), gradients flowing through all steps. AdamW, warm-up then cosine decay, gradient
   clipping, seeded, matmuls in bfloat16 under autocast (``--train-dtype``; float32 weights and optimizer
   state); a checkpoint (head, optimizer, schedule, step, RNG state) every few minutes and after each
   epoch, so a stopped run resumes exactly.
5. Evaluate the weights as written (rounded to bfloat16) on the held-out sequences: top-1 accuracy per step (the
   head feeding itself its outputs, tokens as in training) and the mean accepted drafts of greedy chains of k = 1..S drafts (a chain stops at the first
   draft that differs from the target's greedy token, or from the text, after which the target's token is not
   known). Write the head (bfloat16, :func:`~specdemo.methods.eagle.save_head`) and ``training.json``.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import logging
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..backends.formats import output_rows, output_weight
from ..core.files import atomic_path, file_sha256
from ..methods.eagle import (
    EagleConfig,
    EagleHead,
    _llama_fields,
    default_hidden_layers,
    load_head,
    save_head,
    target_facts,
    weights_file,
)
from .common import (
    ANSWERS_FILE,
    CACHE_HOME,
    CorpusSettings,
    add_corpus_arguments,
    answer_sequences,
    answers_elsewhere,
    build_sequences,
    generate_answers,
    portable_path,
    read_shards,
    write_shards,
)
from .corpus import TrainingPrompt, chat_prompts, passage_prompts

logger = logging.getLogger(__name__)

CACHE_ROOT = CACHE_HOME / "eagle-train"
#: bumped when what a shard holds changes
CACHE_FORMAT = 1
#: the most bytes the head's weights file may take (the size picked for ``--intermediate-size 0``)
MAX_HEAD_BYTES = 40_000_000
#: the dtype the head is written in
SHIP_DTYPE = torch.bfloat16
#: seconds between checkpoints inside an epoch
CHECKPOINT_SECONDS = 300.0
#: MLP widths tried for ``--intermediate-size 0`` are multiples of this
WIDTH_STEP = 128


#: how the head starts (``--init``) and the dtypes its matmuls may train in (``--train-dtype``)
INITS = ("random", "pass-through")
TRAIN_DTYPES = ("bfloat16", "float32")


@dataclass
class TrainSettings(CorpusSettings):
    cache_root = CACHE_ROOT  # where corpus_key() folders live (a class attribute, not a setting)

    target: str = "offline:qwen2.5-coder-1.5b"
    out: Path = Path("eagle-head")
    dtype: str = "bfloat16"  # the target's, for caching its states
    seed: int = 0
    sequences: int = 320
    sequence_tokens: int = 512
    held_out_every: int = 10
    held_out_sequences: int = 32
    answers: int = 480
    chat_answers: int = 0
    passage_answers: int = 0
    answer_tokens: int = 256
    generation_batch: int = 32
    epochs: int = 1
    steps_unrolled: int = 4
    draft_vocab_size: int = 16384
    intermediate_size: int = 0  # 0: the widest multiple of 128 whose weights file fits MAX_HEAD_BYTES
    learning_rate: float = 5e-4
    batch_tokens: int = 1024
    train_dtype: str = "bfloat16"  # the head's matmuls while training (autocast; float32 weights and optimizer)
    loss_decay: float = 0.8
    grad_clip: float = 0.5
    warmup_steps: int = 10
    #: "pass-through": the feature starts as the highest layer's state and the layer's two residual branches at
    #: zero, so the untrained head already reads the target's LM head input space; "random": PyTorch's init
    init: str = "random"
    #: a head to start from instead (its sizes and draft vocabulary kept): training it further on more text
    init_from: Path | None = None
    time_budget_minutes: float | None = None
    cache_dir: Path | None = None
    #: stop (checkpointed, as a spent time budget does) after this many optimizer steps in all; for tests
    stop_after_steps: int | None = None
    extra: dict = field(default_factory=dict)

    def corpus_key(self) -> str:
        keyed = [CACHE_FORMAT, self.target, self.dtype, self.sequences, self.sequence_tokens, self.held_out_every,
                 self.held_out_sequences, self.seed, sys.version.split()[0]]
        return hashlib.sha256(json.dumps(keyed).encode()).hexdigest()[:16]

    def train_key(self, draft_ids: torch.Tensor, config: EagleConfig) -> str:
        init = [self.init] if self.init != "random" else []  # absent for random: earlier checkpoints still resume
        chat = [self.chat_answers_key(), self.chat_answers] if self.chat_answers else []  # absent: earlier keys hold
        passage = [self.passage_answers_key(), self.passage_answers] if self.passage_answers else []
        start = [_weights_digest(self.init_from)] if self.init_from is not None else []
        keyed = [self.corpus_key(), self.answers_key() if self.answers else None, *chat, *passage, *start, self.epochs,
                 self.steps_unrolled, self.learning_rate, self.batch_tokens, self.train_dtype, self.loss_decay,
                 self.grad_clip, self.warmup_steps, *init, hashlib.sha256(draft_ids.numpy().tobytes()).hexdigest(), asdict(config)]
        return hashlib.sha256(json.dumps(keyed, default=str).encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------------------------------------------
# the head's shape


def head_fields(model, draft_vocab_size: int, intermediate_size: int) -> dict:
    """EagleConfig fields for a head on ``model``: its attention shape and rope, the layers EAGLE-3 reads, an
    LM head shared with the target; ``intermediate_size`` 0 picks the widest MLP that fits :data:`MAX_HEAD_BYTES`."""
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    fields = _llama_fields(text.to_dict())
    vocab = output_rows(model)
    fields.update(
        vocab_size=vocab,
        draft_vocab_size=min(draft_vocab_size, vocab),
        hidden_layers=default_hidden_layers(int(text.num_hidden_layers)),
        attention_bias=False,
        shared_lm_head=True,
    )
    if intermediate_size <= 0:
        widest = int(fields["intermediate_size"]) or WIDTH_STEP  # never wider than the target's own MLP
        intermediate_size = min(WIDTH_STEP, widest)
        while intermediate_size + WIDTH_STEP <= widest and head_bytes(
            EagleConfig(**{**fields, "intermediate_size": intermediate_size + WIDTH_STEP})
        ) <= MAX_HEAD_BYTES:
            intermediate_size += WIDTH_STEP
    fields["intermediate_size"] = intermediate_size
    return fields


def _weights_digest(source: Path) -> str:
    """What names a starting head in the training key: its weights file's sha256 (else the name as given)."""
    path = weights_file(Path(source))
    return file_sha256(path) if path is not None else str(source)


def head_bytes(config: EagleConfig) -> int:
    """About what the head's weights file takes: its parameters in :data:`SHIP_DTYPE`, ``d2t`` (int64) and
    ``t2d`` (one byte per target id), and the file's header."""
    itemsize = torch.empty((), dtype=SHIP_DTYPE).element_size()
    return itemsize * config.parameter_count() + 8 * config.draft_vocab_size + config.vocab_size + 8192


def draft_vocabulary(labels: torch.Tensor, size: int, vocab_size: int, eos_ids: list[int]) -> torch.Tensor:
    """The ``size`` target ids most often the target's greedy token in ``labels`` (ties: the lower id), the EOS
    ids always among them, then the lowest unused ids if too few tokens occur; sorted."""
    counts = torch.bincount(labels[labels >= 0].long(), minlength=vocab_size)[:vocab_size]
    order = torch.sort(-counts, stable=True).indices
    chosen = list(dict.fromkeys([i for i in eos_ids if 0 <= i < vocab_size] + order.tolist()))[:size]
    return torch.tensor(sorted(chosen), dtype=torch.long)


# ----------------------------------------------------------------------------------------------------------------
# cache of the target's states


@torch.inference_mode()
def sequence_states(model, ids: list[int], answer_start: int, layers: tuple[int, ...]) -> dict:
    """One teacher-forced pass of the target over ``ids``: the ids (int32), the states of ``layers`` at every
    position (bfloat16) and the target's greedy next token from the answer's first prediction on (-1 before),
    on the CPU, with ``answer_start``."""
    inputs = torch.tensor([ids], device=next(model.parameters()).device)
    start = answer_start - 1  # this position predicts the answer's first token
    out = model(input_ids=inputs, output_hidden_states=True, logits_to_keep=inputs.shape[1] - start)
    states = torch.cat([out.hidden_states[layer][0] for layer in layers], dim=-1)
    greedy = torch.full((inputs.shape[1],), -1, dtype=torch.int32)
    greedy[start:] = out.logits[0].argmax(-1).cpu().to(torch.int32)
    return {"ids": inputs[0].cpu().to(torch.int32), "states": states.to(torch.bfloat16).cpu(), "greedy": greedy,
            "answer_start": answer_start}


def cache_split(model, sequences: list[dict], folder: Path, name: str, layers: tuple[int, ...]) -> None:
    """Run the target over ``sequences`` with teacher forcing and store, per sequence, :func:`sequence_states`, in
    shards (existing shards kept)."""

    def per_sequence(sequence: dict) -> dict:
        return sequence_states(model, sequence["ids"], sequence["answer_start"], layers)

    def combine(rows: list[dict]) -> dict:
        return {"ids": torch.cat([r["ids"] for r in rows]), "states": torch.cat([r["states"] for r in rows]),
                "greedy": torch.cat([r["greedy"] for r in rows]),
                "lengths": torch.tensor([len(r["ids"]) for r in rows]),
                "answer_starts": torch.tensor([r["answer_start"] for r in rows])}

    write_shards(sequences, folder, name, per_sequence, combine, f"caching target states ({name})")


@dataclass
class AnswerSet:
    """One set of the target's own answers in the corpus: ``name`` (its figures' key in ``training.json``), the
    answers' ``key`` and ``folder``, the ``shards`` folder of its cached states, its ``prompts`` (None: the
    training prompts) and ``count``, how many of the first answers the head learns from (0: answered only, for
    passage prompts to quote)."""

    name: str
    key: str
    folder: Path
    shards: Path
    prompts: Callable[[], list[TrainingPrompt]] | None
    count: int
    rows: list[dict] = field(default_factory=list)
    counts: dict = field(default_factory=dict)

    def prepare(self, loaded, spec, layers: tuple[int, ...]) -> tuple[float, float]:
        """The answers (reused from any trainer's cache or the checkout, else generated) and the cached states
        of the first ``count``; (seconds answering, seconds caching)."""
        started = time.perf_counter()
        own = self.folder / ANSWERS_FILE
        elsewhere = [path for path in answers_elsewhere(self.key) if path != own]
        reused = portable_path(elsewhere[0]) if elsewhere and not own.is_file() else None
        self.rows = generate_answers(loaded, spec, own, start_from=elsewhere[0] if elsewhere else None,
                                     prompts=self.prompts() if self.prompts is not None else None)
        answered = time.perf_counter()
        if not self.count:
            return answered - started, 0.0
        learned = self.rows[: self.count]
        train_seqs, held_seqs = answer_sequences(loaded.tokenizer, learned, spec)
        cache_split(loaded.model, train_seqs, self.shards, "train", layers)
        cache_split(loaded.model, held_seqs, self.shards, "heldout", layers)
        self.counts = {"training_sequences": len(train_seqs), "held_out_sequences": len(held_seqs),
                       "mean_answer_tokens": round(sum(len(r["answer_ids"]) for r in learned) / max(1, len(learned)),
                                                   1),
                       **({"kinds": sorted({r["kind"] for r in learned})} if self.prompts is not None else {}),
                       "reused_from": reused}
        return answered - started, time.perf_counter() - answered


@dataclass
class Split:
    """Cached sequences, concatenated: ``ids``, ``greedy`` [P], ``states`` [P, k*H]; sequence s is
    ``offsets[s] : offsets[s] + lengths[s]``, its answer starting at ``answer_starts[s]``."""

    ids: torch.Tensor
    greedy: torch.Tensor
    states: torch.Tensor
    lengths: torch.Tensor
    answer_starts: torch.Tensor

    @property
    def offsets(self) -> torch.Tensor:
        return torch.cumsum(self.lengths, 0) - self.lengths

    def __len__(self) -> int:
        return int(self.lengths.numel())

    def labels(self) -> torch.Tensor:
        """The greedy tokens a head learns: those after the answer's first token, per sequence."""
        keep = torch.zeros(self.ids.numel(), dtype=torch.bool)
        for offset, length, start in zip(self.offsets.tolist(), self.lengths.tolist(), self.answer_starts.tolist()):
            keep[offset + start : offset + length] = True
        return self.greedy[keep]

    @staticmethod
    def join(parts: list[Split]) -> Split:
        parts = [p for p in parts if len(p)] or parts[:1]  # an empty split's states have no width
        return Split(*(torch.cat([getattr(p, name) for p in parts]) for name in
                       ("ids", "greedy", "states", "lengths", "answer_starts")))


def load_split(folder: Path, name: str) -> Split:
    """The cached sequences of ``name`` (none: an empty split)."""
    if not any(folder.glob(f"{name}_*.pt")):
        empty = torch.zeros(0, dtype=torch.int32)
        return Split(empty, empty, torch.zeros(0, 0, dtype=torch.bfloat16), torch.zeros(0, dtype=torch.long),
                     torch.zeros(0, dtype=torch.long))
    shards = read_shards(folder, name)
    return Split.join([Split(s["ids"], s["greedy"], s["states"], s["lengths"], s["answer_starts"]) for s in shards])


# ----------------------------------------------------------------------------------------------------------------
# batches


@dataclass
class Batch:
    """Sequences side by side. Rows are positions 0..n-2 of each (a row needs the next token), flat in ``mask``'s
    row-major order. Per row: ``states``; ``tokens`` [S, N] (the token each step reads: token i+j at step j);
    ``labels`` [S, N] (the target's greedy token after it, -1 past the end or before the answer); ``active``
    (rows that learn: from the answer's first prediction on)."""

    mask: torch.Tensor  # [B, L]
    states: torch.Tensor  # [N, k*H]
    positions: torch.Tensor  # [N]
    tokens: torch.Tensor  # [S, N]
    labels: torch.Tensor  # [S, N]
    active: torch.Tensor  # [N]


def make_batch(split: Split, members: list[int], steps: int) -> Batch:
    offsets, lengths, starts = split.offsets, split.lengths, split.answer_starts
    rows = [int(lengths[s]) - 1 for s in members]
    mask = torch.zeros(len(members), max(rows), dtype=torch.bool)
    states, positions, tokens, labels, active = [], [], [], [], []
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
                 torch.cat(active))


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


def unrolled_loss(head: EagleHead, embed_weight: torch.Tensor, batch: Batch, t2d: torch.Tensor, steps: int,
                  decay: float) -> tuple[torch.Tensor | None, list[float]]:
    outputs = unrolled_forward(head, embed_weight, batch, steps)
    outputs[0] = outputs[0][batch.active]
    total: torch.Tensor | None = None
    per_step = []
    for j, (output, labels) in enumerate(zip(outputs, step_labels(batch, t2d))):
        if not bool((labels >= 0).any()):
            per_step.append(float("nan"))
            continue
        loss = F.cross_entropy(head.logits(output).float(), labels, ignore_index=-100)
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


# ----------------------------------------------------------------------------------------------------------------
# the run


def _save_checkpoint(path: Path, state: dict) -> None:
    with atomic_path(path) as partial:
        torch.save(state, partial)


def _trainable_state(head: EagleHead) -> dict:
    return {name: tensor for name, tensor in head.state_dict().items() if name != "lm_head.weight"}


def pass_through_init(head: EagleHead) -> None:
    """Start the head as a copy of the target's top: the feature is the highest fused layer's state (the fc's
    last block the identity, the rest zero) and the decoder layer's attention and MLP add nothing yet (their
    output projections zero), so the first draft step scores what the target's LM head makes of that state."""
    size = head.config.hidden_size
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, -size:] = torch.eye(size)
        head.midlayer.self_attn.o_proj.weight.zero_()
        if head.midlayer.self_attn.o_proj.bias is not None:
            head.midlayer.self_attn.o_proj.bias.zero_()
        head.midlayer.mlp.down_proj.weight.zero_()


def train(settings: TrainSettings) -> dict:
    """The whole run: corpus, cache, draft vocabulary, training, held-out evaluation, head written to
    ``settings.out`` with ``training.json``."""
    from ..backends.loading import LoadSettings, clear_model_cache, load_model

    if settings.train_dtype not in TRAIN_DTYPES:  # checked before the target loads and the cache runs
        raise ValueError(f"--train-dtype {settings.train_dtype}: {' or '.join(TRAIN_DTYPES)}")
    if settings.init not in INITS:
        raise ValueError(f"--init {settings.init}: {' or '.join(INITS)}")
    if settings.init_from is not None and settings.init != "random":
        raise ValueError(f"--init {settings.init} and --init-from: a head starts one way")
    started = time.perf_counter()
    deadline = started + 60 * settings.time_budget_minutes if settings.time_budget_minutes else None
    spec = settings.corpus_spec()
    loaded = load_model(settings.target, LoadSettings(dtype=settings.dtype), progress=True)
    model = loaded.model
    facts = target_facts(loaded)
    layers = default_hidden_layers(facts.num_layers)
    lm_weight = output_weight(model)
    start_head = None
    if settings.init_from is not None:  # checked before any answer or cache is made
        start_head = load_head(settings.init_from, facts, lm_head_weight=lambda: lm_weight)
        if tuple(start_head.config.hidden_layers) != layers:
            raise ValueError(f"--init-from {settings.init_from}: the head reads layers "
                             f"{list(start_head.config.hidden_layers)}, this trainer caches {list(layers)}")
    folder = settings.cache_path()
    train_seqs, held_seqs = build_sequences(loaded.tokenizer, spec)
    logger.info("corpus: %d training and %d held-out sequences", len(train_seqs), len(held_seqs))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "corpus.json").write_text(json.dumps({"files": sorted({s["file"] for s in train_seqs}),
                                                    "held_out_files": sorted({s["file"] for s in held_seqs})},
                                                   indent=1))
    cache_started = time.perf_counter()
    cache_split(model, train_seqs, folder, "train", layers)
    cache_split(model, held_seqs, folder, "heldout", layers)
    cache_seconds = time.perf_counter() - cache_started
    answer_seconds = 0.0
    sets: list[AnswerSet] = []
    if settings.answers:
        sets.append(AnswerSet("answers", settings.answers_key(), settings.answers_path(), settings.answers_path(),
                              None, settings.answers))
    chat_needed = max(settings.chat_answers, settings.passage_answers)  # passage prompts quote chat answers
    if chat_needed:
        # the chat answers' file grows with larger sets; their shards belong to one count
        sets.append(AnswerSet("chat_answers", settings.chat_answers_key(), settings.chat_answers_path(),
                              settings.chat_answers_path() / f"shards-{settings.chat_answers}",
                              lambda: chat_prompts(chat_needed, settings.seed), settings.chat_answers))
    for answer_set in sets:
        seconds, cached = answer_set.prepare(loaded, spec, layers)
        answer_seconds, cache_seconds = answer_seconds + seconds, cache_seconds + cached
    if settings.passage_answers:
        chat_rows = sets[-1].rows[: settings.passage_answers]
        sets.append(AnswerSet("passage_answers", settings.passage_answers_key(), settings.passage_answers_path(),
                              settings.passage_answers_path() / f"shards-{settings.passage_answers}",
                              lambda: passage_prompts(chat_rows, settings.seed), settings.passage_answers))
        seconds, cached = sets[-1].prepare(loaded, spec, layers)
        answer_seconds, cache_seconds = answer_seconds + seconds, cache_seconds + cached
    sets = [answer_set for answer_set in sets if answer_set.count]  # the sets the head learns from

    fields = head_fields(model, settings.draft_vocab_size, settings.intermediate_size)
    embed_weight = model.get_input_embeddings().weight.detach()
    final_norm = getattr(model.get_decoder(), "norm", None) if hasattr(model, "get_decoder") else None
    norm_weight = final_norm.weight.detach().clone() if isinstance(getattr(final_norm, "weight", None),
                                                                    torch.Tensor) else None
    eos_ids = list(loaded.eos_token_ids)
    verifier = facts.names[-1] if facts.names else settings.target
    architectures = tuple(getattr(model.config, "architectures", None) or ())
    del loaded, model
    clear_model_cache()

    data, code_held = load_split(folder, "train"), load_split(folder, "heldout")
    code_positions = int(data.labels().numel())
    held_splits: dict[str, Split] = {}
    for answer_set in sets:
        answer_train_split = load_split(answer_set.shards, "train")
        held_splits[answer_set.name] = load_split(answer_set.shards, "heldout")
        answer_set.counts["training_positions"] = int(answer_train_split.labels().numel())
        answer_set.counts["held_out_positions"] = int(held_splits[answer_set.name].labels().numel())
        data = Split.join([data, answer_train_split])
        del answer_train_split
    labels = data.labels()
    if start_head is not None:  # its draft vocabulary and sizes, as trained before
        draft_ids = start_head.draft_ids.clone()
        config = start_head.config
    else:
        draft_ids = draft_vocabulary(labels, fields["draft_vocab_size"], fields["vocab_size"], eos_ids)
        fields["draft_vocab_size"] = int(draft_ids.numel())
        config = EagleConfig(**fields, verifier=verifier, verifier_architectures=architectures)
    inside = torch.zeros(fields["vocab_size"], dtype=torch.bool)
    inside[draft_ids] = True
    coverage = float(inside[labels.long()].float().mean()) if labels.numel() else 0.0
    t2d = torch.full((fields["vocab_size"],), -1, dtype=torch.long)
    t2d[draft_ids] = torch.arange(draft_ids.numel())

    torch.manual_seed(settings.seed)
    head = EagleHead(config)
    with torch.no_grad():
        head.draft_ids.copy_(draft_ids)  # a buffer outside the state dict
        if start_head is not None:
            head.load_state_dict(start_head.state_dict())
        else:
            head.lm_head.weight.copy_(lm_weight[draft_ids].float())
            if norm_weight is not None and norm_weight.shape == head.norm.weight.shape:
                head.norm.weight.copy_(norm_weight.float())
            if settings.init == "pass-through":
                pass_through_init(head)
    del start_head
    head.lm_head.weight.requires_grad_(False)  # the target's rows: shared, not stored
    trainable = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=settings.learning_rate, weight_decay=0.0)
    plans = [plan_batches(data, epoch_order(len(data), settings.seed, e), settings.batch_tokens)
             for e in range(settings.epochs)]
    total_steps = sum(len(p) for p in plans)
    warmup = min(settings.warmup_steps, max(1, total_steps // 10))

    def schedule(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total_steps - warmup))))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    key = settings.train_key(draft_ids, config)
    checkpoint = folder / f"checkpoint-eagle-{key}.pt"
    epoch, position, step, trained_before = 0, 0, 0, 0.0
    last_losses: list[float] = []
    per_epoch: list[dict] = []  # held-out top-1 per step on the target's answers after each epoch
    answer_splits = dict(reversed(held_splits.items()))  # the newest kind first, as the figures always were

    def epoch_figures(done: int) -> dict:
        rounded = copy.deepcopy(head).to(SHIP_DTYPE).float()  # the weights as they would be written
        return {"epoch": done, **{name: evaluate(rounded, embed_weight, split, settings.steps_unrolled,
                                                 settings.batch_tokens)["top1_per_step"]
                                  for name, split in answer_splits.items()}}
    if checkpoint.is_file():
        saved = torch.load(checkpoint, weights_only=True)
        if saved.get("key") == key:
            head.load_state_dict({**head.state_dict(), **saved["head"]})
            optimizer.load_state_dict(saved["optimizer"])
            scheduler.load_state_dict(saved["scheduler"])
            torch.set_rng_state(saved["rng"])
            epoch, position, step = int(saved["epoch"]), int(saved["position"]), int(saved["step"])
            trained_before, last_losses = float(saved["train_seconds"]), list(saved["losses"])
            per_epoch = list(saved.get("held_out_per_epoch", []))
            logger.info("resuming at epoch %d, batch %d (step %d) from %s", epoch + 1, position, step, checkpoint)

    train_started = time.perf_counter()
    saved_at = train_started
    stopped = False

    def save(epoch_now: int, position_now: int) -> None:
        _save_checkpoint(checkpoint, {
            "key": key, "epoch": epoch_now, "position": position_now, "step": step,
            "head": _trainable_state(head), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
            "rng": torch.get_rng_state(), "losses": last_losses, "held_out_per_epoch": per_epoch,
            "train_seconds": trained_before + time.perf_counter() - train_started,
        })

    autocast = settings.train_dtype == "bfloat16"
    head.train()
    with tqdm(total=total_steps, initial=step, desc="training the EAGLE head", unit="step") as bar:
        while epoch < settings.epochs and not stopped:
            batches = plans[epoch]
            while position < len(batches):
                batch = make_batch(data, batches[position], settings.steps_unrolled)
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    loss, per_step = unrolled_loss(head, embed_weight, batch, t2d, settings.steps_unrolled,
                                                   settings.loss_decay)
                if loss is not None:
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(trainable, settings.grad_clip)
                    optimizer.step()
                    last_losses = per_step
                scheduler.step()
                position += 1
                step += 1
                bar.update(1)
                bar.set_postfix(epoch=f"{epoch + 1}/{settings.epochs}",
                                loss=" ".join(f"{v:.2f}" for v in per_step))
                now = time.perf_counter()
                out_of_time = deadline is not None and now > deadline
                if (settings.stop_after_steps is not None and step >= settings.stop_after_steps) or out_of_time:
                    stopped = True
                    break
                if now - saved_at > CHECKPOINT_SECONDS and position < len(batches):
                    save(epoch, position)
                    saved_at = now
            if position >= len(batches):
                epoch, position = epoch + 1, 0
                if answer_splits and epoch < settings.epochs:  # the last epoch's figures are the final ones
                    per_epoch.append(epoch_figures(epoch))
                    head.train()
            save(epoch, position)
            saved_at = time.perf_counter()
    train_seconds = trained_before + time.perf_counter() - train_started

    eval_started = time.perf_counter()
    shipped = copy.deepcopy(head).to(SHIP_DTYPE).float()  # the weights as written
    held = {"standard_library": evaluate(shipped, embed_weight, code_held, settings.steps_unrolled,
                                         settings.batch_tokens)} if len(code_held) else {}
    for name, split in held_splits.items():
        held[name] = evaluate(shipped, embed_weight, split, settings.steps_unrolled, settings.batch_tokens)
    del shipped
    eval_seconds = time.perf_counter() - eval_started
    digest = save_head(head, settings.out, SHIP_DTYPE)
    weights = settings.out / "model.safetensors"
    if weights.stat().st_size > MAX_HEAD_BYTES:
        logger.warning("the head's weights take %.1f MB, more than the %.0f MB a shipped head may",
                       weights.stat().st_size / 1e6, MAX_HEAD_BYTES / 1e6)
    load_head(settings.out, facts, expected_sha256=digest, lm_head_weight=lambda: lm_weight)  # it loads as it ships
    report = {
        "command": "python -m specdemo.training.eagle " + " ".join(sys.argv[1:]),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(settings).items() if k != "extra"},
        "complete": not stopped,
        "steps": {"done": step, "planned": total_steps},
        "corpus": {
            "source": spec.description(),
            "training_sequences": len(train_seqs),
            "training_positions": code_positions,
            "held_out_sequences": len(held_seqs),
            "held_out_positions": int(code_held.labels().numel()),
            "training_files": len({s["file"] for s in train_seqs}),
            "held_out_files": len({s["file"] for s in held_seqs}),
        },
        **{name: next((a.counts for a in sets if a.name == name), None)
           for name in ("answers", "chat_answers", "passage_answers")},
        "head": {
            "hidden_layers": list(config.hidden_layers),
            "intermediate_size": config.intermediate_size,
            "draft_vocab_size": config.draft_vocab_size,
            "greedy_tokens_inside_draft_vocab": round(coverage, 4),
            "parameters": config.parameter_count(),
            "lm_head": "the target's rows at the draft ids (shared, not stored)",
            "dtype": str(SHIP_DTYPE).removeprefix("torch."),
            "weights_bytes": weights.stat().st_size,
        },
        "seconds": {"answers": round(answer_seconds, 1), "cache": round(cache_seconds, 1),
                    "train": round(train_seconds, 1), "evaluate": round(eval_seconds, 1),
                    "total": round(time.perf_counter() - started, 1)},
        "last_train_loss_per_step": [round(v, 4) for v in last_losses],
        "held_out": held,
        "held_out_per_epoch": per_epoch,
        "torch_threads": torch.get_num_threads(),
        "weights_sha256": digest,
    }
    report.update(settings.extra)
    (settings.out / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def main(argv: list[str] | None = None) -> int:
    defaults = TrainSettings()
    parser = argparse.ArgumentParser(prog="python -m specdemo.training.eagle", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder to write the head to")
    add_corpus_arguments(parser, defaults)
    parser.add_argument("--chat-answers", type=int, default=defaults.chat_answers,
                        help="chat prompts (advice, reasoning, writing, role play ...) the target answers too; a "
                             "larger set extends a smaller one's answers (0 = none)")
    parser.add_argument("--passage-answers", type=int, default=defaults.passage_answers,
                        help="prompts that quote the target's answers to the first N chat prompts and ask for a "
                             "summary, a translation, an answer from the passage or an extraction (0 = none)")
    parser.add_argument("--steps-unrolled", type=int, default=defaults.steps_unrolled,
                        help="draft steps of the training-time test")
    parser.add_argument("--draft-vocab-size", type=int, default=defaults.draft_vocab_size)
    parser.add_argument("--intermediate-size", type=int, default=defaults.intermediate_size,
                        help=f"the head's MLP width (0: the widest that keeps the weights under "
                             f"{MAX_HEAD_BYTES / 1e6:.0f} MB)")
    parser.add_argument("--init", default=defaults.init, choices=INITS,
                        help="pass-through: the head starts as the target's top layer's state read by its LM head")
    parser.add_argument("--init-from", type=Path, default=None,
                        help="a head folder to train further (its sizes and draft vocabulary kept)")
    parser.add_argument("--batch-tokens", type=int, default=defaults.batch_tokens,
                        help="tokens per optimizer step (whole sequences)")
    parser.add_argument("--train-dtype", default=defaults.train_dtype, choices=TRAIN_DTYPES,
                        help="the head's matmuls while training (bfloat16: autocast, float32 weights and optimizer)")
    parser.add_argument("--time-budget-minutes", type=float, default=None,
                        help="stop training once the run has taken this long (checkpointed: a rerun resumes)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    settings = TrainSettings(**vars(args))
    report = train(settings)
    print(json.dumps({k: report[k] for k in ("held_out", "seconds", "weights_sha256", "complete")}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
