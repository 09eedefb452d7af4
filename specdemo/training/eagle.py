"""Train an EAGLE-3 head for a target by self-distillation, on a CPU: ``python -m specdemo.training.eagle``.

1. Corpus: the Medusa trainer's (:mod:`specdemo.training.common`): stretches of the Python standard library's
   sources as chat turns, files split into training and held-out sets by a hash of their path, and with
   ``--answers N`` the target's own greedy answers to N offline prompts (one in ``held_out_every`` held out; the
   Medusa trainer's cached answers to the same prompts are reused). The benchmark prompt files are never read.
2. Cache (:mod:`specdemo.training.eagle_cache`): the frozen target runs once over every sequence with teacher
   forcing; at every position the states of the three layers the head reads (bfloat16) and the target's greedy
   next token are stored with the token ids, in shards (a restart resumes where the cache stopped). The prompt's
   positions are stored too: at inference the head attends to them.
3. Draft vocabulary: the ``draft_vocab_size`` most frequent greedy target tokens of the training answers, plus
   the EOS ids. The head's LM head is the target's own rows at those ids, frozen and not stored
   (``shared_lm_head``); its final norm starts as the target's. A head trained further (``--init-from``) keeps
   its start's, unless ``--new-draft-vocab`` chooses one anew from this run's answers (the weights kept: the LM
   head reads other rows of the target's).
4. Train with EAGLE-3's training-time test (:mod:`specdemo.training.eagle_unrolled`), ``steps_unrolled`` steps
   deep. Row i of a sequence is the draft root the drafter has after committing position i: step 1 reads fc(target
   states at i) and the embedding of token i+1 at position i, as the drafter's catch-up does; step j > 1 reads the
   head's own output of step j - 1 at row i and the embedding of token i+j, at position i+j-1, and attends to the
   step-1 keys of positions 0..i and the keys of its own earlier steps at row i only, exactly the cache the drafter
   has when it drafts (the dot-product form of EAGLE-3's reference code, with the drafter's positions). Step j
   learns the target's greedy token after token i+j (cross-entropy over the draft vocabulary, tokens outside it
   masked, weight ``loss_decay ** (j - 1)``), gradients flowing through all steps. AdamW, warm-up then cosine
   decay, gradient clipping, seeded, matmuls in bfloat16 under autocast (``--train-dtype``; float32 weights and
   optimizer state); a checkpoint (head, optimizer, schedule, step, RNG state) every few minutes and after each
   epoch, so a stopped run resumes exactly.
5. Evaluate the weights as written (rounded to bfloat16) on the held-out sequences: top-1 accuracy per step (the
   head feeding itself its outputs, tokens as in training) and the mean accepted drafts of greedy chains of
   k = 1..S drafts (a chain stops at the first draft that differs from the target's greedy token, or from the text,
   after which the target's token is not known). Write the head (bfloat16,
   :func:`~specdemo.backends.eagle3_checkpoint.save_head`) and ``training.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from ..backends.eagle3_checkpoint import (
    TargetFacts,
    load_head,
    save_head,
    target_facts,
    weights_file,
)
from ..backends.eagle3_head import EagleConfig, EagleHead, default_hidden_layers
from ..backends.formats import output_weight
from ..backends.packed_bf16 import pack_bf16_linears
from .common import (
    ANSWER_SETS,
    CACHE_HOME,
    CHECKPOINT_SECONDS,
    CorpusSettings,
    CorpusSpec,
    add_corpus_arguments,
    check_loss_target,
    code_corpus,
    lineage,
    read_checkpoint,
    run_record,
    save_checkpoint,
    weights_digest,
    write_training_json,
)
from .corpus import chat_prompts, passage_prompts
from .eagle_cache import AnswerSet, cache_split
from .eagle_shape import (
    MAX_HEAD_BYTES,
    as_shipped,
    draft_vocabulary,
    head_fields,
    pass_through_init,
    ship_dtype,
)
from .pool import answers_name, pool_answer_rows
from .pool_states import Deadline, add_time_budget_argument, pool_states_folder, train_and_print
from .prompt_pool import POOL_FOLDER
from .eagle_unrolled import (
    Batch,
    Split,
    epoch_order,
    evaluate,
    load_split,
    make_batch,
    plan_batches,
    unrolled_loss,
)

if TYPE_CHECKING:
    from ..backends.loading import LoadedModel

logger = logging.getLogger(__name__)

CACHE_ROOT = CACHE_HOME / "eagle-train"
#: bumped when what a shard holds changes
CACHE_FORMAT = 1


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
    #: the target's stored answers to the prompt pool's first N prompts (``python -m specdemo.training.pool``),
    #: read from ``pool_folder``
    pool_answers: int = 0
    #: instead: the stored answers to part "K/P" of the whole pool (:func:`.pool.part_indexes`)
    pool_part: str = ""
    pool_folder: Path = POOL_FOLDER
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
    loss_target: str = "greedy"  # one of LOSS_TARGETS; "distribution" reads the pool cache's final states
    grad_clip: float = 0.5
    warmup_steps: int = 10
    #: "pass-through": the feature starts as the highest layer's state and the layer's two residual branches at
    #: zero, so the untrained head already reads the target's LM head input space; "random": PyTorch's init
    init: str = "random"
    #: a head to start from instead (its sizes and draft vocabulary kept, its MLP grown to a larger
    #: ``intermediate_size``): training it further on more text
    init_from: Path | None = None
    #: with ``init_from``: the draft vocabulary chosen anew (``draft_vocab_size`` ids) from this run's training
    #: answers, the start's weights kept (its LM head is the target's rows, so only which rows it reads changes)
    new_draft_vocab: bool = False
    time_budget_minutes: float | None = None
    cache_dir: Path | None = None
    #: stop (checkpointed, as a spent time budget does) after this many optimizer steps in all; for tests
    stop_after_steps: int | None = None
    extra: dict = field(default_factory=dict)

    def corpus_key(self) -> str:
        keyed = [CACHE_FORMAT, self.target, self.dtype, self.sequences, self.sequence_tokens, self.held_out_every,
                 self.held_out_sequences, self.seed, sys.version.split()[0]]
        return hashlib.sha256(json.dumps(keyed).encode()).hexdigest()[:16]

    def pool_answers_name(self) -> str:
        return answers_name(self.target, self.dtype, self.answer_tokens)

    def train_key(self, draft_ids: torch.Tensor, config: EagleConfig) -> str:
        init = [self.init] if self.init != "random" else []  # absent for random: earlier checkpoints still resume
        init += [self.loss_target] if self.loss_target != "greedy" else []  # absent for greedy: the same
        chat = [self.chat_answers_key(), self.chat_answers] if self.chat_answers else []  # absent: earlier keys hold
        passage = [self.passage_answers_key(), self.passage_answers] if self.passage_answers else []
        pool = [self.pool_answers_name(), *self.pool_selection()] if self.uses_pool() else []
        start = [weights_digest(weights_file(Path(self.init_from)), self.init_from)] \
            if self.init_from is not None else []
        keyed = [self.corpus_key(), self.answers_key() if self.answers else None, *chat, *passage, *pool, *start, self.epochs,
                 self.steps_unrolled, self.learning_rate, self.batch_tokens, self.train_dtype, self.loss_decay,
                 self.grad_clip, self.warmup_steps, *init, hashlib.sha256(draft_ids.numpy().tobytes()).hexdigest(), asdict(config)]
        return hashlib.sha256(json.dumps(keyed, default=str).encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------------------------------------------
# the run


def _trainable_state(head: EagleHead) -> dict:
    return {name: tensor for name, tensor in head.state_dict().items() if name != "lm_head.weight"}


def check_choices(settings: TrainSettings) -> None:
    """Refuse ``--train-dtype``, ``--init`` and ``--init-from`` values that cannot run (before the target loads
    and the cache runs)."""
    if settings.train_dtype not in TRAIN_DTYPES:
        raise ValueError(f"--train-dtype {settings.train_dtype}: {' or '.join(TRAIN_DTYPES)}")
    if settings.init not in INITS:
        raise ValueError(f"--init {settings.init}: {' or '.join(INITS)}")
    check_loss_target(settings.loss_target)
    not_pool = settings.sequences or settings.answers or settings.chat_answers or settings.passage_answers
    if settings.loss_target == "distribution" and (not_pool or not settings.uses_pool()):
        raise ValueError("--loss-target distribution: only the prompt pool's answers store the target's final "
                         "states (--pool-answers or --pool-part, with --sequences 0 --answers 0)")
    if settings.init_from is not None and settings.init != "random":
        raise ValueError(f"--init {settings.init} and --init-from: a head starts one way")
    if settings.intermediate_size < 0:
        raise ValueError(f"--intermediate-size {settings.intermediate_size}: a width, or 0")
    if settings.new_draft_vocab and settings.init_from is None:
        raise ValueError("--new-draft-vocab needs --init-from (a new head always chooses its draft vocabulary)")
    if settings.uses_pool():
        settings.pool_selection()  # one of --pool-answers and --pool-part


@dataclass
class TargetParts:
    """What the run keeps of the target once it is released: its ``facts``, the ``layers`` the head reads, the
    head's ``fields`` (:func:`head_fields`), its LM head, input embeddings and final norm (None: none), its EOS
    ids, the verifier's name and classes for the head's config, and ``start_head`` (``--init-from``)."""

    facts: TargetFacts
    layers: tuple[int, ...]
    fields: dict
    lm_weight: torch.Tensor
    embed_weight: torch.Tensor
    norm_weight: torch.Tensor | None
    eos_ids: list[int]
    verifier: str
    architectures: tuple[str, ...]
    start_head: EagleHead | None


def target_parts(settings: TrainSettings, loaded: LoadedModel) -> TargetParts:
    """What the run needs of the loaded target; ``--init-from``'s head loaded and checked against the layers."""
    model = loaded.model
    facts = target_facts(loaded)
    layers = default_hidden_layers(facts.num_layers)
    lm_weight = output_weight(model)
    start_head = None
    if settings.init_from is not None:
        start_head = load_head(settings.init_from, facts, lm_head_weight=lambda: lm_weight)
        if tuple(start_head.config.hidden_layers) != layers:
            raise ValueError(f"--init-from {settings.init_from}: the head reads layers "
                             f"{list(start_head.config.hidden_layers)}, this trainer caches {list(layers)}")
        if 0 < settings.intermediate_size < start_head.config.intermediate_size:
            raise ValueError(f"--intermediate-size {settings.intermediate_size}: narrower than --init-from's MLP "
                             f"({start_head.config.intermediate_size}); a head can be grown, not cut")
    final_norm = getattr(model.get_decoder(), "norm", None) if hasattr(model, "get_decoder") else None
    norm_weight = final_norm.weight.detach().clone() if isinstance(getattr(final_norm, "weight", None),
                                                                    torch.Tensor) else None
    return TargetParts(
        facts=facts, layers=layers,
        fields=head_fields(model, settings.draft_vocab_size, settings.intermediate_size),
        lm_weight=lm_weight, embed_weight=model.get_input_embeddings().weight.detach(), norm_weight=norm_weight,
        eos_ids=list(loaded.eos_token_ids), verifier=facts.names[-1] if facts.names else settings.target,
        architectures=tuple(getattr(model.config, "architectures", None) or ()), start_head=start_head,
    )


