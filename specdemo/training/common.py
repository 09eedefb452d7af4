"""What the self-distillation trainers share: the corpus, the target's own answers and the shard cache.

- **Corpus**: source files of the Python standard library of the running interpreter (code, docstrings and, in
  ``pydoc_data``, the language reference's prose), which every machine with Python has offline. Each sequence is
  one chat turn: a user asks for a part of a module, the assistant's answer is that part of the file. Files are
  split into training and held-out sets by a hash of their path. The benchmark prompt files are never read.
- **Answers**: the target answers chat prompts built offline (:mod:`specdemo.training.corpus`) greedily, in
  batches; its answers join the corpus, one prompt in ``held_out_every`` held out. They are written to disk batch
  by batch, so a restart carries on; a trainer may start from another trainer's answers to the same prompts.
- **Shards**: what a trainer stores of the target's pass over each sequence, a fixed number of sequences per file,
  each file written whole or not at all, so a restart resumes where the cache stopped.
- **Run steps**: the standard-library corpus listed and cached, training checkpoints kept only for the settings
  that wrote them, and the ``training.json`` beside the weights.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import random
import shutil
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch
from tqdm import tqdm

from ..backends.offline import cache_home
from ..core.files import atomic_path, file_sha256, write_json_atomic
from .batch_generation import generate_batch
from .corpus import (
    CHAT_PROMPTS_VERSION,
    PASSAGE_PROMPTS_VERSION,
    TrainingPrompt,
    training_prompts,
)

if TYPE_CHECKING:
    from ..backends.loading import LoadedModel

logger = logging.getLogger(__name__)

#: folders of the standard library left out of the corpus (tests, demos, vendored third-party code)
EXCLUDED_DIRS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "ensurepip", "turtledemo", "__pycache__"}
#: where the trainers keep their caches, one folder each (``medusa-train``, ``eagle-train``, ``pool-states``): the
#: project's cache folder (``$SPECDEMO_CACHE``, else ``$XDG_CACHE_HOME/specdemo``, else ``~/.cache/specdemo``)
CACHE_HOME = cache_home()
#: sequences per shard file
SHARD_SEQUENCES = 16
#: the file in a ``--cache-dir`` naming the corpus its shards were made from
CACHE_KEY_FILE = "corpus-key.json"
#: the answers file inside an answers folder
ANSWERS_FILE = "answers.jsonl"
#: seconds between a trainer's checkpoints inside an epoch
CHECKPOINT_SECONDS = 300.0
#: answers committed with a checkout (``answers-KEY.jsonl``), so a run on a new machine need not generate them again
#: (absent from an installed package: then nothing is found there)
CHECKOUT_ANSWERS = Path(__file__).resolve().parents[2] / "assets" / "training"


@dataclass(frozen=True)
class CorpusSpec:
    """Which sequences a trainer learns from: ``sequences`` standard-library stretches of ``sequence_tokens``
    tokens (and ``held_out_sequences`` from held-out files, one file in ``held_out_every`` by path hash), and the
    target's own greedy answers (at most ``answer_tokens`` each, ``generation_batch`` prompts at a time) to
    ``answers`` offline prompts; ``seed`` orders files and prompts."""

    sequences: int
    sequence_tokens: int
    held_out_every: int
    held_out_sequences: int
    seed: int
    answers: int = 0
    answer_tokens: int = 256
    generation_batch: int = 32
    chat_answers: int = 0  # the target's answers to the first N of :func:`~.corpus.chat_prompts` too
    #: the target's answers to N :func:`~.corpus.passage_prompts` too (over its answers to the first N chat prompts)
    passage_answers: int = 0

    def description(self) -> str:
        return (f"Python {sys.version.split()[0]} standard library sources (tests, idlelib, lib2to3, turtledemo, "
                "ensurepip excluded), one chat turn per sequence"
                + (f", and the target's own greedy answers to {self.answers} training prompts" if self.answers else "")
                + (f" and to {self.chat_answers} chat prompts" if self.chat_answers else "")
                + (f" and to {self.passage_answers} prompts quoting its chat answers" if self.passage_answers
                   else ""))


#: what a head learns at each position (``--loss-target``, both trainers): the target's greedy token, or its whole
#: next-token distribution over the tokens the head scores, from the target's final hidden state there
LOSS_TARGETS = ("greedy", "distribution")


def distribution_cross_entropy(logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy of ``logits`` [N, V] against the distributions of ``target_logits`` [N, V] (softmax
    over the same V tokens; no gradient flows into the target's)."""
    target = torch.softmax(target_logits.detach().float(), -1)
    return -(target * torch.log_softmax(logits.float(), -1)).sum(-1).mean()


