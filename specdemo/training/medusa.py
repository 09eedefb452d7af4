"""Train Medusa heads for a target by self-distillation, on a CPU: ``python -m specdemo.training.medusa``.

1. Corpus: source files of the Python standard library of the running interpreter (code, docstrings and, in
   ``pydoc_data``, the language reference's prose), which every machine with Python has offline. Each sequence is
   one chat turn: a user asks for a part of a module, the assistant's answer is that part of the file. Files are
   split into training and held-out sets by a hash of their path. The benchmark prompt files are never read.
   With ``--answers N`` the target also answers N chat prompts built offline (:mod:`specdemo.training.corpus`:
   explanations, code writing and editing, summaries, translations, arithmetic, short writing) greedily, in
   batches, and its own answers join the corpus (self-distillation proper; one prompt in ``held_out_every`` is held
   out). Answers are written to disk batch by batch, so a restart carries on.
2. Cache: the frozen target runs once over every sequence with teacher forcing; its final (post-norm) hidden state
   and its own greedy next token at every position of the answer are stored on disk in shards (a restart resumes
   where the cache stopped).
3. Train: head k learns to predict the target's greedy token k positions after the one its own LM head predicts,
   from the same hidden state, with loss weights ``decay ** k``. Only the residual blocks train; the target's LM
   head is frozen and shared, scored over its lowest ``head_tokens`` ids. A checkpoint after each epoch makes a
   stopped run restartable.
4. Evaluate each head's top-1 accuracy on the held-out files and write the heads (bfloat16) with their provenance.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import random
import sys
import sysconfig
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from ..methods.medusa import MedusaConfig, MedusaHeads
from .corpus import training_prompts

if TYPE_CHECKING:
    from ..backends.loading import LoadedModel

logger = logging.getLogger(__name__)

#: folders of the standard library left out of the corpus (tests, demos, vendored third-party code)
EXCLUDED_DIRS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "ensurepip", "turtledemo", "__pycache__"}
CACHE_ROOT = Path.home() / ".cache" / "specdemo" / "medusa-train"
SHARD_SEQUENCES = 16


@dataclass
class TrainSettings:
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
    seed: int = 0
    dtype: str = "bfloat16"
    cache_dir: Path | None = None
    answers: int = 0  # prompts the target answers itself (self-distillation proper); 0 = code corpus only
    answer_tokens: int = 256
    generation_batch: int = 32
    extra: dict = field(default_factory=dict)

    def corpus_key(self) -> str:
        keyed = [self.target, self.dtype, self.sequences, self.sequence_tokens, self.held_out_every,
                 self.held_out_sequences, self.seed, sys.version.split()[0]]
        return hashlib.sha256(json.dumps(keyed).encode()).hexdigest()[:16]

    def cache_path(self) -> Path:
        return self.cache_dir if self.cache_dir is not None else CACHE_ROOT / self.corpus_key()

    def answers_key(self) -> str:
        keyed = [self.target, self.dtype, self.answers, self.answer_tokens, self.held_out_every, self.seed,
                 sys.version.split()[0]]
        return hashlib.sha256(json.dumps(keyed).encode()).hexdigest()[:16]

    def answers_path(self) -> Path:
        return self.cache_path() / f"answers-{self.answers_key()}"


# ----------------------------------------------------------------------------------------------------------------
# corpus


def stdlib_files(root: Path | None = None) -> list[Path]:
    """The standard library's .py files, sorted, without tests, demos and vendored packages."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(base.rglob("*.py")):
        parts = set(path.relative_to(base).parts[:-1])
        if parts & EXCLUDED_DIRS:
            continue
        files.append(path)
    return files


def is_held_out(relative: str, every: int) -> bool:
    return int(hashlib.sha256(relative.encode()).hexdigest(), 16) % every == 0