@dataclass
class Corpus:
    """The corpus as cached: the standard-library sequences, the answer ``sets`` the head learns from, and the
    seconds spent answering and caching."""

    spec: CorpusSpec
    train_seqs: list[dict]
    held_seqs: list[dict]
    sets: list[AnswerSet]
    answer_seconds: float
    cache_seconds: float


def answer_sets(settings: TrainSettings, loaded: LoadedModel, spec: CorpusSpec, layers: tuple[int, ...],
                deadline: Deadline) -> tuple[list[AnswerSet], float, float]:
    """The answer sets of ``--answers``, ``--chat-answers`` and ``--passage-answers``, answered and cached:
    (the sets the head learns from, seconds answering, seconds caching)."""
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
    answer_seconds, cache_seconds = 0.0, 0.0
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
    if settings.uses_pool():
        name = settings.pool_answers_name()
        folder = pool_states_folder(name, layers)
        rows = pool_answer_rows(settings.target, settings.dtype, settings.answer_tokens, settings.pool_answers,
                                settings.pool_folder, settings.pool_part)
        sets.append(AnswerSet("pool_answers", name, folder, folder, None, len(rows), stored=lambda: rows, shared=True))
        seconds, cached = sets[-1].prepare(loaded, spec, layers, deadline)
        answer_seconds, cache_seconds = answer_seconds + seconds, cache_seconds + cached
    return [answer_set for answer_set in sets if answer_set.count], answer_seconds, cache_seconds