def check_loss_target(loss_target: str) -> None:
    """Refuse a ``--loss-target`` that is not one of :data:`LOSS_TARGETS`, in one line."""
    if loss_target not in LOSS_TARGETS:
        raise ValueError(f"--loss-target {loss_target}: {' or '.join(LOSS_TARGETS)}")


class CorpusSettings:
    """What a trainer's settings derive from their corpus fields (``target``, ``dtype``, ``cache_dir``, the
    :class:`CorpusSpec` fields and a ``corpus_key()`` of the trainer's own): the spec, the cache folder and the
    answers' key and folder. A mixin for the trainers' settings dataclasses, so both derive them the same way."""

    def corpus_key(self) -> str:
        raise NotImplementedError

    def corpus_spec(self) -> CorpusSpec:
        return CorpusSpec(self.sequences, self.sequence_tokens, self.held_out_every, self.held_out_sequences,
                          self.seed, self.answers, self.answer_tokens, self.generation_batch,
                          getattr(self, "chat_answers", 0), getattr(self, "passage_answers", 0))

    def uses_pool(self) -> bool:
        """Whether the heads learn from the prompt pool's stored answers (``--pool-answers`` or ``--pool-part``)."""
        return bool(self.pool_answers or self.pool_part)

    def pool_selection(self) -> list:
        """Which of the pool's answers, as the training keys hold it (one of the two flags; refused when both)."""
        if self.pool_answers and self.pool_part:
            raise ValueError("--pool-answers and --pool-part: choose one (the first N prompts, or part K of P)")
        return [self.pool_answers] if self.pool_answers else ["part", self.pool_part]

    def cache_path(self) -> Path:
        return self.cache_dir if self.cache_dir is not None else self.cache_root / self.corpus_key()

    def claim_cache_dir(self) -> None:
        """Mark a ``--cache-dir`` as the cache of this run's corpus (:data:`CACHE_KEY_FILE`), and refuse in one line
        one that holds another corpus's shards (other ``--sequences``, ``--seed``, target, ...), which would be read
        as this run's. The default folder is named by ``corpus_key()`` and needs no mark."""
        if self.cache_dir is not None:
            claim_cache_folder(self.cache_dir, self.corpus_key())

    def answers_key(self) -> str:
        return answers_key(self.target, self.dtype, self.corpus_spec())

    def answers_path(self) -> Path:
        return self.cache_path() / f"answers-{self.answers_key()}"

    def chat_answers_key(self) -> str:
        return chat_answers_key(self.target, self.dtype, self.corpus_spec())

    def chat_answers_path(self) -> Path:
        return self.cache_path() / f"answers-{self.chat_answers_key()}"

    def passage_answers_key(self) -> str:
        return passage_answers_key(self.target, self.dtype, self.corpus_spec())

    def passage_answers_path(self) -> Path:
        return self.cache_path() / f"answers-{self.passage_answers_key()}"


