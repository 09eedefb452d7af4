"""The target's states over the prompt pool's answers, stored by prompt index and shared by both trainers.

At the pool's scale (millions of positions) a pass of the target costs hours on a CPU: about 3 GFLOP a position,
at the ~250 GFLOP/s a 2-core CPU reaches in bfloat16. The answers' own generation already runs that pass, once per
position, so the pool's answers phase records the states as it writes the answers (:class:`StateRecorder`);
answers written without them (earlier runs, another machine) are filled in by one teacher-forced pass
(:func:`fill_missing`). The EAGLE trainer (:mod:`specdemo.training.eagle`) and the Medusa trainer
(:mod:`specdemo.training.medusa`) read the same files.

Per sequence (the chat header and the answer, as :func:`~.common.answer_sequences` builds it) a file holds the
token ids, the states of the EAGLE layers at every position and the final (post-norm) hidden state from the
answer's first prediction on (bfloat16), and the target's greedy next token from there on (-1 before). Recorded
during generation the last position has no states (the last token is never fed back): zeros there and greedy -1,
so no training row reads it. The folder is named by the answers (target, format, answer length) and the layers,
not by either trainer's settings or a count, so a larger count reads what a smaller one cached. A stored sequence
whose ids differ from the one asked for (a changed tokenizer or chat template) is cached again.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from . import common
from .eagle_unrolled import Split, StateRows

logger = logging.getLogger(__name__)

#: bumped when what a file holds changes
CACHE_FORMAT = 2
#: positions (sequences x the longest, padded) in one teacher-forced pass of :func:`fill_missing`. Batching does
#: not pay at the pool's lengths (about 300 positions a sequence already make tall matrix products): over 48 pool
#: sequences on the AMX Xeon, packed bfloat16, 427 positions/s one at a time, 397 at 2,048, 384 at 4,096, 282 at
#: 8,192; only sequences shorter than half of this go together
FILL_TOKENS = 1024
#: sequences per file written by :func:`fill_missing` (at least)
FILL_SEQUENCES = 16


class Deadline:
    """The end of a run's time budget (None: no budget)."""

    def __init__(self, minutes: float | None) -> None:
        self.at = None if minutes is None else time.monotonic() + 60.0 * minutes

    @property
    def passed(self) -> bool:
        return self.at is not None and time.monotonic() >= self.at

    def leaves(self, seconds: float) -> bool:
        """Whether ``seconds`` more of work end before the deadline (a batch as long as the last one)."""
        return self.at is None or time.monotonic() + seconds <= self.at

    def keep_going(self, last_batch: float) -> bool:
        """Whether another batch as long as the last one (``last_batch`` seconds) ends before the deadline."""
        return not self.passed and self.leaves(last_batch)


class FillStopped(RuntimeError):
    """The time budget ran out while :func:`fill_missing` cached a trainer's states: what was cached is kept, and
    the same command run again goes on from there."""

    def __init__(self, report: "FillReport") -> None:
        super().__init__(f"the time budget ran out while caching the target's states over the pool's answers "
                         f"({report.sequences} of the {report.missing} sequences lacking them cached, and kept): "
                         f"run the same command again to go on")
        self.report = report


def pool_states_folder(answers_name: str, layers: tuple[int, ...]) -> Path:
    """The folder of the states over the stored answers ``answers_name`` with the EAGLE ``layers``, in the user's
    cache (not under a trainer's ``--cache-dir``, which is that trainer's own)."""
    key = hashlib.sha256(json.dumps([CACHE_FORMAT, answers_name, list(layers)]).encode()).hexdigest()[:12]
    return common.CACHE_HOME / "pool-states" / f"{answers_name}-{key}"


# ----------------------------------------------------------------------------------------------------------------
# recording: during generation, or one teacher-forced pass