def prepare_corpus(settings: TrainSettings, deadline: Deadline) -> tuple[Corpus, TargetParts]:
    """Load the target, cache its states over the standard-library sequences and its answer sets (answered
    first; the pool's states within ``deadline``), keep what training needs of it and release it."""
    from ..backends.loading import LoadSettings, clear_model_cache, load_model

    loaded = load_model(settings.target, LoadSettings(dtype=settings.dtype), progress=True)
    target = target_parts(settings, loaded)  # --init-from checked before any answer or cache is made
    pack_bf16_linears(loaded.model)  # its CPU bfloat16 layers: the passes that answer and cache, about 1.1x faster
    spec = settings.corpus_spec()
    train_seqs, held_seqs, cache_seconds = code_corpus(
        loaded.tokenizer, spec, settings.cache_path(), partial(cache_split, loaded.model, layers=target.layers))
    sets, answer_seconds, answers_cached = answer_sets(settings, loaded, spec, target.layers, deadline)
    del loaded
    clear_model_cache()
    return Corpus(spec, train_seqs, held_seqs, sets, answer_seconds, cache_seconds + answers_cached), target


@dataclass
class Splits:
    """The cached states training reads: ``train`` (the standard library's training sequences, then each answer
    set's), the held-out ``code`` and each answer set's held-out sequences by name (``answers``), and the
    standard library's training positions."""

    train: Split
    code: Split
    answers: dict[str, Split]
    code_positions: int

    def held_out(self) -> dict[str, Split]:
        """Every held-out split by its name in ``training.json``: the standard library's (when it has any
        sequences), then each answer set's."""
        return {**({"standard_library": self.code} if len(self.code) else {}), **self.answers}