def claim_cache_folder(folder: Path, corpus_key: str) -> None:
    """Write ``corpus_key`` into ``folder``'s :data:`CACHE_KEY_FILE`, or refuse (``ValueError``, one line) when the
    folder holds another key's, or shards with no key at all: a folder chosen by hand may hold anything."""
    marker = folder / CACHE_KEY_FILE
    if marker.is_file():
        try:
            held = json.loads(marker.read_text()).get("corpus_key")
        except (OSError, UnicodeDecodeError, ValueError, AttributeError):
            raise ValueError(f"--cache-dir {folder}: its {CACHE_KEY_FILE} cannot be read; choose another folder or "
                             f"empty it") from None
        if held == corpus_key:
            return
        raise ValueError(f"--cache-dir {folder} holds the cache of other corpus settings (target, format, "
                         f"sequences, seed, ...); choose another folder or empty it")
    if folder.is_dir() and any(folder.glob("*.pt")):
        raise ValueError(f"--cache-dir {folder} holds shards of unknown settings (no {CACHE_KEY_FILE}); choose "
                         f"another folder or empty it")
    write_json_atomic(marker, {"corpus_key": corpus_key})


def answers_key(target: str, dtype: str, spec: CorpusSpec) -> str:
    """The name of a set of the target's answers: the same for every trainer that asks for the same answers."""
    keyed = [target, dtype, spec.answers, spec.answer_tokens, spec.held_out_every, spec.seed, sys.version.split()[0]]
    return hashlib.sha256(json.dumps(keyed).encode()).hexdigest()[:16]


def chat_answers_key(target: str, dtype: str, spec: CorpusSpec) -> str:
    """The name of the target's answers to :func:`~.corpus.chat_prompts`: without the count, since a larger set
    extends a smaller one (the first N answers of any such file are the answers to the first N prompts)."""
    keyed = [target, dtype, "chat", CHAT_PROMPTS_VERSION, spec.answer_tokens, spec.seed, sys.version.split()[0]]
    return "chat-" + hashlib.sha256(json.dumps(keyed).encode()).hexdigest()[:16]


def passage_answers_key(target: str, dtype: str, spec: CorpusSpec) -> str:
    """The name of the target's answers to :func:`~.corpus.passage_prompts`: without the count, as for chat
    answers; the chat answers' key is part of it, since the prompts quote those answers."""
    keyed = [target, dtype, "passage", PASSAGE_PROMPTS_VERSION, chat_answers_key(target, dtype, spec),
             spec.answer_tokens, spec.seed, sys.version.split()[0]]
    return "passage-" + hashlib.sha256(json.dumps(keyed).encode()).hexdigest()[:16]


def answers_elsewhere(key: str) -> list[Path]:
    """Answers files with this key in any trainer's cache or committed with the checkout, the fullest first."""
    found = [path for path in CACHE_HOME.glob(f"*-train/*/answers-{key}/{ANSWERS_FILE}") if path.is_file()]
    committed = CHECKOUT_ANSWERS / f"answers-{key}.jsonl"
    if committed.is_file():
        found.append(committed)
    return sorted(found, key=lambda path: (-path.stat().st_size, str(path)))


def portable_path(path: Path) -> str:
    """``path`` as provenance records it: relative to the checkout for committed answers, ``~/...`` inside the
    home folder, else as given (no machine's absolute layout in a shipped file)."""
    for root, shown in ((CHECKOUT_ANSWERS.parents[1], ""), (Path.home(), "~/")):
        try:
            return shown + path.resolve().relative_to(root.resolve()).as_posix()
        except ValueError:
            continue
    return str(path)


