"""Build the training pool and the target's answers to it, run by run: ``python -m specdemo.training.pool``.

Four phases, each resumable and each stored under ``assets/training/pool/`` so that a run on another machine
starts from what earlier runs wrote (commit the folder after a run):

1. **templated**: ``--templated N`` prompts (:func:`~.prompt_pool.templated_prompts`), stored once;
2. **requests**: up to ``--requests N`` requests written by the target (:mod:`.magpie`), appended to the pool
   batch by batch when they are not near-identical to a prompt it holds;
3. **answers**: the target's greedy answers (at most ``--answer-tokens``) to every prompt of the pool, in batches of
   ``--batch`` (``auto``: the size that wrote the most tokens per second here, measured first), appended answer
   batch by answer batch to ``answers-TARGET-FORMAT-TOKENS``, sealed into shards of
   :data:`~.row_shards.ROWS_PER_SHARD`. The states the trainers learn from are recorded on the way
   (:mod:`.pool_states`, in the user's cache, about 3 MB an answer; ``--no-states`` skips them), so that no second
   pass of the target over the answers is needed.
4. **states**: the states of stored answers that this machine's cache lacks (answered on another machine, or
   before the recording existed), by teacher-forced passes over batches of similar lengths, so that the trainers
   find them all (else the first trainer run fills them at its start). Skipped with ``--no-states``.

On CPUs with native bfloat16 arithmetic the target's linear layers are packed for oneDNN before the requests and
answers (:mod:`~specdemo.backends.packed_bf16`: bfloat16's answers still, 1.2 times the tokens per second at 64 rows on
the AMX Xeon); the reports say how many layers were.

``--time-budget-minutes`` stops between batches once spent; rerun the command to go on. Each run appends what it
did (phase, machine, seconds, rows, tokens per second) to ``runs.jsonl`` beside the pool, the record
``docs/eagle-training.md`` quotes. Run it alone on the machine: it keeps both cores busy for hours.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import random
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm import tqdm

from ..backends.eagle3_checkpoint import target_facts
from ..backends.eagle3_head import default_hidden_layers
from ..backends.packed_bf16 import PackedBF16Linear, pack_bf16_linears
from .batch_generation import BATCH_SIZES, fastest_batch_size, generate_batch
from .common import chat_header
from .magpie import write_requests
from .pool_states import Deadline, StateRecorder, fill_missing, pool_states_folder, write_records
from .prompt_pool import POOL_FOLDER, PoolPrompt, pool_index, pool_shards, read_pool, store_templated
from .row_shards import RowShards

if TYPE_CHECKING:
    from ..backends.loading import LoadedModel

logger = logging.getLogger(__name__)

#: unanswered prompts looked at together: sorted by length within such a window, so a batch pads little while the
#: answers still come roughly in index order (a stopped run leaves a prefix answered, held-out rows included)
WINDOW_BATCHES = 8
#: a request batch (sampled; most samples are kept): rows cost least at 128 (one token a row after the prompts'
#: pass, bfloat16, 2-core AMD EPYC: 97 rows/s at 128, 83 at 64), and a row that ended leaves its batch
REQUEST_BATCH = 128
#: batches in a row that kept no request before the phase gives up (a model that cannot write requests this way)
MAX_BARREN_BATCHES = 10
#: padded prompt positions in one answer batch: the prompts' pass holds every row's attention scores at once (12
#: heads x width^2 a row); 128 rows of ~1,100 tokens took more than 24 GB on the AMX Xeon and the run was killed
MAX_PROMPT_POSITIONS = 49152
#: states are recorded while the disk keeps this much free (a batch of 64 answers writes about 0.2 GB)
MIN_FREE_BYTES = 8_000_000_000
#: the shuffle that cuts the pool into parts (``--pool-part``): fixed, so part K is the same prompts everywhere
PART_SEED = 0


@dataclass
class PoolSettings:
    target: str = "offline:qwen2.5-coder-1.5b"
    dtype: str = "bfloat16"
    seed: int = 0
    templated: int = 10000
    requests: int = 2500
    answer_tokens: int = 256
    batch: str = "auto"
    time_budget_minutes: float | None = None
    folder: Path = POOL_FOLDER
    phases: tuple[str, ...] = ("templated", "requests", "answers", "states")
    #: record the trainers' states while answering (:mod:`.pool_states`)
    states: bool = True


def answers_name(target: str, fmt: str, answer_tokens: int) -> str:
    """The shard name of the target's answers in a format: ``answers-qwen2.5-coder-1.5b-bfloat16-256``."""
    slug = target.rsplit(":", 1)[-1].rstrip("/").rsplit("/", 1)[-1]
    return f"answers-{slug}-{fmt}-{answer_tokens}"