def load_splits(folder: Path, sets: list[AnswerSet]) -> Splits:
    """The cached states of the corpus in ``folder`` and of the answer ``sets`` (their position counts noted)."""
    data, code_held = load_split(folder, "train"), load_split(folder, "heldout")
    code_positions = int(data.labels().numel())
    answers: dict[str, Split] = {}
    for answer_set in sets:
        answer_train_split = answer_set.split("train")
        answers[answer_set.name] = answer_set.split("heldout")
        answer_set.counts["training_positions"] = int(answer_train_split.labels().numel())
        answer_set.counts["held_out_positions"] = int(answers[answer_set.name].labels().numel())
        data = Split.join([data, answer_train_split])
        del answer_train_split
    return Splits(data, code_held, answers, code_positions)


def new_head(settings: TrainSettings, target: TargetParts, labels: torch.Tensor) -> EagleHead:
    """The head to train, its LM head frozen: ``--init-from``'s (its sizes kept but for an MLP grown to a larger
    ``--intermediate-size``, and its draft vocabulary unless ``--new-draft-vocab`` chooses one from ``labels``),
    else one seeded anew over the draft vocabulary of ``labels``, the LM head the target's rows at those ids, the
    final norm the target's, and started as ``--init`` asks. ``target.start_head`` is released."""
    start_head, target.start_head = target.start_head, None
    fields = target.fields
    if start_head is None:
        draft_ids = draft_vocabulary(labels, fields["draft_vocab_size"], fields["vocab_size"], target.eos_ids)
        fields["draft_vocab_size"] = int(draft_ids.numel())
        config = EagleConfig(**fields, verifier=target.verifier, verifier_architectures=target.architectures)
    else:  # its draft vocabulary and sizes, as trained before
        draft_ids, config = start_head.draft_ids.clone(), start_head.config
        if settings.new_draft_vocab:  # a draft vocabulary from these labels
            draft_ids = draft_vocabulary(labels, fields["draft_vocab_size"], fields["vocab_size"], target.eos_ids)
            config = replace(config, draft_vocab_size=int(draft_ids.numel()))
        if settings.intermediate_size > config.intermediate_size:  # its MLP grown
            config = replace(config, intermediate_size=settings.intermediate_size)
    torch.manual_seed(settings.seed)
    head = EagleHead(config)
    with torch.no_grad():
        head.draft_ids.copy_(draft_ids)  # a buffer outside the state dict
        if start_head is not None:
            state = start_head.state_dict()
            if settings.new_draft_vocab:  # the target's rows at the new ids
                state["lm_head.weight"] = target.lm_weight[draft_ids]
            head.load_state_dict(widened_mlp(state, head.state_dict()))
        else:
            head.lm_head.weight.copy_(target.lm_weight[draft_ids].float())
            if target.norm_weight is not None and target.norm_weight.shape == head.norm.weight.shape:
                head.norm.weight.copy_(target.norm_weight.float())
            if settings.init == "pass-through":
                pass_through_init(head)
    head.lm_head.weight.requires_grad_(False)  # the target's rows: shared, not stored
    return head