def add_corpus_arguments(parser: argparse.ArgumentParser, defaults: CorpusSettings) -> None:
    """The flags both trainers take, one name each: the target and its dtype, the seed, the corpus and answers
    sizes, the epochs, the peak learning rate and the cache folder (defaults from the trainer's settings)."""
    parser.add_argument("--target", default=defaults.target)
    parser.add_argument("--dtype", default=defaults.dtype,
                        help="the target's dtype while it answers and its states are cached")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--sequences", type=int, default=defaults.sequences,
                        help="standard-library training sequences")
    parser.add_argument("--sequence-tokens", type=int, default=defaults.sequence_tokens)
    parser.add_argument("--held-out-sequences", type=int, default=defaults.held_out_sequences)
    parser.add_argument("--answers", type=int, default=defaults.answers,
                        help="training prompts the target answers itself; its answers join the corpus (0 = none)")
    parser.add_argument("--answer-tokens", type=int, default=defaults.answer_tokens,
                        help="longest answer the target writes per prompt")
    parser.add_argument("--generation-batch", type=int, default=defaults.generation_batch,
                        help="prompts the target answers in one batch")
    parser.add_argument("--pool-answers", type=int, default=defaults.pool_answers,
                        help="the target's stored answers to the prompt pool's first N prompts (written by python -m "
                             "specdemo.training.pool; 0 = none)")
    parser.add_argument("--pool-part", default=defaults.pool_part, metavar="K/P",
                        help="instead of --pool-answers: the stored answers to part K of P of the whole pool (the "
                             "pool shuffled with a fixed seed, then cut; each part mixes every kind of prompt)")
    parser.add_argument("--pool-folder", type=Path, default=defaults.pool_folder,
                        help="where the prompt pool and its answers are stored")
    parser.add_argument("--epochs", type=int, default=defaults.epochs)
    parser.add_argument("--learning-rate", type=float, default=defaults.learning_rate,
                        help="peak learning rate (AdamW)")
    parser.add_argument("--loss-target", default=defaults.loss_target, choices=LOSS_TARGETS,
                        help="what a head learns at each position: the target's greedy token, or its whole "
                             "next-token distribution over the tokens the head scores (EAGLE: prompt pool answers only)")
    parser.add_argument("--cache-dir", type=Path, default=None)


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