def answer_shards(settings: PoolSettings, fmt: str | None = None) -> RowShards:
    return RowShards(settings.folder, answers_name(settings.target, fmt or settings.dtype, settings.answer_tokens))


def read_answers(settings: PoolSettings, prompts: list[PoolPrompt]) -> dict[int, dict]:
    """The stored answers to the pool's prompts, by index (an answer to another prompt text is ignored)."""
    return {index: row for index, row in answer_shards(settings).rows().items()
            if index < len(prompts) and row.get("prompt") == prompts[index].text}


def pool_answer_rows(target: str, fmt: str, answer_tokens: int, count: int, folder: Path = POOL_FOLDER,
                     part: str = "") -> list[dict]:
    """The target's stored answers to the pool's first ``count`` prompts, in index order, as the trainers read
    answers (``index``, ``kind``, ``prompt``, ``answer_ids``), or with ``part`` ("K/P") to :func:`part_indexes`'
    prompts of the whole pool; refused in one line when any is missing."""
    settings = PoolSettings(target, fmt, answer_tokens=answer_tokens, folder=folder)
    prompts = read_pool(folder)
    if count > len(prompts):
        raise ValueError(f"the prompt pool holds {len(prompts)} prompts, fewer than the {count} asked for")
    wanted = part_indexes(len(prompts), part) if part else list(range(count))
    answers = read_answers(settings, prompts[: max(wanted, default=-1) + 1])
    missing = [i for i in wanted if i not in answers]
    if missing:
        asked = f"prompts of part {part}" if part else f"first {count} prompts"
        raise ValueError(f"{len(missing)} of the pool's {asked} have no stored answer from {target} in "
                         f"{fmt} (first: {missing[0]}): run python -m specdemo.training.pool --target {target} "
                         f"--dtype {fmt} --phases answers")
    return [answers[i] for i in wanted]


def parse_part(part: str) -> tuple[int, int]:
    """``"K/P"`` as (K, P), refused in one line unless 1 <= K <= P."""
    try:
        number, parts = (int(field) for field in part.split("/"))
    except ValueError:
        raise ValueError(f"--pool-part {part!r}: write K/P, part K of P (for example 1/4)") from None
    if not 1 <= number <= parts:
        raise ValueError(f"--pool-part {part}: K must be 1 to P")
    return number, parts