def widened_mlp(start: dict[str, torch.Tensor], fresh: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The start head's weights in a head whose MLP is ``fresh``'s width: the start's units kept, the new units'
    gate and up rows ``fresh``'s (random), their down columns zero, so the wider head computes what the start did
    and its new units learn from there. ``start`` itself where the widths agree."""
    state = dict(start)
    for name, tensor in start.items():
        wide = fresh[name]
        if wide.shape == tensor.shape or not name.startswith("midlayer.mlp."):
            continue
        grown = torch.zeros_like(wide) if name.endswith("down_proj.weight") else wide.clone()
        grown[tuple(slice(0, n) for n in tensor.shape)] = tensor
        state[name] = grown
    return state


@dataclass
class HeadRun:
    """The head in training and what trains it: the ``target``'s parts it reads, ``t2d`` (each target id's draft
    index, -1 outside the draft vocabulary), ``coverage`` (the share of training labels inside it), the
    ``trainable`` parameters, optimizer and schedule, each epoch's batches (``plans``), and the checkpoint file
    with the ``key`` it must hold to resume."""

    head: EagleHead
    target: TargetParts
    t2d: torch.Tensor
    coverage: float
    trainable: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    plans: list[list[list[int]]]
    checkpoint: Path
    key: str

    @property
    def total_steps(self) -> int:
        return sum(len(plan) for plan in self.plans)


def prepare_training(settings: TrainSettings, target: TargetParts, splits: Splits) -> HeadRun:
    """The head (:func:`new_head`), AdamW with warm-up then cosine decay over every epoch's batches, and the
    checkpoint named by the training key."""
    labels = splits.train.labels()
    head = new_head(settings, target, labels)
    draft_ids, vocab = head.draft_ids, target.fields["vocab_size"]
    inside = torch.zeros(vocab, dtype=torch.bool)
    inside[draft_ids] = True
    coverage = float(inside[labels.long()].float().mean()) if labels.numel() else 0.0
    t2d = torch.full((vocab,), -1, dtype=torch.long)
    t2d[draft_ids] = torch.arange(draft_ids.numel())
    trainable = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=settings.learning_rate, weight_decay=0.0)
    data = splits.train
    plans = [plan_batches(data, epoch_order(len(data), settings.seed, e), settings.batch_tokens)
             for e in range(settings.epochs)]
    total_steps = sum(len(p) for p in plans)
    warmup = min(settings.warmup_steps, max(1, total_steps // 10))

    def schedule(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total_steps - warmup))))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    key = settings.train_key(draft_ids, head.config)
    return HeadRun(head, target, t2d, coverage, trainable, optimizer, scheduler, plans,
                   settings.cache_path() / f"checkpoint-eagle-{key}.pt", key)


@dataclass
class Progress:
    """Where training stands: the ``epoch``, the batch ``position`` in it and the optimizer ``step``, the seconds
    trained by earlier runs and by this one, the last per-step losses, the held-out top-1 per step after each
    epoch, and whether it ``stopped`` before the end."""

    epoch: int = 0
    position: int = 0
    step: int = 0
    trained_before: float = 0.0
    train_seconds: float = 0.0
    last_losses: list[float] = field(default_factory=list)
    per_epoch: list[dict] = field(default_factory=list)
    stopped: bool = False


def resume(run: HeadRun) -> Progress:
    """Where the run's checkpoint left training, its head, optimizer, schedule and RNG state restored; else the
    start."""
    saved = read_checkpoint(run.checkpoint, "key", run.key)
    if saved is None:
        return Progress()
    run.head.load_state_dict({**run.head.state_dict(), **saved["head"]})
    run.optimizer.load_state_dict(saved["optimizer"])
    run.scheduler.load_state_dict(saved["scheduler"])
    torch.set_rng_state(saved["rng"])
    progress = Progress(epoch=int(saved["epoch"]), position=int(saved["position"]), step=int(saved["step"]),
                        trained_before=float(saved["train_seconds"]), last_losses=list(saved["losses"]),
                        per_epoch=list(saved.get("held_out_per_epoch", [])))
    logger.info("resuming at epoch %d, batch %d (step %d) from %s", progress.epoch + 1, progress.position,
                progress.step, run.checkpoint)
    return progress


def save_progress(run: HeadRun, progress: Progress, train_seconds: float) -> None:
    """Checkpoint the run where ``progress`` stands, after ``train_seconds`` of training in all."""
    save_checkpoint(run.checkpoint, {
        "key": run.key, "epoch": progress.epoch, "position": progress.position, "step": progress.step,
        "head": _trainable_state(run.head), "optimizer": run.optimizer.state_dict(),
        "scheduler": run.scheduler.state_dict(), "rng": torch.get_rng_state(), "losses": progress.last_losses,
        "held_out_per_epoch": progress.per_epoch, "train_seconds": train_seconds,
    })


def train_step(settings: TrainSettings, run: HeadRun, batch: Batch, progress: Progress) -> list[float]:
    """One optimizer step on ``batch`` (none when no row has a label inside the draft vocabulary), and the
    schedule's; the loss of each unrolled step."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=settings.train_dtype == "bfloat16"):
        loss, per_step = unrolled_loss(run.head, run.target.embed_weight, batch, run.t2d, settings.steps_unrolled,
                                       settings.loss_decay)
    if loss is not None:
        run.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(run.trainable, settings.grad_clip)
        run.optimizer.step()
        progress.last_losses = per_step
    run.scheduler.step()
    return per_step