def chat_header(tokenizer, user: str) -> list[int]:
    """The token ids of a chat turn's prompt, up to where the assistant's answer begins."""
    if getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template(
            [{"role": "user", "content": user}], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"])
    return list(tokenizer(user + "\n", add_special_tokens=True)["input_ids"])


def build_sequences(tokenizer, spec: CorpusSpec) -> tuple[list[dict], list[dict]]:
    """(training, held-out) sequences: dicts with ``ids`` (header + body), ``answer_start`` and ``file``."""
    base = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_files(base)
    rng = random.Random(spec.seed)
    rng.shuffle(files)
    train: list[dict] = []
    held: list[dict] = []
    for path in files:
        if len(train) >= spec.sequences and len(held) >= spec.held_out_sequences:
            break
        relative = str(path.relative_to(base))
        bucket = held if is_held_out(relative, spec.held_out_every) else train
        wanted = spec.held_out_sequences if bucket is held else spec.sequences
        if len(bucket) >= wanted:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        module = relative[:-3].replace("/", ".")
        user = f"Show me part of the source code of the Python standard library module `{module}`."
        header = chat_header(tokenizer, user) + tokenizer("```python\n", add_special_tokens=False)["input_ids"]
        body = tokenizer(text, add_special_tokens=False)["input_ids"]
        room = spec.sequence_tokens - len(header)
        if room < 16:
            raise ValueError(f"--sequence-tokens {spec.sequence_tokens} leaves no room after the {len(header)}-token "
                             "prompt header")
        if len(body) < room // 2:
            continue  # too short to teach much
        start = rng.randrange(0, max(1, len(body) - room))
        bucket.append({"ids": list(header) + list(body[start : start + room]), "answer_start": len(header),
                       "file": relative})
    return train, held


def _read_answers(path: Path) -> dict[int, dict]:
    done: dict[int, dict] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                done[row["index"]] = row
    return done


@torch.inference_mode()
def generate_answers(loaded: LoadedModel, spec: CorpusSpec, path: Path, start_from: Path | None = None,
                     prompts: list[TrainingPrompt] | None = None) -> list[dict]:
    """The target's own greedy answers to ``prompts`` (by default ``spec.answers`` training prompts), generated in
    batches (left padding) and appended to ``path`` (JSON lines) batch by batch, so a restart carries on where it
    stopped. ``start_from``: another answers file with the same key, copied first when ``path`` does not exist
    yet. Answers the file holds beyond ``prompts`` are kept there and not returned."""
    tokenizer = loaded.tokenizer
    if prompts is None:
        prompts = training_prompts(spec.answers, stdlib_files(), spec.seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    if start_from is not None and not path.is_file():
        shutil.copyfile(start_from, path)
    # only answers to these very prompts count (a stale or foreign row is answered again)
    done = {index: row for index, row in _read_answers(path).items()
            if index < len(prompts) and row.get("prompt") == prompts[index].text}
    headers = [chat_header(tokenizer, prompt.text) for prompt in prompts]
    # similar prompt lengths share a batch (less padding); the index keeps the seeded order
    todo = sorted((i for i in range(len(prompts)) if i not in done), key=lambda i: (len(headers[i]), i))
    with tqdm(total=len(prompts), initial=len(done), desc="target answering training prompts", unit="answer") as bar:
        for start in range(0, len(todo), spec.generation_batch):
            batch = todo[start : start + spec.generation_batch]
            answers = generate_batch(loaded, [headers[i] for i in batch], spec.answer_tokens, loaded.eos_token_ids)
            rows = [{"index": i, "kind": prompts[i].kind, "prompt": prompts[i].text, "answer_ids": answer,
                     "answer": tokenizer.decode(answer, skip_special_tokens=True)}
                    for i, (answer, _) in zip(batch, answers)]
            with path.open("a") as handle:
                for row in rows:
                    handle.write(json.dumps(row) + "\n")
                    done[row["index"]] = row
            bar.update(len(batch))
    return [done[i] for i in range(len(prompts))]


def answer_sequences(tokenizer, answers: list[dict], spec: CorpusSpec) -> tuple[list[dict], list[dict]]:
    """(training, held-out) sequences of prompt + the target's own answer; one prompt in ``held_out_every`` is
    held out."""
    train: list[dict] = []
    held: list[dict] = []
    for row in answers:
        if len(row["answer_ids"]) < 8:
            continue
        header = chat_header(tokenizer, row["prompt"])
        bucket = held if row["index"] % spec.held_out_every == 0 else train
        bucket.append({"ids": header + row["answer_ids"], "answer_start": len(header), "file": row["kind"],
                       "index": row["index"]})
    return train, held


# ----------------------------------------------------------------------------------------------------------------
# shards


def shard_path(folder: Path, name: str, shard: int) -> Path:
    return folder / f"{name}_{shard:04d}.pt"


@torch.inference_mode()
def write_shards(
    sequences: list[dict],
    folder: Path,
    name: str,
    per_sequence: Callable[[dict], dict],
    combine: Callable[[list[dict]], dict],
    desc: str,
) -> None:
    """Store ``combine([per_sequence(s) for s in shard])`` for every shard of :data:`SHARD_SEQUENCES` sequences
    not on disk yet (``<name>_0000.pt``, ...); each file is there whole or not at all."""
    folder.mkdir(parents=True, exist_ok=True)
    shards = math.ceil(len(sequences) / SHARD_SEQUENCES)
    todo = [s for s in range(shards) if not shard_path(folder, name, s).is_file()]
    if not todo:
        return
    with tqdm(total=sum(len(sequences[s * SHARD_SEQUENCES : (s + 1) * SHARD_SEQUENCES]) for s in todo),
              desc=desc, unit="seq") as bar:
        for shard in todo:
            rows = []
            for sequence in sequences[shard * SHARD_SEQUENCES : (shard + 1) * SHARD_SEQUENCES]:
                rows.append(per_sequence(sequence))
                bar.update(1)
            final = shard_path(folder, name, shard)
            partial = final.with_name(final.name + ".partial")
            torch.save(combine(rows), partial)
            partial.rename(final)  # a shard is there whole or not at all


def read_shards(folder: Path, name: str, mmap: bool = False) -> list[dict]:
    """The stored shards of ``name``, in order; with ``mmap`` their tensors are mapped from the files, not read:
    the pages a run touches are read when touched and the system may drop them again (a cache larger than the
    memory)."""
    shards = sorted(folder.glob(f"{name}_*.pt"))
    if not shards:
        raise FileNotFoundError(f"no cached {name} shards in {folder}")
    return [torch.load(path, weights_only=True, mmap=mmap) for path in shards]


# ----------------------------------------------------------------------------------------------------------------
# run steps

#: a trainer's cache of one split: ``cache(sequences, folder, "train" or "heldout")`` stores them in shards
CacheSplit = Callable[[list[dict], Path, str], None]


def cache_splits(cache: CacheSplit, train: list[dict], held: list[dict], folder: Path) -> float:
    """Cache the training and held-out sequences in ``folder``; the seconds it took."""
    started = time.perf_counter()
    cache(train, folder, "train")
    cache(held, folder, "heldout")
    return time.perf_counter() - started


def code_corpus(tokenizer, spec: CorpusSpec, folder: Path, cache: CacheSplit) -> tuple[list[dict], list[dict], float]:
    """The standard-library sequences (:func:`build_sequences`), their files listed in ``folder/corpus.json`` and
    cached there: (training, held-out, seconds caching)."""
    train, held = build_sequences(tokenizer, spec)
    logger.info("corpus: %d training and %d held-out sequences", len(train), len(held))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "corpus.json").write_text(json.dumps({"files": sorted({s["file"] for s in train}),
                                                    "held_out_files": sorted({s["file"] for s in held})}, indent=1))
    return train, held, cache_splits(cache, train, held, folder)


def read_checkpoint(path: Path, key_name: str, key: object) -> dict | None:
    """The checkpoint at ``path`` if there is one and its ``key_name`` entry is ``key`` (the run's settings),
    else None."""
    if not path.is_file():
        return None
    saved = torch.load(path, weights_only=True)
    return saved if saved.get(key_name) == key else None


def save_checkpoint(path: Path, state: dict) -> None:
    """Write a checkpoint whole or not at all."""
    with atomic_path(path) as partial:
        torch.save(state, partial)


def run_record(module: str, settings: CorpusSettings) -> dict:
    """The first entries of a ``training.json``: the command as run and the settings (paths as text, without
    ``extra``)."""
    return {"command": f"python -m {module} " + " ".join(sys.argv[1:]),
            "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(settings).items()
                         if k != "extra"}}