class StateRecorder:
    """Records, while ``model`` generates a left-padded batch (one pass over the prompts, then one token per pass:
    :func:`~.batch_generation.generate_batch`), the outputs of the EAGLE ``layers`` (indices into
    ``output_hidden_states``: 0 the embeddings, L the final norm's output) and of the final norm; :meth:`sequences`
    assembles them per row. Given as the batch's ``on_pass``, it places a pass over fewer rows (rows that stopped
    left the batch) at those rows' places, zeros elsewhere."""

    def __init__(self, model, layers: tuple[int, ...]) -> None:
        decoder = model.get_decoder()
        count = len(decoder.layers)
        modules = {0: decoder.embed_tokens, count: decoder.norm}
        self.sources = [modules[layer] if layer in modules else decoder.layers[layer - 1] for layer in layers]
        self.sources.append(decoder.norm)
        self.calls: list[list[torch.Tensor]] = [[] for _ in self.sources]
        self.handles: list = []
        self.rows: torch.Tensor | None = None  # the rows of the batch the current pass computes (None: all)
        self.batch_size = 0  # the rows of the batch's first pass

    def __call__(self, rows: torch.Tensor) -> None:
        """Told by the batch which rows its next pass computes."""
        self.rows = rows.cpu()
        self.batch_size = self.batch_size or int(rows.numel())

    def __enter__(self) -> StateRecorder:
        for slot, module in enumerate(self.sources):
            self.handles.append(module.register_forward_hook(self._hook(slot)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _hook(self, slot: int):
        def record(_module, _inputs, output) -> None:
            hidden = (output[0] if isinstance(output, tuple) else output).detach().to(torch.bfloat16).cpu()
            if self.rows is not None and self.rows.numel() < self.batch_size:
                placed = hidden.new_zeros(self.batch_size, *hidden.shape[1:])
                placed[self.rows] = hidden
                hidden = placed
            self.calls[slot].append(hidden)
        return record

    def sequences(self, headers: list[list[int]], continuations: list[list[int]], indexes: list[int]) -> list[dict]:
        """Each row's record (:func:`sequence_record`) from the passes recorded since the last call; cleared."""
        width = max(len(header) for header in headers)
        per_source = [torch.cat(calls, dim=1) for calls in self.calls]  # [B, width + passes after the first, H]
        self.calls = [[] for _ in self.sources]
        self.rows, self.batch_size = None, 0
        records = []
        for row, (header, answer, index) in enumerate(zip(headers, continuations, indexes)):
            fed = len(header) + len(answer) - 1  # positions whose states exist: all but the last token
            start = width - len(header)
            parts = [source[row, start : start + fed] for source in per_source]
            records.append(sequence_record(index, list(header) + list(answer), len(header), parts[:-1], parts[-1],
                                           greedy=torch.tensor(answer, dtype=torch.int32)))
        return records


def sequence_record(index: int, ids: list[int], answer_start: int, layer_states: list[torch.Tensor],
                    final: torch.Tensor, greedy: torch.Tensor) -> dict:
    """One sequence as stored: states [n, k*H] and final [n - answer_start + 1, H] (bfloat16), greedy [n] (int32,
    -1 before the answer's first prediction), zero-padded to the sequence's length where fewer positions were
    computed (their greedy -1)."""
    n, start = len(ids), answer_start - 1  # position start predicts the answer's first token
    states = torch.zeros(n, sum(s.shape[-1] for s in layer_states), dtype=torch.bfloat16)
    computed = torch.cat(layer_states, dim=-1)
    states[: computed.shape[0]] = computed
    finals = torch.zeros(n - start, final.shape[-1], dtype=torch.bfloat16)
    finals[: max(0, final.shape[0] - start)] = final[start:]
    labels = torch.full((n,), -1, dtype=torch.int32)
    labels[start : start + greedy.numel()] = greedy
    return {"index": index, "ids": torch.tensor(ids, dtype=torch.int32), "states": states, "final": finals,
            "greedy": labels, "answer_start": answer_start}


@torch.inference_mode()
def teacher_forced(model, sequence: dict, layers: tuple[int, ...]) -> dict:
    """One pass of the target over a sequence (``index``, ``ids``, ``answer_start``): its record, every position
    computed."""
    return teacher_forced_batch(model, [sequence], layers)[0]


@torch.inference_mode()
def teacher_forced_batch(model, sequences: list[dict], layers: tuple[int, ...]) -> list[dict]:
    """One pass of the target over several sequences at once, right-padded to the longest: each one's record.

    With causal attention a position reads only the positions before it, all of them the sequence's own, so the
    padding after a shorter sequence changes none of its states and no attention mask is needed; the batch only
    makes the matrix products taller (a sum may still round differently than in a pass over one sequence, as in
    any batch of another size)."""
    device = next(model.parameters()).device
    width = max(len(sequence["ids"]) for sequence in sequences)
    inputs = torch.zeros(len(sequences), width, dtype=torch.long)
    for row, sequence in enumerate(sequences):
        inputs[row, : len(sequence["ids"])] = torch.tensor(sequence["ids"], dtype=torch.long)
    out = model.get_decoder()(input_ids=inputs.to(device), output_hidden_states=True)
    head = model.get_output_embeddings()
    records = []
    for row, sequence in enumerate(sequences):
        n, start = len(sequence["ids"]), sequence["answer_start"] - 1
        final = out.last_hidden_state[row, :n]
        greedy = head(final[start:]).argmax(-1).cpu().to(torch.int32)
        records.append(sequence_record(sequence["index"], sequence["ids"], sequence["answer_start"],
                                       [out.hidden_states[layer][row, :n].to(torch.bfloat16).cpu() for layer in layers],
                                       final.to(torch.bfloat16).cpu(), greedy))
    return records


def length_batches(sequences: list[dict], max_tokens: int) -> list[list[dict]]:
    """``sequences`` sorted by length and cut into batches of at most ``max_tokens`` padded positions (a longer
    sequence alone), so that a batch pads little."""
    batches: list[list[dict]] = []
    for sequence in sorted(sequences, key=lambda s: (len(s["ids"]), s["index"])):
        current = batches[-1] if batches else None
        if current and len(sequence["ids"]) * (len(current) + 1) <= max_tokens:
            current.append(sequence)
        else:
            batches.append([sequence])
    return batches


# ----------------------------------------------------------------------------------------------------------------
# the files


def write_records(folder: Path, records: list[dict]) -> Path:
    """Store ``records`` in one new file of ``folder``, there whole or not at all."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"states-{min(r['index'] for r in records):06d}-{time.time_ns()}.pt"
    partial = path.with_name(path.name + ".partial")
    torch.save({
        "indexes": torch.tensor([r["index"] for r in records]),
        "ids": torch.cat([r["ids"] for r in records]), "states": torch.cat([r["states"] for r in records]),
        "greedy": torch.cat([r["greedy"] for r in records]), "final": torch.cat([r["final"] for r in records]),
        "lengths": torch.tensor([len(r["ids"]) for r in records]),
        "answer_starts": torch.tensor([r["answer_start"] for r in records]),
    }, partial)
    partial.rename(path)
    return path


@dataclass
class StoredSequence:
    """One stored sequence's tensors, views into a file mapped from disk."""

    ids: torch.Tensor
    states: torch.Tensor
    greedy: torch.Tensor
    final: torch.Tensor
    answer_start: int


def stored(folder: Path) -> dict[int, StoredSequence]:
    """Every sequence stored in ``folder`` by prompt index (a later file's copy wins), mapped, not read."""
    found: dict[int, StoredSequence] = {}
    for path in sorted(folder.glob("states-*.pt"), key=_written_at):
        try:
            shard = torch.load(path, weights_only=True, mmap=True)
        except Exception as error:  # a torn or foreign file: its sequences are cached again
            logger.warning("ignoring %s: %s", path, error)
            continue
        offset = final_offset = 0
        for index, length, start in zip(shard["indexes"].tolist(), shard["lengths"].tolist(),
                                        shard["answer_starts"].tolist()):
            finals = length - start + 1
            found[index] = StoredSequence(shard["ids"][offset : offset + length],
                                          shard["states"][offset : offset + length],
                                          shard["greedy"][offset : offset + length],
                                          shard["final"][final_offset : final_offset + finals], start)
            offset, final_offset = offset + length, final_offset + finals
    return found


def _written_at(path: Path) -> int:
    """When :func:`write_records` wrote a file (its name's last part, in nanoseconds)."""
    stamp = path.stem.rsplit("-", 1)[-1]
    return int(stamp) if stamp.isdigit() else 0


def _matching(found: dict[int, StoredSequence], sequence: dict) -> bool:
    have = found.get(sequence["index"])
    return have is not None and have.answer_start == sequence["answer_start"] and \
        have.ids.tolist() == list(sequence["ids"])


def fill_missing(model, sequences: Iterable[dict], folder: Path, layers: tuple[int, ...],
                 max_tokens: int = FILL_TOKENS, keep_going: Callable[[float], bool] | None = None) -> FillReport:
    """Cache the states of the ``sequences`` (``index``, ``ids``, ``answer_start``) that ``folder`` lacks, by
    teacher-forced passes over batches of at most ``max_tokens`` positions (:func:`length_batches`), in files of
    at least :data:`FILL_SEQUENCES`. ``keep_going(seconds of the last batch)`` is asked before each batch (None: to
    the end); what was computed is written before it stops."""
    started = time.perf_counter()
    found = stored(folder)
    todo = [sequence for sequence in sequences if not _matching(found, sequence)]
    report = FillReport(missing=len(todo))
    if todo:
        logger.info("%d sequences of the pool's answers have no stored states: caching them", len(todo))
        last_batch, records = 0.0, []
        with tqdm(total=len(todo), desc="caching target states (pool answers)", unit="seq") as bar:
            for batch in length_batches(todo, max_tokens):
                if keep_going is not None and not keep_going(last_batch):
                    break
                batch_started = time.perf_counter()
                records += teacher_forced_batch(model, batch, layers)
                if len(records) >= FILL_SEQUENCES:
                    write_records(folder, records)
                    records = []
                last_batch = time.perf_counter() - batch_started
                report.sequences += len(batch)
                report.positions += sum(len(sequence["ids"]) for sequence in batch)
                bar.update(len(batch))
        if records:
            write_records(folder, records)
    report.seconds = time.perf_counter() - started
    return report


def fill_within(model, sequences: Iterable[dict], folder: Path, layers: tuple[int, ...],
                deadline: Deadline | None) -> "FillReport":
    """:func:`fill_missing` for a trainer, within its time budget: :class:`FillStopped` when ``deadline`` ends it
    before every missing sequence is cached (what was cached is kept)."""
    filled = fill_missing(model, sequences, folder, layers,
                          keep_going=deadline.keep_going if deadline is not None else None)
    if filled.sequences < filled.missing:
        raise FillStopped(filled)
    return filled


def add_time_budget_argument(parser: argparse.ArgumentParser) -> None:
    """A trainer's ``--time-budget-minutes``."""
    parser.add_argument("--time-budget-minutes", type=float, default=None,
                        help="stop once the run has taken this long, in the pool's state fill or in training "
                             "(what was done is kept: a rerun resumes)")


def train_and_print(train: Callable[[object], dict], settings: object, keys: tuple[str, ...]) -> int:
    """A trainer's command line: run ``train(settings)`` and print the report's ``keys``, or the one line saying
    the time budget ended the state fill; 0 either way (a rerun goes on)."""
    try:
        report = train(settings)
    except FillStopped as stopped:
        print(f"stopped: {stopped}")
        return 0
    print(json.dumps({key: report[key] for key in keys}, indent=2))
    return 0


@dataclass
class FillReport:
    """What :func:`fill_missing` did: sequences lacking states, sequences and positions cached, seconds."""

    missing: int = 0
    sequences: int = 0
    positions: int = 0
    seconds: float = 0.0


# ----------------------------------------------------------------------------------------------------------------
# what each trainer reads


def _sequences_in(folder: Path, sequences: list[dict]) -> list[StoredSequence]:
    found = stored(folder)
    missing = [sequence["index"] for sequence in sequences if not _matching(found, sequence)]
    if missing:
        raise ValueError(f"{len(missing)} pool answers have no stored states in {folder} (first: {missing[0]})")
    return [found[sequence["index"]] for sequence in sequences]


def eagle_split(folder: Path, sequences: list[dict]) -> Split:
    """The EAGLE trainer's split of ``sequences``, in their order, its states mapped from the files."""
    rows = _sequences_in(folder, sequences)
    if not rows:
        return Split.empty()
    return Split(torch.cat([r.ids for r in rows]), torch.cat([r.greedy for r in rows]),
                 StateRows([r.states for r in rows]), torch.tensor([len(r.ids) for r in rows]),
                 torch.tensor([r.answer_start for r in rows]), StateRows([r.final for r in rows]))


def final_states(folder: Path, sequences: list[dict]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """What Medusa heads learn from, for ``sequences`` in their order: the final hidden states at every answer
    position [A, H] (bfloat16) and, per sequence, the target's greedy tokens there (from the answer's first
    prediction on, -1 where unknown)."""
    rows = _sequences_in(folder, sequences)
    hidden = torch.cat([r.final for r in rows]) if rows else torch.zeros(0, 0, dtype=torch.bfloat16)
    return hidden, [r.greedy[r.answer_start - 1 :].long() for r in rows]