def held_out_figures(settings: TrainSettings, run: HeadRun, splits: dict[str, Split]) -> dict[str, dict]:
    """:func:`evaluate` on each split, of the head's weights as they would be written (:func:`as_shipped`)."""
    rounded = as_shipped(run.head)
    return {name: evaluate(rounded, run.target.embed_weight, split, settings.steps_unrolled, settings.batch_tokens)
            for name, split in splits.items()}


def train_epochs(settings: TrainSettings, run: HeadRun, splits: Splits, deadline: Deadline) -> Progress:
    """Train from where the checkpoint left off through every epoch, or until ``deadline`` or
    ``stop_after_steps``: a checkpoint every :data:`CHECKPOINT_SECONDS` and after each epoch, and the held-out
    top-1 on the answers after each epoch but the last (whose figures are the final ones)."""
    progress = resume(run)
    answer_splits = dict(reversed(splits.answers.items()))  # the newest kind first, as the figures always were
    train_started = time.perf_counter()
    saved_at = train_started

    def save() -> None:
        save_progress(run, progress, progress.trained_before + time.perf_counter() - train_started)

    run.head.train()
    with tqdm(total=run.total_steps, initial=progress.step, desc="training the EAGLE head", unit="step") as bar:
        while progress.epoch < settings.epochs and not progress.stopped:
            batches = run.plans[progress.epoch]
            while progress.position < len(batches):
                batch = make_batch(splits.train, batches[progress.position], settings.steps_unrolled,
                                   with_finals=settings.loss_target == "distribution")
                per_step = train_step(settings, run, batch, progress)
                progress.position += 1
                progress.step += 1
                bar.update(1)
                bar.set_postfix(epoch=f"{progress.epoch + 1}/{settings.epochs}",
                                loss=" ".join(f"{v:.2f}" for v in per_step))
                now = time.perf_counter()
                out_of_time = deadline.passed
                if (settings.stop_after_steps is not None and progress.step >= settings.stop_after_steps
                        or out_of_time):
                    progress.stopped = True
                    break
                if now - saved_at > CHECKPOINT_SECONDS and progress.position < len(batches):
                    save()
                    saved_at = now
            if progress.position >= len(batches):
                progress.epoch, progress.position = progress.epoch + 1, 0
                if answer_splits and progress.epoch < settings.epochs:
                    figures = held_out_figures(settings, run, answer_splits)
                    progress.per_epoch.append({"epoch": progress.epoch, **{
                        name: split_figures["top1_per_step"] for name, split_figures in figures.items()}})
                    run.head.train()
            save()
            saved_at = time.perf_counter()
    progress.train_seconds = progress.trained_before + time.perf_counter() - train_started
    return progress