def build_sequences(tokenizer, settings: TrainSettings) -> tuple[list[dict], list[dict]]:
    """(training, held-out) sequences: dicts with ``ids`` (header + body), ``answer_start`` and ``file``."""
    base = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_files(base)
    rng = random.Random(settings.seed)
    rng.shuffle(files)
    train: list[dict] = []
    held: list[dict] = []
    for path in files:
        if len(train) >= settings.sequences and len(held) >= settings.held_out_sequences:
            break
        relative = str(path.relative_to(base))
        bucket = held if is_held_out(relative, settings.held_out_every) else train
        wanted = settings.held_out_sequences if bucket is held else settings.sequences
        if len(bucket) >= wanted:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        module = relative[:-3].replace("/", ".")
        user = f"Show me part of the source code of the Python standard library module `{module}`."
        header = _chat_header(tokenizer, user) + tokenizer("```python\n", add_special_tokens=False)["input_ids"]
        body = tokenizer(text, add_special_tokens=False)["input_ids"]
        room = settings.sequence_tokens - len(header)
        if room < 16:
            raise ValueError(f"--sequence-tokens {settings.sequence_tokens} leaves no room after the {len(header)}-token "
                             "prompt header")
        if len(body) < room // 2:
            continue  # too short to teach much
        start = rng.randrange(0, max(1, len(body) - room))
        bucket.append({"ids": list(header) + list(body[start : start + room]), "answer_start": len(header),
                       "file": relative})
    return train, held


def _chat_header(tokenizer, user: str) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template(
            [{"role": "user", "content": user}], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"])
    return list(tokenizer(user + "\n", add_special_tokens=True)["input_ids"])


@torch.inference_mode()
def generate_answers(loaded: LoadedModel, settings: TrainSettings, path: Path) -> list[dict]:
    """The target's own greedy answers to ``settings.answers`` training prompts, generated in batches (left
    padding) and appended to ``path`` (JSON lines) batch by batch, so a restart carries on where it stopped."""
    model, tokenizer = loaded.model, loaded.tokenizer
    prompts = training_prompts(settings.answers, stdlib_files(), settings.seed)
    done: dict[int, dict] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                done[row["index"]] = row
    headers = [_chat_header(tokenizer, prompt.text) for prompt in prompts]
    # similar prompt lengths share a batch (less padding); the index keeps the seeded order
    todo = sorted((i for i in range(len(prompts)) if i not in done), key=lambda i: (len(headers[i]), i))
    stop_ids = set(loaded.eos_token_ids)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(stop_ids, default=0)
    device = next(model.parameters()).device
    path.parent.mkdir(parents=True, exist_ok=True)
    with tqdm(total=len(prompts), initial=len(done), desc="target answering training prompts", unit="answer") as bar:
        for start in range(0, len(todo), settings.generation_batch):
            batch = todo[start : start + settings.generation_batch]
            width = max(len(headers[i]) for i in batch)
            ids = torch.tensor([[pad_id] * (width - len(headers[i])) + headers[i] for i in batch], device=device)
            mask = torch.tensor([[0] * (width - len(headers[i])) + [1] * len(headers[i]) for i in batch],
                                device=device)
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=settings.answer_tokens,
                                 do_sample=False, pad_token_id=pad_id)
            rows = []
            for row, i in zip(out[:, width:].tolist(), batch):
                answer = []
                for token in row:
                    answer.append(token)
                    if token in stop_ids:
                        break
                rows.append({"index": i, "kind": prompts[i].kind, "prompt": prompts[i].text, "answer_ids": answer,
                             "answer": tokenizer.decode(answer, skip_special_tokens=True)})
            with path.open("a") as handle:
                for row in rows:
                    handle.write(json.dumps(row) + "\n")
                    done[row["index"]] = row
            bar.update(len(batch))
    return [done[i] for i in range(len(prompts))]


def answer_sequences(tokenizer, answers: list[dict], settings: TrainSettings) -> tuple[list[dict], list[dict]]:
    """(training, held-out) sequences of prompt + the target's own answer; one prompt in ``held_out_every`` is
    held out."""
    train: list[dict] = []
    held: list[dict] = []
    for row in answers:
        if len(row["answer_ids"]) < 8:
            continue
        header = _chat_header(tokenizer, row["prompt"])
        bucket = held if row["index"] % settings.held_out_every == 0 else train
        bucket.append({"ids": header + row["answer_ids"], "answer_start": len(header), "file": row["kind"]})
    return train, held


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


