"""Train Medusa heads for a target by self-distillation, on a CPU: ``python -m specdemo.training.medusa``.

1. Corpus: source files of the Python standard library of the running interpreter (code, docstrings and, in
   ``pydoc_data``, the language reference's prose), which every machine with Python has offline. Each sequence is
   one chat turn: a user asks for a part of a module, the assistant's answer is that part of the file. Files are
   split into training and held-out sets by a hash of their path. The benchmark prompt files are never read.
   With ``--answers N`` the target also answers N chat prompts built offline (:mod:`specdemo.training.corpus`:
   explanations, code writing and editing, summaries, translations, arithmetic, short writing) greedily, in
   batches, and its own answers join the corpus (self-distillation proper; one prompt in ``held_out_every`` is held
   out). Answers are written to disk batch by batch, so a restart carries on. Corpus, answers and the shard
   cache are :mod:`specdemo.training.common`'s, shared with the EAGLE trainer.
2. Cache: the frozen target runs once over every sequence with teacher forcing; its final (post-norm) hidden state
   and its own greedy next token at every position of the answer are stored on disk in shards (a restart resumes
   where the cache stopped).
3. Train: head k learns to predict the target's greedy token k positions after the one its own LM head predicts,
   from the same hidden state, with loss weights ``decay ** k``. Only the residual blocks train; the target's LM
   head is frozen and shared, scored over its lowest ``head_tokens`` ids. A checkpoint every few minutes and after
   each epoch makes a stopped run restartable; ``--time-budget-minutes`` stops a run cleanly (in the pool's state
   fill or in training) and the same command goes on.
4. Evaluate each head's top-1 accuracy on the held-out files and write the heads (bfloat16) with their provenance.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
from tqdm import tqdm

from ..backends.eagle3_checkpoint import target_facts
from ..backends.eagle3_head import default_hidden_layers
from ..backends.medusa_checkpoint import load_heads, weights_file
from ..backends.medusa_heads import MedusaConfig, MedusaHeads
from ..backends.packed_bf16 import pack_bf16_linears
from .common import (
    ANSWERS_FILE,
    CACHE_HOME,
    CHECKPOINT_SECONDS,
    CorpusSettings,
    add_corpus_arguments,
    answer_sequences,
    cache_splits,
    check_loss_target,
    code_corpus,
    distribution_cross_entropy,
    generate_answers,
    lineage,
    read_checkpoint,
    read_shards,
    run_record,
    save_checkpoint,
    weights_digest,
    write_shards,
    write_training_json,
)
from .pool import answers_name, pool_answer_rows
from .pool_states import (
    Deadline,
    add_time_budget_argument,
    fill_within,
    final_states,
    pool_states_folder,
    train_and_print,
)
from .prompt_pool import POOL_FOLDER

logger = logging.getLogger(__name__)

CACHE_ROOT = CACHE_HOME / "medusa-train"


@dataclass
class TrainSettings(CorpusSettings):
    cache_root = CACHE_ROOT  # where corpus_key() folders live (a class attribute, not a setting)

    target: str = "offline:qwen2.5-coder-1.5b"
    out: Path = Path("medusa-heads")
    num_heads: int = 3
    head_tokens: int = 16384
    sequences: int = 320
    sequence_tokens: int = 512
    held_out_every: int = 10  # one file in this many (by path hash) is held out
    held_out_sequences: int = 32
    epochs: int = 2
    batch_size: int = 256
    learning_rate: float = 1e-3
    loss_decay: float = 0.8
    loss_target: str = "greedy"  # one of LOSS_TARGETS
    seed: int = 0
    dtype: str = "bfloat16"
    cache_dir: Path | None = None
    answers: int = 0  # prompts the target answers itself (self-distillation proper); 0 = code corpus only
    answer_tokens: int = 256
    generation_batch: int = 32
    #: instead of --answers: the target's stored answers to the prompt pool's first N prompts, from ``pool_folder``
    pool_answers: int = 0
    #: instead: the stored answers to part "K/P" of the whole pool (:func:`.pool.part_indexes`)
    pool_part: str = ""
    pool_folder: Path = POOL_FOLDER
    #: heads to train further instead of new ones (their number and scored subset must be these settings')
    init_from: Path | None = None
    #: stop once the run has taken this long, in the pool's state fill or in training (None or 0: no budget)
    time_budget_minutes: float | None = None
    extra: dict = field(default_factory=dict)

    def answer_rows(self, loaded, spec) -> list[dict]:
        """The answers the heads learn from: the pool's stored ones, else generated (or reused) for --answers."""
        if self.uses_pool():
            return pool_answer_rows(self.target, self.dtype, self.answer_tokens, self.pool_answers, self.pool_folder,
                                    self.pool_part)
        return generate_answers(loaded, spec, self.answers_path() / ANSWERS_FILE)

    def corpus_key(self) -> str:
        keyed = [self.target, self.dtype, self.sequences, self.sequence_tokens, self.held_out_every,
                 self.held_out_sequences, self.seed, sys.version.split()[0]]
        return hashlib.sha256(json.dumps(keyed).encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------------------------------------------
# cache of the target's hidden states and greedy tokens


def labels_for(greedy: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[num_heads, n] targets, row k - 1 for head k (1-based): at position t it learns greedy[t + k], the target's
    own greedy token k places after the one position t predicts; -1 past the sequence's end."""
    n = greedy.shape[0]
    labels = torch.full((num_heads, n), -1, dtype=torch.long)
    for k in range(1, num_heads + 1):
        if k < n:
            labels[k - 1, : n - k] = greedy[k:]
    return labels


def cache_split(model, sequences: list[dict], folder: Path, name: str, max_heads: int) -> None:
    """Run the target over ``sequences`` and store hidden states and labels in shards (existing shards kept)."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    head = model.get_output_embeddings()
    device = next(model.parameters()).device

    def per_sequence(sequence: dict) -> dict:
        ids = torch.tensor([sequence["ids"]], device=device)
        hidden = base(input_ids=ids).last_hidden_state[0]
        start = sequence["answer_start"] - 1  # this position predicts the answer's first token
        hidden = hidden[start:]
        greedy = head(hidden).argmax(-1).cpu()
        # one head more than trained: room to grow
        return {"hidden": hidden.to(torch.bfloat16).cpu(), "labels": labels_for(greedy, max_heads + 1)}

    def combine(rows: list[dict]) -> dict:
        return {"hidden": torch.cat([r["hidden"] for r in rows]), "labels": torch.cat([r["labels"] for r in rows], dim=1)}

    write_shards(sequences, folder, name, per_sequence, combine, f"caching target states ({name})")


def load_split(folder: Path, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The hidden states [P, H] and labels [K + 1, P] of a split of this trainer's own shards."""
    parts = read_shards(folder, name)
    return torch.cat([p["hidden"] for p in parts]), torch.cat([p["labels"] for p in parts], dim=1)


@dataclass
class AnswerStates:
    """Where the answers' states are: this trainer's own shards in ``folder`` or, for the pool's answers, the
    files shared with the EAGLE trainer (:mod:`.pool_states`), read for the ``sequences`` of each split."""

    folder: Path
    sequences: dict[str, list[dict]] | None = None

    def load(self, name: str, max_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states [P, H] and labels [max_heads + 1, P] of the ``train`` or ``heldout`` split."""
        if self.sequences is None:
            return load_split(self.folder, name)
        hidden, greedy_per_sequence = final_states(self.folder, self.sequences[name])
        return hidden, torch.cat([labels_for(greedy, max_heads + 1) for greedy in greedy_per_sequence], dim=1)


# ----------------------------------------------------------------------------------------------------------------
# training


def _sub_labels(labels: torch.Tensor, head_tokens: int) -> torch.Tensor:
    """Greedy tokens the restricted head can score keep their id; the rest (and -1) become ignore_index."""
    out = labels.clone()
    if head_tokens:
        out[out >= head_tokens] = -100
    out[out < 0] = -100
    return out


def head_loss(
    heads: MedusaHeads, hidden: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor, decay: float,
    targets: torch.Tensor | None = None,
) -> tuple[torch.Tensor, list[float]]:
    """Weighted cross-entropy over heads; labels [K, B] in sub-vocabulary ids (-100 = ignore). Against the greedy
    tokens, or with ``targets`` [K, B, H] (the target's final hidden state where it wrote each label) against the
    target's distribution over the scored tokens there, on the same positions."""
    logits = heads.features(hidden) @ weight.T  # [K, B, V']
    total = torch.zeros((), dtype=torch.float32)
    per_head = []
    for k in range(logits.shape[0]):
        keep = labels[k] >= 0
        if bool(keep.any()) and targets is not None:
            loss = distribution_cross_entropy(logits[k][keep], targets[k][keep] @ weight.T)
        elif bool(keep.any()):
            loss = torch.nn.functional.cross_entropy(logits[k].float(), labels[k], ignore_index=-100)
        else:
            loss = torch.zeros((), dtype=torch.float32)
        total = total + (decay ** (k + 1)) * loss
        per_head.append(float(loss.detach()))
    return total, per_head


@torch.inference_mode()
def evaluate(heads: MedusaHeads, hidden: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor,
             batch_size: int = 1024) -> list[float]:
    """Top-1 accuracy per head against the target's greedy token, over every valid position (tokens outside the
    scored subset count as misses)."""
    correct = torch.zeros(heads.config.num_heads)
    total = torch.zeros(heads.config.num_heads)
    for start in range(0, hidden.shape[0], batch_size):
        h = hidden[start : start + batch_size].float()
        predicted = (heads.features(h) @ weight.T).argmax(-1)  # [K, b]
        for k in range(heads.config.num_heads):
            target = labels[k, start : start + batch_size]  # row k: head k + 1's target
            valid = target >= 0
            correct[k] += float((predicted[k][valid] == target[valid]).sum())
            total[k] += float(valid.sum())
    return [round(float(c / t), 4) if t > 0 else 0.0 for c, t in zip(correct, total)]


@dataclass
class Corpus:
    """The corpus as cached: the standard-library sequences, the answers' figures (empty: no answers), the target's
    LM head rows the heads score (``weight``, float32), its hidden size and vocabulary, and the seconds spent
    answering and caching."""

    train_seqs: list[dict]
    held_seqs: list[dict]
    answer_counts: dict
    answer_states: AnswerStates | None
    weight: torch.Tensor
    hidden_size: int
    vocab_size: int
    answer_seconds: float
    cache_seconds: float


def cache_corpus(settings: TrainSettings, deadline: Deadline | None = None) -> Corpus:
    """Load the target, cache its hidden states and greedy tokens over the standard-library sequences and, with
    ``--answers``, over its own answers (generated first), keep the LM head rows the heads score and release it.
    The pool's states are filled within ``deadline``: :class:`~.pool_states.FillStopped` when it ends first."""
    from ..backends.loading import LoadSettings, clear_model_cache, load_model

    loaded = load_model(settings.target, LoadSettings(dtype=settings.dtype), progress=True)
    head_weight = loaded.model.get_output_embeddings().weight.detach()
    pack_bf16_linears(loaded.model)  # its CPU bfloat16 layers: the passes that answer and cache, about 1.1x faster
    spec = settings.corpus_spec()
    cache = partial(cache_split, loaded.model, max_heads=settings.num_heads)
    train_seqs, held_seqs, cache_seconds = code_corpus(loaded.tokenizer, spec, settings.cache_path(), cache)
    answer_seconds = 0.0
    answer_counts: dict = {}
    answer_states = None
    if settings.answers or settings.uses_pool():
        answer_started = time.perf_counter()
        answers = settings.answer_rows(loaded, spec)
        answer_seconds = time.perf_counter() - answer_started
        answer_train, answer_held = answer_sequences(loaded.tokenizer, answers, spec)
        if settings.uses_pool():  # the states shared with the EAGLE trainer, mostly recorded while answering
            layers = default_hidden_layers(target_facts(loaded).num_layers)
            answer_states = AnswerStates(pool_states_folder(answers_name(settings.target, settings.dtype,
                                                                         settings.answer_tokens), layers),
                                         {"train": answer_train, "heldout": answer_held})
            cache_seconds += fill_within(loaded.model, answer_train + answer_held, answer_states.folder, layers,
                                         deadline).seconds
        else:
            answer_states = AnswerStates(settings.answers_path())
            cache_seconds += cache_splits(cache, answer_train, answer_held, answer_states.folder)
        answer_counts = {"training_sequences": len(answer_train), "held_out_sequences": len(answer_held),
                         "prompts_per_kind": dict(Counter(row["kind"] for row in answers)),
                         "mean_answer_tokens": round(sum(len(r["answer_ids"]) for r in answers) / max(1, len(answers)),
                                                     1)}
    weight = head_weight[: settings.head_tokens] if settings.head_tokens else head_weight
    corpus = Corpus(train_seqs, held_seqs, answer_counts, answer_states, weight.float().contiguous(),
                    head_weight.shape[1], head_weight.shape[0], answer_seconds, cache_seconds)
    del loaded, head_weight, weight, cache
    clear_model_cache()
    return corpus


@dataclass
class States:
    """The cached states training reads: hidden states [P, H] and labels [K + 1, P] (row k - 1: head k's target)
    of every training position, the standard library's then the answers'; the held-out (hidden, labels) of the
    standard library and of the answers (None: no answers); the standard library's training positions."""

    hidden: torch.Tensor
    labels: torch.Tensor
    held: tuple[torch.Tensor, torch.Tensor]
    answers_held: tuple[torch.Tensor, torch.Tensor] | None
    code_positions: int


def load_states(settings: TrainSettings, corpus: Corpus) -> States:
    """The cached states of the corpus and, with ``--answers`` or ``--pool-answers``, of the answers (their
    positions counted in ``corpus.answer_counts``)."""
    answer_counts = corpus.answer_counts
    folder = settings.cache_path()
    if not corpus.train_seqs and corpus.answer_states is None:
        raise ValueError("no text to learn from: --sequences 0 needs answers (--answers, --pool-answers, --pool-part)")
    # with --sequences 0 the answers alone (no library shards to read)
    hidden, labels = load_split(folder, "train") if corpus.train_seqs else (None, None)
    held = load_split(folder, "heldout")
    code_positions = int(hidden.shape[0]) if hidden is not None else 0
    answers_held = None
    if corpus.answer_states is not None:
        answers = partial(corpus.answer_states.load, max_heads=settings.num_heads)
        answer_hidden, answer_labels = answers("train")
        if hidden is None:
            hidden, labels = answer_hidden, answer_labels
        else:
            hidden, labels = torch.cat([hidden, answer_hidden]), torch.cat([labels, answer_labels], dim=1)
        answers_held = answers("heldout")
        answer_counts["training_positions"] = int(answer_hidden.shape[0])
        answer_counts["held_out_positions"] = int(answers_held[0].shape[0])
        del answer_hidden, answer_labels
    return States(hidden, labels, held, answers_held, code_positions)


@dataclass
class HeadsRun:
    """The heads in training and what trains them: the LM head rows they score (``weight``), their training labels
    (row k - 1: head k's, -100 where the scored subset cannot score it), ``coverage`` (the share of labels it can),
    the optimizer and schedule, the checkpoint and the epoch to start from; once trained, the last losses per head
    and the seconds trained (over every run of these settings); ``stopped``: the time budget ended training
    early."""

    heads: MedusaHeads
    weight: torch.Tensor
    train_labels: torch.Tensor
    coverage: float
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    steps_per_epoch: int
    checkpoint: Path
    first_epoch: int = 0
    #: optimizer steps of ``first_epoch`` a stopped run already took
    first_position: int = 0
    #: the held-out figures of ``--init-from``'s heads (None: new heads)
    at_start: dict | None = None
    last_losses: list[float] = field(default_factory=list)
    train_seconds: float = 0.0
    stopped: bool = False


def prepare_heads(settings: TrainSettings, corpus: Corpus, states: States) -> HeadsRun:
    """New heads, AdamW with a short warm-up then linear decay, resumed from the checkpoint of these settings."""
    head_labels = states.labels[: settings.num_heads]  # row k - 1: head k's target
    valid = head_labels >= 0
    coverage = float((head_labels[valid] < settings.head_tokens).float().mean()) if settings.head_tokens else 1.0
    config = MedusaConfig(
        num_heads=settings.num_heads, num_layers=1, hidden_size=corpus.hidden_size, vocab_size=corpus.vocab_size,
        head_tokens=settings.head_tokens, base_model=settings.target,
    )
    heads = start_heads(settings, config)
    at_start = held_out_figures(heads, states, corpus.weight) if settings.init_from is not None else None
    optimizer = torch.optim.AdamW(heads.parameters(), lr=settings.learning_rate, weight_decay=0.0)
    steps_per_epoch = math.ceil(states.hidden.shape[0] / settings.batch_size)
    total_steps = steps_per_epoch * settings.epochs
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / 50) * max(0.0, 1.0 - step / total_steps)
    )
    checkpoint = settings.cache_path() / f"checkpoint-{settings.num_heads}h-{settings.head_tokens}.pt"
    run = HeadsRun(heads, corpus.weight, _sub_labels(head_labels, settings.head_tokens), coverage, optimizer,
                   scheduler, steps_per_epoch, checkpoint, at_start=at_start)
    saved = read_checkpoint(run.checkpoint, "settings", _train_key(settings))
    if saved is not None:
        heads.load_state_dict(saved["heads"])
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        run.first_epoch, run.first_position = int(saved["epoch"]), int(saved.get("position", 0))
        run.train_seconds = float(saved.get("train_seconds", 0.0))
        logger.info("resuming at epoch %d, step %d from %s", run.first_epoch + 1, run.first_position, run.checkpoint)
    return run


def start_heads(settings: TrainSettings, config: MedusaConfig) -> MedusaHeads:
    """New heads of ``config``, or ``--init-from``'s to train further (refused in one line when their number or
    scored subset differ from these settings')."""
    if settings.init_from is None:
        return MedusaHeads(config)
    heads = load_heads(settings.init_from, config.hidden_size, config.vocab_size)
    if (heads.config.num_heads, heads.config.head_tokens) != (config.num_heads, config.head_tokens):
        raise ValueError(f"--init-from {settings.init_from}: {heads.config.num_heads} heads scoring "
                         f"{heads.config.head_tokens} tokens, these settings train {config.num_heads} scoring "
                         f"{config.head_tokens} (--heads, --head-tokens)")
    return heads.train().requires_grad_(True)


def held_out_figures(heads: MedusaHeads, states: States, weight: torch.Tensor) -> dict:
    """Each head's held-out top-1 on the library text and, when the corpus has answers, on them."""
    heads.eval()
    figures = {"standard_library": evaluate(heads, *states.held, weight)}
    if states.answers_held is not None:
        figures["answers"] = evaluate(heads, *states.answers_held, weight)
    return figures


def train_epochs(settings: TrainSettings, run: HeadsRun, states: States, deadline: Deadline | None = None) -> None:
    """Train from where the checkpoint left off over shuffled batches (the shuffles of an uninterrupted run) through
    every epoch or until ``deadline``: a checkpoint every :data:`~.common.CHECKPOINT_SECONDS`, after each epoch and
    when the budget ends."""
    train_started = time.perf_counter()
    trained_before, saved_at = run.train_seconds, train_started
    hidden, heads = states.hidden, run.heads
    generator = torch.Generator().manual_seed(settings.seed)
    for _ in range(run.first_epoch):  # the same shuffles as an uninterrupted run
        torch.randperm(hidden.shape[0], generator=generator)

    def save(epoch: int, position: int) -> None:
        run.train_seconds = trained_before + time.perf_counter() - train_started
        save_checkpoint(run.checkpoint, {"settings": _train_key(settings), "epoch": epoch, "position": position,
                                         "heads": heads.state_dict(), "optimizer": run.optimizer.state_dict(),
                                         "scheduler": run.scheduler.state_dict(), "train_seconds": run.train_seconds})

    first_position = run.first_position
    for epoch in range(run.first_epoch, settings.epochs):
        order = torch.randperm(hidden.shape[0], generator=generator)
        heads.train()
        steps = range(first_position, run.steps_per_epoch)
        with tqdm(steps, desc=f"training heads, epoch {epoch + 1}/{settings.epochs}", unit="step",
                  initial=first_position, total=run.steps_per_epoch) as bar:
            for step in bar:
                train_step(settings, run, hidden, order[step * settings.batch_size : (step + 1) * settings.batch_size])
                if step % 20 == 0 and run.last_losses:
                    bar.set_postfix(loss=" ".join(f"{v:.2f}" for v in run.last_losses))
                if deadline is not None and deadline.passed and step + 1 < run.steps_per_epoch:
                    run.stopped = True
                    save(epoch, step + 1)
                    return
                if time.perf_counter() - saved_at > CHECKPOINT_SECONDS:
                    save(epoch, step + 1)
                    saved_at = time.perf_counter()
        first_position = 0
        save(epoch + 1, 0)
        saved_at = time.perf_counter()
        if deadline is not None and deadline.passed and epoch + 1 < settings.epochs:
            run.stopped = True
            return


def train_step(settings: TrainSettings, run: HeadsRun, hidden: torch.Tensor, index: torch.Tensor) -> None:
    """One optimizer step over the positions ``index`` (none when no position has a target the heads can score)."""
    labels = run.train_labels[:, index]
    targets = None
    if settings.loss_target == "distribution":  # head k's label at t was written at t + k, in the same sequence
        ahead = torch.arange(1, labels.shape[0] + 1)[:, None]
        targets = hidden[(index[None, :] + ahead).clamp(max=hidden.shape[0] - 1)].float()
    loss, per_head = head_loss(run.heads, hidden[index].float(), labels, run.weight, settings.loss_decay, targets)
    if not loss.requires_grad:
        return
    run.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    run.optimizer.step()
    run.scheduler.step()
    run.last_losses = per_head


def ship(settings: TrainSettings, corpus: Corpus, states: States, run: HeadsRun, started: float) -> dict:
    """Each head's held-out top-1, the heads written (bfloat16) with their provenance and ``training.json``; the
    report."""
    figures = held_out_figures(run.heads, states, run.weight)
    accuracy = figures["standard_library"]
    if "answers" in figures:
        corpus.answer_counts["held_out_top1_per_head"] = figures["answers"]
    report = {
        **run_record("specdemo.training.medusa", settings),
        "corpus": {
            "source": settings.corpus_spec().description(),
            "training_sequences": len(corpus.train_seqs),
            "training_positions": states.code_positions,
            "held_out_sequences": len(corpus.held_seqs),
            "held_out_positions": int(states.held[0].shape[0]),
            "greedy_tokens_inside_head_subset": round(run.coverage, 4),
        },
        "answers": corpus.answer_counts or None,
        "seconds": {"cache": round(corpus.cache_seconds, 1), "answers": round(corpus.answer_seconds, 1),
                    "train": round(run.train_seconds, 1),
                    "total": round(time.perf_counter() - started, 1)},
        "last_train_loss_per_head": [round(v, 4) for v in run.last_losses],
        "held_out_top1_per_head": accuracy,  # on the held-out standard-library files (answers: under "answers")
        "complete": not run.stopped,  # False: the time budget ended training early (the same command goes on)
        **({"held_out_at_start": run.at_start} if run.at_start else {}),
        "torch_threads": torch.get_num_threads(),
    }
    report.update(settings.extra)
    digest = run.heads.save(settings.out, torch.bfloat16, extra={"training": report})
    report["weights_sha256"] = digest
    report["lineage"] = lineage(settings.init_from, report)
    write_training_json(settings.out, report)
    return report


def train(settings: TrainSettings) -> dict:
    """The whole run: corpus, cache, training, held-out accuracy, heads written to ``settings.out``."""
    if settings.answers and settings.uses_pool():
        raise ValueError("--answers and --pool-answers or --pool-part: the Medusa trainer learns from one set of "
                         "answers, choose one")
    if settings.uses_pool():
        settings.pool_selection()  # one of --pool-answers and --pool-part
    check_loss_target(settings.loss_target)
    settings.claim_cache_dir()
    started = time.perf_counter()
    deadline = Deadline(settings.time_budget_minutes or None)
    torch.manual_seed(settings.seed)
    corpus = cache_corpus(settings, deadline)
    states = load_states(settings, corpus)
    run = prepare_heads(settings, corpus, states)
    train_epochs(settings, run, states, deadline)
    return ship(settings, corpus, states, run, started)


def _train_key(settings: TrainSettings) -> list:
    pool = [answers_name(settings.target, settings.dtype, settings.answer_tokens), *settings.pool_selection()] \
        if settings.uses_pool() else []
    start = [weights_digest(weights_file(Path(settings.init_from)), settings.init_from)] \
        if settings.init_from is not None else []  # absent: earlier keys hold
    label = [settings.loss_target] if settings.loss_target != "greedy" else []  # absent: earlier keys hold
    return [settings.corpus_key(), settings.answers_key() if settings.answers else None, *pool, *start,
            settings.num_heads, settings.head_tokens, settings.epochs, settings.batch_size, settings.learning_rate,
            settings.loss_decay, *label]


def main(argv: list[str] | None = None) -> int:
    defaults = TrainSettings()
    parser = argparse.ArgumentParser(prog="python -m specdemo.training.medusa", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder to write the heads to")
    add_corpus_arguments(parser, defaults)
    parser.add_argument("--heads", type=int, default=defaults.num_heads, dest="num_heads")
    parser.add_argument("--head-tokens", type=int, default=defaults.head_tokens)
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size)
    parser.add_argument("--init-from", type=Path, default=None,
                        help="a heads folder to train further (its number of heads and scored subset kept)")
    add_time_budget_argument(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    return train_and_print(train, TrainSettings(**vars(args)),
                           ("held_out_top1_per_head", "seconds", "weights_sha256", "complete"))


if __name__ == "__main__":
    raise SystemExit(main())