def ship(settings: TrainSettings, corpus: Corpus, splits: Splits, run: HeadRun, progress: Progress,
         started: float, at_start: dict | None = None) -> dict:
    """Evaluate the head as written on every held-out split, write it (checked to load as it ships) and its
    ``training.json`` (with ``at_start``, the figures of ``--init-from``'s head on the same splits); the report."""
    eval_started = time.perf_counter()
    held = held_out_figures(settings, run, splits.held_out())
    eval_seconds = time.perf_counter() - eval_started
    head, config = run.head, run.head.config
    digest = save_head(head, settings.out, ship_dtype(config))
    weights = settings.out / "model.safetensors"
    if weights.stat().st_size > MAX_HEAD_BYTES:
        logger.warning("the head's weights take %.1f MB, more than the %.0f MB a shipped head may",
                       weights.stat().st_size / 1e6, MAX_HEAD_BYTES / 1e6)
    lm_weight = run.target.lm_weight
    load_head(settings.out, run.target.facts, expected_sha256=digest, lm_head_weight=lambda: lm_weight)  # loads
    train_seqs, held_seqs = corpus.train_seqs, corpus.held_seqs
    report = {
        **run_record("specdemo.training.eagle", settings),
        "complete": not progress.stopped,
        "steps": {"done": progress.step, "planned": run.total_steps},
        "corpus": {
            "source": corpus.spec.description(),
            "training_sequences": len(train_seqs),
            "training_positions": splits.code_positions,
            "held_out_sequences": len(held_seqs),
            "held_out_positions": int(splits.code.labels().numel()),
            "training_files": len({s["file"] for s in train_seqs}),
            "held_out_files": len({s["file"] for s in held_seqs}),
        },
        **{name: next((a.counts for a in corpus.sets if a.name == name), None) for name in ANSWER_SETS},
        "head": {
            "hidden_layers": list(config.hidden_layers),
            "intermediate_size": config.intermediate_size,
            "draft_vocab_size": config.draft_vocab_size,
            "greedy_tokens_inside_draft_vocab": round(run.coverage, 4),
            "draft_vocab_from": "the starting head" if settings.init_from is not None and not settings.new_draft_vocab
            else "this run's training answers",
            "parameters": config.parameter_count(),
            "lm_head": "the target's rows at the draft ids (shared, not stored)",
            "dtype": str(ship_dtype(config)).removeprefix("torch."),
            "weights_bytes": weights.stat().st_size,
        },
        "seconds": {"answers": round(corpus.answer_seconds, 1), "cache": round(corpus.cache_seconds, 1),
                    "train": round(progress.train_seconds, 1), "evaluate": round(eval_seconds, 1),
                    "total": round(time.perf_counter() - started, 1)},
        "last_train_loss_per_step": [round(v, 4) for v in progress.last_losses],
        "held_out": held,
        **({"held_out_at_start": at_start} if at_start else {}),
        "held_out_per_epoch": progress.per_epoch,
        "torch_threads": torch.get_num_threads(),
        "weights_sha256": digest,
    }
    report["lineage"] = lineage(settings.init_from, report)
    report.update(settings.extra)
    write_training_json(settings.out, report)
    return report