@torch.inference_mode()
def cache_split(model, sequences: list[dict], folder: Path, name: str, max_heads: int) -> None:
    """Run the target over ``sequences`` and store hidden states and labels in shards (existing shards kept)."""
    folder.mkdir(parents=True, exist_ok=True)
    shards = math.ceil(len(sequences) / SHARD_SEQUENCES)
    todo = [s for s in range(shards) if not (folder / f"{name}_{s:04d}.pt").is_file()]
    if not todo:
        return
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    head = model.get_output_embeddings()
    device = next(model.parameters()).device
    with tqdm(total=sum(len(sequences[s * SHARD_SEQUENCES : (s + 1) * SHARD_SEQUENCES]) for s in todo),
              desc=f"caching target states ({name})", unit="seq") as bar:
        for shard in todo:
            hidden_rows, label_rows = [], []
            for sequence in sequences[shard * SHARD_SEQUENCES : (shard + 1) * SHARD_SEQUENCES]:
                ids = torch.tensor([sequence["ids"]], device=device)
                hidden = base(input_ids=ids).last_hidden_state[0]
                start = sequence["answer_start"] - 1  # this position predicts the answer's first token
                hidden = hidden[start:]
                greedy = head(hidden).argmax(-1).cpu()
                hidden_rows.append(hidden.to(torch.bfloat16).cpu())
                label_rows.append(labels_for(greedy, max_heads + 1))  # one head more than trained: room to grow
                bar.update(1)
            partial = folder / f"{name}_{shard:04d}.pt.partial"
            torch.save({"hidden": torch.cat(hidden_rows), "labels": torch.cat(label_rows, dim=1)}, partial)
            partial.rename(folder / f"{name}_{shard:04d}.pt")  # a shard is there whole or not at all


def load_split(folder: Path, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    shards = sorted(folder.glob(f"{name}_*.pt"))
    if not shards:
        raise FileNotFoundError(f"no cached {name} shards in {folder}")
    parts = [torch.load(p, weights_only=True) for p in shards]
    return torch.cat([p["hidden"] for p in parts]), torch.cat([p["labels"] for p in parts], dim=1)


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
    heads: MedusaHeads, hidden: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor, decay: float
) -> tuple[torch.Tensor, list[float]]:
    """Weighted cross-entropy over heads; labels [K, B] in sub-vocabulary ids (-100 = ignore)."""
    logits = heads.features(hidden) @ weight.T  # [K, B, V']
    total = torch.zeros((), dtype=torch.float32)
    per_head = []
    for k in range(logits.shape[0]):
        if bool((labels[k] >= 0).any()):
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