def write_training_json(folder: Path, report: dict) -> None:
    """Write the run's report as ``folder/training.json``."""
    (folder / "training.json").write_text(json.dumps(report, indent=2) + "\n")


#: the answer sets a run may learn from, by their names in ``training.json`` (the Medusa trainer's: ``answers``)
ANSWER_SETS = ("answers", "chat_answers", "passage_answers", "pool_answers")


def trained_positions(record: dict) -> int:
    """The positions a ``training.json`` says its run trained on: the library text's and each answer set's."""
    return int((record.get("corpus") or {}).get("training_positions", 0)) + sum(
        int((record.get(name) or {}).get("training_positions", 0)) for name in ANSWER_SETS)


def weights_digest(weights: Path | None, source: Path) -> str:
    """What names a starting head in a training key: the sha256 of its ``weights`` file (else ``source``, the
    folder as given)."""
    return file_sha256(weights) if weights is not None else str(source)


def lineage(start: Path | None, record: dict) -> list[dict]:
    """Every run that trained the head, first to last: ``start``'s (a head trained further: the lineage its
    ``training.json`` holds, else that run alone), then the run of ``record``; each with its command, head,
    positions, epochs and seconds, so a head trained part by part says what it learned from in all."""
    def summary(run: dict) -> dict:
        return {"command": run.get("command"), "weights_sha256": run.get("weights_sha256"),
                "training_positions": trained_positions(run), "epochs": (run.get("settings") or {}).get("epochs"),
                "train_seconds": (run.get("seconds") or {}).get("train"),
                "cache_seconds": (run.get("seconds") or {}).get("cache")}

    earlier: list[dict] = []
    if start is not None and (Path(start) / "training.json").is_file():
        before = json.loads((Path(start) / "training.json").read_text())
        earlier = before.get("lineage") or [summary(before)]
    return [*earlier, summary(record)]