def part_indexes(size: int, part: str) -> list[int]:
    """The prompt indexes of part K of P of a pool of ``size`` prompts, in index order: the indexes shuffled with
    :data:`PART_SEED` (the same order on every machine and for every trainer), then cut into P runs of nearly
    equal length; each run mixes the pool's kinds as the whole pool does. The cut is of a pool of this size: a
    pool that grows is cut anew."""
    number, parts = parse_part(part)
    order = list(range(size))
    random.Random(PART_SEED).shuffle(order)
    return sorted(order[size * (number - 1) // parts: size * number // parts])


def add_requests(loaded: "LoadedModel", settings: PoolSettings, deadline: Deadline) -> dict:
    """Phase 2: requests written by the target until the pool holds ``settings.requests`` of them."""
    prompts = read_pool(settings.folder)
    index = pool_index(prompts)
    shards = pool_shards(settings.folder)
    have = sum(prompt.kind == "request" for prompt in prompts)
    # where the last run's sampling got to: every batch samples REQUEST_BATCH, kept or not
    sampled = max([int(p.source.rsplit("#", 1)[1]) + 1 for p in prompts if p.kind == "request"], default=0)
    sampled = -(-sampled // REQUEST_BATCH) * REQUEST_BATCH
    started, kept, dropped, barren = time.perf_counter(), 0, 0, 0
    with tqdm(total=settings.requests, initial=have, desc="target writing requests", unit="request") as bar:
        while have < settings.requests and not deadline.passed:
            if barren >= MAX_BARREN_BATCHES:
                raise ValueError(f"the target wrote no usable request in {barren} batches in a row: its chat template "
                                 "may not suit requests written this way")
            written = write_requests(loaded, REQUEST_BATCH, settings.seed, start=sampled)
            rows = []
            for number, (domain, text) in enumerate(written):
                if index.closest(text) is not None:
                    dropped += 1
                    continue
                index.add(text)
                prompt = PoolPrompt("request", f"magpie:{domain}#{sampled + number}", text)
                rows.append(prompt.row(len(prompts)))
                prompts.append(prompt)
            shards.append(rows)
            barren = 0 if rows else barren + 1
            sampled += REQUEST_BATCH
            have += len(rows)
            kept += len(rows)
            bar.update(len(rows))
    shards.seal(only_full=False)
    return {"phase": "requests", "rows": kept, "near_identical_dropped": dropped,
            "seconds": round(time.perf_counter() - started, 1)}


def answer_pool(loaded: "LoadedModel", settings: PoolSettings, deadline: Deadline) -> dict:
    """Phase 3: the target's greedy answers to every prompt of the pool not answered yet."""
    prompts = read_pool(settings.folder)
    done = read_answers(settings, prompts)
    tokenizer = loaded.tokenizer
    todo = [i for i in range(len(prompts)) if i not in done]
    if not todo:
        return {"phase": "answers", "rows": 0, "seconds": 0.0}
    headers = {i: chat_header(tokenizer, prompts[i].text) for i in todo}
    batch, rates = _batch_size(loaded, settings, [headers[i] for i in todo])
    shards = answer_shards(settings)
    stops = loaded.eos_token_ids
    layers = default_hidden_layers(target_facts(loaded).num_layers)
    states_folder = pool_states_folder(answers_name(settings.target, settings.dtype, settings.answer_tokens), layers)
    recorder = StateRecorder(loaded.model, layers) if settings.states and enough_disk(states_folder) else None
    started, written, tokens, last_batch, recorded = time.perf_counter(), 0, 0, 0.0, 0
    with tqdm(total=len(prompts), initial=len(done), desc="target answering the pool", unit="answer") as bar:
        for window_start in range(0, len(todo), batch * WINDOW_BATCHES):
            window = todo[window_start : window_start + batch * WINDOW_BATCHES]
            for chunk in prompt_batches(window, headers, batch):
                if not deadline.keep_going(last_batch):  # a batch as long as the last must fit
                    break
                batch_started = time.perf_counter()
                with recorder or contextlib.nullcontext():
                    answers = generate_batch(loaded, [headers[i] for i in chunk], settings.answer_tokens, stops,
                                             on_pass=recorder)
                shards.append({"index": i, "kind": prompts[i].kind, "prompt": prompts[i].text, "answer_ids": ids}
                              for i, (ids, _) in zip(chunk, answers))
                if recorder is not None:
                    recorder, stored_now = store_states(recorder, states_folder, [headers[i] for i in chunk],
                                                        [ids for ids, _ in answers], chunk)
                    recorded += stored_now
                last_batch = time.perf_counter() - batch_started
                written += len(chunk)
                tokens += sum(len(ids) for ids, _ in answers)
                bar.update(len(chunk))
            if not deadline.keep_going(last_batch):
                break
    shards.seal(only_full=False)  # what this run wrote goes into a shard of its own: nothing is left unsealed
    seconds = time.perf_counter() - started
    return {"phase": "answers", "rows": written, "tokens": tokens, "seconds": round(seconds, 1),
            "tokens_per_s": round(tokens / max(seconds, 1e-9), 1), "batch": batch, "batch_rates": rates,
            "states_recorded": recorded}


def prompt_batches(window: list[int], headers: dict[int, list[int]], batch: int) -> list[list[int]]:
    """The prompt indexes of ``window`` sorted by header length and cut into batches of at most ``batch`` rows and
    :data:`MAX_PROMPT_POSITIONS` padded prompt positions (a longer header alone)."""
    batches: list[list[int]] = []
    for index in sorted(window, key=lambda i: (len(headers[i]), i)):
        current = batches[-1] if batches else None
        if current and len(current) < batch and len(headers[index]) * (len(current) + 1) <= MAX_PROMPT_POSITIONS:
            current.append(index)
        else:
            batches.append([index])
    return batches


def fill_states(loaded: "LoadedModel", settings: PoolSettings, deadline: Deadline) -> dict:
    """Phase 4: the states of the stored answers that this machine's cache lacks (answers written elsewhere or
    before the recording existed), by teacher-forced passes over batches of similar lengths
    (:func:`~.pool_states.fill_missing`), so that the trainers find every state they read."""
    prompts = read_pool(settings.folder)
    answers = read_answers(settings, prompts)
    sequences = []
    for index in sorted(answers):
        header = chat_header(loaded.tokenizer, prompts[index].text)
        sequences.append({"index": index, "ids": header + answers[index]["answer_ids"], "answer_start": len(header)})
    layers = default_hidden_layers(target_facts(loaded).num_layers)
    folder = pool_states_folder(answers_name(settings.target, settings.dtype, settings.answer_tokens), layers)
    filled = fill_missing(loaded.model, sequences, folder, layers,
                          keep_going=lambda last_batch: deadline.keep_going(last_batch) and enough_disk(folder))
    return {"phase": "states", "rows": filled.sequences, "lacking_before": filled.missing,
            "positions": filled.positions, "seconds": round(filled.seconds, 1),
            "positions_per_s": round(filled.positions / max(filled.seconds, 1e-9), 1)}


def store_states(recorder: StateRecorder, folder: Path, headers: list[list[int]], answers: list[list[int]],
                 indexes: list[int]) -> tuple[StateRecorder | None, int]:
    """Write the states ``recorder`` took of a batch (the answers are stored already); the recorder to go on with
    (None once the disk is short or a write failed: the answers go on without states) and how many were written."""
    try:
        write_records(folder, recorder.sequences(headers, answers, indexes))
    except OSError as error:
        logger.warning("could not store the trainers' states (%s): answering on without recording them", error)
        return None, 0
    return (recorder if enough_disk(folder) else None), len(indexes)


def enough_disk(folder: Path) -> bool:
    """Whether the disk holding ``folder`` has room for more states (:data:`MIN_FREE_BYTES`); says so once when
    not."""
    folder.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder).free
    if free < MIN_FREE_BYTES:
        logger.warning("%.1f GB free beside %s: answering on without recording the trainers' states", free / 1e9,
                       folder)
    return free >= MIN_FREE_BYTES


def _batch_size(loaded: "LoadedModel", settings: PoolSettings, headers: list[list[int]]) -> tuple[int, dict]:
    """``--batch``, or with ``auto`` the batch size measured fastest on this machine in this format: by an earlier
    run (``runs.jsonl``) that timed every size of :data:`BATCH_SIZES`, else now (a few minutes)."""
    if settings.batch != "auto":
        return int(settings.batch), {}
    earlier = [run for run in _runs(settings) if run.get("phase") == "answers"
               and {str(size) for size in BATCH_SIZES} <= set(run.get("batch_rates") or {})
               and run.get("machine") == machine() and run.get("format") == settings.dtype
               and bool(run.get("packed_bf16_layers")) == _has_packed_layers(loaded)]
    if earlier:
        rates = earlier[-1]["batch_rates"]
        batch = int(max(rates, key=rates.__getitem__))
        logger.info("answering in batches of %d, measured fastest on this machine by the run of %s", batch,
                    earlier[-1].get("time"))
        return batch, {}
    batch, rates = fastest_batch_size(loaded, headers)
    logger.info("answering in batches of %d (tokens per second by batch size: %s)", batch,
                ", ".join(f"{size}: {rate:.1f}" for size, rate in rates.items()))
    return batch, {str(size): round(rate, 1) for size, rate in rates.items()}


def _has_packed_layers(loaded: "LoadedModel") -> bool:
    return any(isinstance(module, PackedBF16Linear) for module in loaded.model.modules())


def machine() -> str:
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            name = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), name)
    except OSError:
        pass
    return f"{name} ({os.cpu_count()} cores)"