def train(settings: TrainSettings) -> dict:
    """The whole run: corpus, cache, training, held-out accuracy, heads written to ``settings.out``."""
    from ..backends.loading import LoadSettings, load_model

    started = time.perf_counter()
    torch.manual_seed(settings.seed)
    loaded = load_model(settings.target, LoadSettings(dtype=settings.dtype), progress=True)
    model = loaded.model
    head_weight = model.get_output_embeddings().weight.detach()
    hidden_size, vocab_size = head_weight.shape[1], head_weight.shape[0]
    folder = settings.cache_path()
    train_seqs, held_seqs = build_sequences(loaded.tokenizer, settings)
    logger.info("corpus: %d training and %d held-out sequences", len(train_seqs), len(held_seqs))
    cache_dir_note = {"files": sorted({s["file"] for s in train_seqs}), "held_out_files": sorted({s["file"] for s in held_seqs})}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "corpus.json").write_text(json.dumps(cache_dir_note, indent=1))
    cache_started = time.perf_counter()
    cache_split(model, train_seqs, folder, "train", settings.num_heads)
    cache_split(model, held_seqs, folder, "heldout", settings.num_heads)
    cache_seconds = time.perf_counter() - cache_started
    answer_seconds = 0.0
    answer_counts: dict = {}
    if settings.answers:
        answer_started = time.perf_counter()
        answers_folder = settings.answers_path()
        answers = generate_answers(loaded, settings, answers_folder / "answers.jsonl")
        answer_seconds = time.perf_counter() - answer_started
        answer_train, answer_held = answer_sequences(loaded.tokenizer, answers, settings)
        cache_started = time.perf_counter()
        cache_split(model, answer_train, answers_folder, "train", settings.num_heads)
        cache_split(model, answer_held, answers_folder, "heldout", settings.num_heads)
        cache_seconds += time.perf_counter() - cache_started
        answer_counts = {"training_sequences": len(answer_train), "held_out_sequences": len(answer_held),
                         "prompts_per_kind": dict(Counter(row["kind"] for row in answers)),
                         "mean_answer_tokens": round(sum(len(r["answer_ids"]) for r in answers) / max(1, len(answers)),
                                                     1)}

    weight = head_weight[: settings.head_tokens] if settings.head_tokens else head_weight
    weight = weight.float().contiguous()
    del loaded, model
    from ..backends.loading import clear_model_cache

    clear_model_cache()
    hidden, labels = load_split(folder, "train")
    held_hidden, held_labels = load_split(folder, "heldout")
    code_positions = int(hidden.shape[0])
    if settings.answers:
        answer_hidden, answer_labels = load_split(settings.answers_path(), "train")
        hidden, labels = torch.cat([hidden, answer_hidden]), torch.cat([labels, answer_labels], dim=1)
        answer_held_hidden, answer_held_labels = load_split(settings.answers_path(), "heldout")
        answer_counts["training_positions"] = int(answer_hidden.shape[0])
        answer_counts["held_out_positions"] = int(answer_held_hidden.shape[0])
        del answer_hidden, answer_labels
    head_labels = labels[: settings.num_heads]  # row k - 1: head k's target
    train_labels = _sub_labels(head_labels, settings.head_tokens)
    valid = head_labels >= 0
    coverage = float((head_labels[valid] < settings.head_tokens).float().mean()) if settings.head_tokens else 1.0

    config = MedusaConfig(
        num_heads=settings.num_heads, num_layers=1, hidden_size=hidden_size, vocab_size=vocab_size,
        head_tokens=settings.head_tokens, base_model=settings.target,
    )
    heads = MedusaHeads(config)
    optimizer = torch.optim.AdamW(heads.parameters(), lr=settings.learning_rate, weight_decay=0.0)
    steps_per_epoch = math.ceil(hidden.shape[0] / settings.batch_size)
    total_steps = steps_per_epoch * settings.epochs
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / 50) * max(0.0, 1.0 - step / total_steps)
    )
    checkpoint = folder / f"checkpoint-{settings.num_heads}h-{settings.head_tokens}.pt"
    first_epoch = 0
    if checkpoint.is_file():
        saved = torch.load(checkpoint, weights_only=True)
        if saved.get("settings") == _train_key(settings):
            heads.load_state_dict(saved["heads"])
            optimizer.load_state_dict(saved["optimizer"])
            scheduler.load_state_dict(saved["scheduler"])
            first_epoch = int(saved["epoch"])
            logger.info("resuming after epoch %d from %s", first_epoch, checkpoint)
    train_started = time.perf_counter()
    generator = torch.Generator().manual_seed(settings.seed)
    for _ in range(first_epoch):  # the same shuffles as an uninterrupted run
        torch.randperm(hidden.shape[0], generator=generator)
    last_losses: list[float] = []
    for epoch in range(first_epoch, settings.epochs):
        order = torch.randperm(hidden.shape[0], generator=generator)
        heads.train()
        with tqdm(range(steps_per_epoch), desc=f"training heads, epoch {epoch + 1}/{settings.epochs}",
                  unit="step") as bar:
            for step in bar:
                index = order[step * settings.batch_size : (step + 1) * settings.batch_size]
                loss, per_head = head_loss(heads, hidden[index].float(), train_labels[:, index], weight,
                                           settings.loss_decay)
                if not loss.requires_grad:  # no position of this batch has a target the head can score
                    continue
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                scheduler.step()
                last_losses = per_head
                if step % 20 == 0:
                    bar.set_postfix(loss=" ".join(f"{v:.2f}" for v in per_head))
        torch.save({"settings": _train_key(settings), "epoch": epoch + 1, "heads": heads.state_dict(),
                    "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, checkpoint)
    train_seconds = time.perf_counter() - train_started
    heads.eval()
    accuracy = evaluate(heads, held_hidden, held_labels, weight)
    if settings.answers:
        answer_counts["held_out_top1_per_head"] = evaluate(heads, answer_held_hidden, answer_held_labels, weight)
    report = {
        "command": "python -m specdemo.training.medusa " + " ".join(sys.argv[1:]),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(settings).items() if k != "extra"},
        "corpus": {
            "source": f"Python {sys.version.split()[0]} standard library sources (tests, idlelib, lib2to3, "
                      "turtledemo, ensurepip excluded), one chat turn per sequence"
                      + (f", and the target's own greedy answers to {settings.answers} training prompts"
                         if settings.answers else ""),
            "training_sequences": len(train_seqs),
            "training_positions": code_positions,
            "held_out_sequences": len(held_seqs),
            "held_out_positions": int(held_hidden.shape[0]),
            "greedy_tokens_inside_head_subset": round(coverage, 4),
        },
        "answers": answer_counts or None,
        "seconds": {"cache": round(cache_seconds, 1), "answers": round(answer_seconds, 1),
                    "train": round(train_seconds, 1),
                    "total": round(time.perf_counter() - started, 1)},
        "last_train_loss_per_head": [round(v, 4) for v in last_losses],
        "held_out_top1_per_head": accuracy,  # on the held-out standard-library files (answers: under "answers")
        "torch_threads": torch.get_num_threads(),
    }
    report.update(settings.extra)
    digest = heads.save(settings.out, torch.bfloat16, extra={"training": report})
    report["weights_sha256"] = digest
    (settings.out / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def _train_key(settings: TrainSettings) -> list:
    return [settings.corpus_key(), settings.answers_key() if settings.answers else None, settings.num_heads,
            settings.head_tokens, settings.epochs, settings.batch_size,
            settings.learning_rate, settings.loss_decay]


def main(argv: list[str] | None = None) -> int:
    defaults = TrainSettings()
    parser = argparse.ArgumentParser(prog="python -m specdemo.training.medusa", description=__doc__.split("\n")[0])
    parser.add_argument("--target", default=defaults.target)
    parser.add_argument("--out", type=Path, required=True, help="folder to write the heads to")
    parser.add_argument("--heads", type=int, default=defaults.num_heads, dest="num_heads")
    parser.add_argument("--head-tokens", type=int, default=defaults.head_tokens)
    parser.add_argument("--sequences", type=int, default=defaults.sequences)
    parser.add_argument("--sequence-tokens", type=int, default=defaults.sequence_tokens)
    parser.add_argument("--held-out-sequences", type=int, default=defaults.held_out_sequences)
    parser.add_argument("--epochs", type=int, default=defaults.epochs)
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size)
    parser.add_argument("--learning-rate", type=float, default=defaults.learning_rate)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--dtype", default=defaults.dtype)
    parser.add_argument("--cache-dir", type=Path, default=None)
    parser.add_argument("--answers", type=int, default=defaults.answers,
                        help="training prompts the target answers itself; its answers join the corpus (0 = none)")
    parser.add_argument("--answer-tokens", type=int, default=defaults.answer_tokens,
                        help="longest answer the target writes per prompt")
    parser.add_argument("--generation-batch", type=int, default=defaults.generation_batch,
                        help="prompts the target answers in one batch")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    settings = TrainSettings(**{k: v for k, v in vars(args).items()})
    report = train(settings)
    print(json.dumps({k: report[k] for k in ("held_out_top1_per_head", "seconds", "weights_sha256")}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