def train(settings: TrainSettings) -> dict:
    """The whole run: corpus and cache, draft vocabulary and head, training, held-out evaluation, head written
    to ``settings.out`` with ``training.json``."""
    check_choices(settings)
    settings.claim_cache_dir()
    started = time.perf_counter()
    deadline = Deadline(settings.time_budget_minutes or None)  # 0: no budget, as before
    corpus, target = prepare_corpus(settings, deadline)
    splits = load_splits(settings.cache_path(), corpus.sets)
    run = prepare_training(settings, target, splits)
    # the head it starts from, measured on the same held-out splits: what training must beat
    at_start = held_out_figures(settings, run, splits.held_out()) if settings.init_from is not None else None
    progress = train_epochs(settings, run, splits, deadline)
    return ship(settings, corpus, splits, run, progress, started, at_start)


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
                             f"{MAX_HEAD_BYTES / 1e6:.0f} MB); with --init-from, a width above the start's grows "
                             f"its MLP (the new units start adding nothing)")
    parser.add_argument("--init", default=defaults.init, choices=INITS,
                        help="pass-through: the head starts as the target's top layer's state read by its LM head")
    parser.add_argument("--init-from", type=Path, default=None,
                        help="a head folder to train further (its sizes and draft vocabulary kept)")
    parser.add_argument("--new-draft-vocab", action="store_true",
                        help="with --init-from: choose the draft vocabulary anew (--draft-vocab-size ids) from this "
                             "run's training answers, the start's weights kept")
    parser.add_argument("--batch-tokens", type=int, default=defaults.batch_tokens,
                        help="tokens per optimizer step (whole sequences)")
    parser.add_argument("--train-dtype", default=defaults.train_dtype, choices=TRAIN_DTYPES,
                        help="the head's matmuls while training (bfloat16: autocast, float32 weights and optimizer)")
    add_time_budget_argument(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    return train_and_print(train, TrainSettings(**vars(args)), ("held_out", "seconds", "weights_sha256", "complete"))


if __name__ == "__main__":
    raise SystemExit(main())