def _runs(settings: PoolSettings) -> list[dict]:
    path = settings.folder / "runs.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def record_run(settings: PoolSettings, phase_report: dict) -> None:
    """Append a phase's report to ``runs.jsonl`` beside the pool."""
    entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine(), "target": settings.target,
             "format": settings.dtype, "command": "python -m specdemo.training.pool " + " ".join(sys.argv[1:]),
             **phase_report}
    settings.folder.mkdir(parents=True, exist_ok=True)
    with (settings.folder / "runs.jsonl").open("a", encoding="utf-8") as handle:
        handle.write(json.dumps(entry) + "\n")


def build(settings: PoolSettings) -> list[dict]:
    """Run the phases asked for, in order, within the time budget; each phase's report."""
    from ..backends.loading import LoadSettings, load_model

    deadline = Deadline(settings.time_budget_minutes)
    reports = []
    if "templated" in settings.phases:
        started = time.perf_counter()
        before = len(read_pool(settings.folder))
        prompts = store_templated(settings.templated, settings.seed, settings.folder)
        if len(prompts) > before:
            reports.append({"phase": "templated", "rows": len(prompts) - before,
                            "seconds": round(time.perf_counter() - started, 1)})
    if not {"requests", "answers", "states"} & set(settings.phases):
        return reports
    loaded = load_model(settings.target, LoadSettings(dtype=settings.dtype), progress=True)
    packed = pack_bf16_linears(loaded.model) if loaded.device.type == "cpu" else 0
    if "requests" in settings.phases and not deadline.passed:
        reports.append(add_requests(loaded, settings, deadline))
    if "answers" in settings.phases and not deadline.passed:
        reports.append(answer_pool(loaded, settings, deadline))
    if "states" in settings.phases and settings.states and not deadline.passed:
        reports.append(fill_states(loaded, settings, deadline))
    for report in reports:
        if report["phase"] != "templated":
            report["packed_bf16_layers"] = packed
    return reports


def main(argv: list[str] | None = None) -> int:
    defaults = PoolSettings()
    parser = argparse.ArgumentParser(prog="python -m specdemo.training.pool", description=__doc__.split("\n")[0])
    parser.add_argument("--target", default=defaults.target)
    parser.add_argument("--dtype", default=defaults.dtype, help="the target's number format while answering")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--templated", type=int, default=defaults.templated, help="templated prompts in the pool")
    parser.add_argument("--requests", type=int, default=defaults.requests,
                        help="requests written by the target in the pool")
    parser.add_argument("--answer-tokens", type=int, default=defaults.answer_tokens)
    parser.add_argument("--batch", default=defaults.batch, help="prompts answered at once, or auto (measured)")
    parser.add_argument("--time-budget-minutes", type=float, default=None)
    parser.add_argument("--folder", type=Path, default=defaults.folder, help="where the pool is stored")
    parser.add_argument("--phases", default=",".join(defaults.phases),
                        help="which of templated, requests, answers, states to run (comma-separated)")
    parser.add_argument("--no-states", action="store_false", dest="states",
                        help="answer without recording the states the trainers learn from (about 3 MB an answer)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    phases = tuple(p.strip() for p in args.phases.split(",") if p.strip())
    unknown = set(phases) - set(defaults.phases)
    if unknown or (args.batch != "auto" and not args.batch.isdigit()):
        print(f"error: unknown phases {sorted(unknown)}" if unknown else "error: --batch takes a number or auto",
              file=sys.stderr)
        return 2
    settings = PoolSettings(args.target, args.dtype, args.seed, args.templated, args.requests, args.answer_tokens,
                            args.batch, args.time_budget_minutes, args.folder, phases, args.states)
    try:
        reports = build(settings)
    except (ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for report in reports:
        record_run(settings, report)
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
