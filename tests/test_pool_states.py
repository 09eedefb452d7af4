"""The states over the pool's answers: recorded while answering, filled in by one pass where missing, read by both
trainers (a tiny target, float32, CPU)."""

from __future__ import annotations

import pytest
import torch
from tiny import save_tiny_pair

from specdemo.backends.eagle3_checkpoint import target_facts
from specdemo.backends.eagle3_head import default_hidden_layers
from specdemo.backends.loading import LoadSettings, load_model
from specdemo.training import common, eagle, medusa, pool
from specdemo.training.batch_generation import generate_batch
from specdemo.training.common import answer_sequences, chat_header
from specdemo.training.pool_states import (
    StateRecorder,
    eagle_split,
    fill_missing,
    final_states,
    pool_states_folder,
    stored,
    length_batches,
    teacher_forced,
    teacher_forced_batch,
    write_records,
)
from specdemo.training.prompt_pool import PoolPrompt, pool_shards

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("pair"))[0]


def test_states_recorded_while_generating_a_padded_batch_are_the_teacher_forced_ones(target, tmp_path):
    loaded = load_model(target, LoadSettings(dtype="float32"))
    layers = default_hidden_layers(target_facts(loaded).num_layers)
    headers = [chat_header(loaded.tokenizer, text) for text in ("Hi.", "Name three rivers of Europe, please.")]
    recorder = StateRecorder(loaded.model, layers)
    with recorder:
        answers = generate_batch(loaded, headers, 12, loaded.eos_token_ids, min_new_tokens=3, on_pass=recorder)
    assert not recorder.handles  # the hooks are gone once the batch is written
    records = recorder.sequences(headers, [ids for ids, _ in answers], [7, 9])
    for header, (answer, _), record in zip(headers, answers, records):
        ids = header + answer
        n, start = len(ids), len(header) - 1
        forced = teacher_forced(loaded.model, {"index": record["index"], "ids": ids, "answer_start": len(header)},
                                layers)
        assert record["ids"].tolist() == ids and record["states"].shape == forced["states"].shape
        # every position but the last was computed; the last is never fed back, so it is empty and unlabelled
        assert torch.allclose(record["states"][: n - 1].float(), forced["states"][: n - 1].float(), atol=2e-2)
        assert not record["states"][n - 1].any() and int(record["greedy"][n - 1]) == -1
        assert record["greedy"][start : n - 1].tolist() == answer == forced["greedy"][start : n - 1].tolist()
        assert torch.allclose(record["final"][:-1].float(), forced["final"][:-1].float(), atol=2e-2)
    assert [r["index"] for r in records] == [7, 9]
    # stored and read back by index, a sequence whose ids changed counts as missing
    folder = tmp_path / "states"
    write_records(folder, records)
    found = stored(folder)
    assert sorted(found) == [7, 9] and torch.equal(found[9].states, records[1]["states"])
    sequence = {"index": 9, "ids": headers[1] + answers[1][0], "answer_start": len(headers[1])}
    assert fill_missing(loaded.model, [sequence], folder, layers).missing == 0 and len(list(folder.glob("*.pt"))) == 1
    changed = {**sequence, "ids": sequence["ids"][:-1]}
    fill_missing(loaded.model, [changed, {**changed, "index": 2}], folder, layers)  # a file named from index 2
    assert len(list(folder.glob("*.pt"))) == 2 and stored(folder)[9].ids.tolist() == changed["ids"]


def test_rows_that_stopped_leave_the_batch_and_every_row_is_what_generate_writes(target):
    """A greedy batch drops the rows that stopped (their cache rows too): every continuation is still the one
    transformers' generate writes, and the states recorded at the remaining rows' places are the teacher-forced
    ones."""
    loaded = load_model(target, LoadSettings(dtype="float32"))
    layers = default_hidden_layers(target_facts(loaded).num_layers)
    texts = ("Hi.", "Name three rivers of Europe, please.", "Sort a list in Python.", "Why is the sky blue?")
    headers = [chat_header(loaded.tokenizer, text) for text in texts]
    unstopped = generate_batch(loaded, headers, 10, [])
    stop = unstopped[0][0][3]  # a token the first row writes fourth: that row stops early, others later or never
    reference = _generate(loaded, headers, 10, stop)
    recorder = StateRecorder(loaded.model, layers)
    passes: list[int] = []

    def observe(rows: torch.Tensor) -> None:
        passes.append(rows.numel())
        recorder(rows)

    with recorder:
        answers = generate_batch(loaded, headers, 10, [stop], on_pass=observe)
    assert answers == reference and answers[0] == (unstopped[0][0][:4], True)
    assert passes[0] == len(headers) and min(passes) < len(headers)  # the batch shrank
    records = recorder.sequences(headers, [ids for ids, _ in answers], [0, 1, 2, 3])
    for header, (answer, _), record in zip(headers, answers, records):
        ids, n = header + answer, len(header) + len(answer)
        forced = teacher_forced(loaded.model, {"index": 0, "ids": ids, "answer_start": len(header)}, layers)
        assert torch.allclose(record["states"][: n - 1].float(), forced["states"][: n - 1].float(), atol=2e-2)
        assert record["greedy"][len(header) - 1 : n - 1].tolist() == answer


def _generate(loaded, headers: list[list[int]], max_new_tokens: int, stop: int) -> list[tuple[list[int], bool]]:
    """transformers' greedy generate over the left-padded headers, each row cut after ``stop``."""
    width = max(len(h) for h in headers)
    ids = torch.tensor([[0] * (width - len(h)) + h for h in headers])
    mask = torch.tensor([[0] * (width - len(h)) + [1] * len(h) for h in headers])
    out = loaded.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                                eos_token_id=[stop], pad_token_id=0)
    rows = []
    for row in out[:, width:].tolist():
        cut = row.index(stop) + 1 if stop in row else len(row)
        rows.append((row[:cut], stop in row))
    return rows


def test_a_right_padded_batch_gives_each_sequence_its_own_pass_and_the_fill_stops_when_told(target, tmp_path):
    loaded = load_model(target, LoadSettings(dtype="float32"))
    layers = default_hidden_layers(target_facts(loaded).num_layers)
    texts = ("Hi.", "Name three rivers of Europe, please.", "Sort a list in Python.", "Why is the sky blue?")
    sequences = []
    for index, text in enumerate(texts):
        header = chat_header(loaded.tokenizer, text)
        sequences.append({"index": index, "ids": header + [5 + index] * (3 + 4 * index), "answer_start": len(header)})
    batched = teacher_forced_batch(loaded.model, sequences, layers)
    for sequence, record in zip(sequences, batched):
        alone = teacher_forced(loaded.model, sequence, layers)
        assert record["ids"].tolist() == sequence["ids"] and record["states"].shape == alone["states"].shape
        assert torch.allclose(record["states"], alone["states"], atol=1e-5)  # float32: only the sums' order differs
        assert torch.allclose(record["final"], alone["final"], atol=1e-5)
        assert torch.equal(record["greedy"], alone["greedy"])
    # batches sorted by length, none over the budget of padded positions (a longer sequence alone)
    lengths = sorted(len(s["ids"]) for s in sequences)
    batches = length_batches(sequences, 2 * lengths[1])
    assert [len(s["ids"]) for b in batches for s in b] == lengths
    assert all(len(b) == 1 or len(b) * max(len(s["ids"]) for s in b) <= 2 * lengths[1] for b in batches)
    asked: list[float] = []

    def one_batch(last_batch: float) -> bool:
        asked.append(last_batch)
        return len(asked) == 1

    report = fill_missing(loaded.model, sequences, tmp_path / "states", layers, max_tokens=2 * lengths[1],
                          keep_going=one_batch)
    assert report.missing == 4 and report.sequences == len(batches[0]) < 4 and asked[0] == 0.0
    assert sorted(stored(tmp_path / "states")) == sorted(s["index"] for s in batches[0])


def test_the_pools_states_phase_fills_what_the_cache_lacks(target, tmp_path, monkeypatch):
    monkeypatch.setattr(common, "CACHE_HOME", tmp_path / "home")
    folder = tmp_path / "pool"
    prompts = [PoolPrompt("question", f"man:tool{i}.1", f"What does tool {i} print?") for i in range(4)]
    pool_shards(folder).append(prompt.row(i) for i, prompt in enumerate(prompts))
    common_args = ["--target", target, "--dtype", "float32", "--answer-tokens", "12", "--batch", "2", "--folder",
                   str(folder)]
    assert pool.main([*common_args, "--phases", "answers", "--no-states"]) == 0
    assert not (tmp_path / "home" / "pool-states").exists()
    assert pool.main([*common_args, "--phases", "states"]) == 0
    recorded = sorted((tmp_path / "home" / "pool-states").glob("*/*.pt"))
    assert sorted(stored(recorded[0].parent)) == [0, 1, 2, 3]
    report = pool._runs(pool.PoolSettings(folder=folder))[-1]
    assert report["phase"] == "states" and report["rows"] == report["lacking_before"] == 4
    assert pool.main([*common_args, "--phases", "states"]) == 0  # nothing left: no file written
    assert sorted((tmp_path / "home" / "pool-states").glob("*/*.pt")) == recorded


def test_the_pools_answers_phase_records_the_states_both_trainers_read(target, tmp_path, monkeypatch):
    monkeypatch.setattr(common, "CACHE_HOME", tmp_path / "home")
    folder = tmp_path / "pool"
    prompts = [PoolPrompt("question", f"man:tool{i}.1", f"What does tool {i} do with files?") for i in range(6)]
    # the first three answered without states (an earlier run, another machine), the next three with them
    pool_shards(folder).append(prompt.row(i) for i, prompt in enumerate(prompts[:3]))
    assert pool.main(["--target", target, "--dtype", "float32", "--answer-tokens", "24", "--batch", "3", "--folder",
                      str(folder), "--phases", "answers", "--no-states"]) == 0
    answered = len(pool.read_answers(pool.PoolSettings(target, "float32", answer_tokens=24, folder=folder), prompts))
    assert answered == 3 and not (tmp_path / "home" / "pool-states").exists()
    pool_shards(folder).append(prompt.row(i) for i, prompt in enumerate(prompts) if i >= 3)
    assert pool.main(["--target", target, "--dtype", "float32", "--answer-tokens", "24", "--batch", "3", "--folder",
                      str(folder), "--phases", "answers"]) == 0
    states = tmp_path / "home" / "pool-states"
    recorded = sorted(states.glob("*/*.pt"))
    assert len(recorded) == 1 and sorted(stored(recorded[0].parent)) == [3, 4, 5]
    shared = dict(target=target, dtype="float32", sequences=2, sequence_tokens=256, held_out_sequences=1,
                  answer_tokens=24, held_out_every=4, pool_answers=6, pool_folder=folder)
    eagle_report = eagle.train(eagle.TrainSettings(**shared, out=tmp_path / "head", cache_dir=tmp_path / "eagle",
                                                   answers=0, epochs=1, steps_unrolled=2, draft_vocab_size=64,
                                                   batch_tokens=300, warmup_steps=2))
    filled = sorted(states.glob("*/*.pt"))
    assert len(filled) == 2 and sorted(stored(filled[0].parent)) == list(range(6))  # the missing three, once
    assert eagle_report["pool_answers"]["training_positions"] > 0
    written = {path: path.stat().st_mtime_ns for path in filled}
    medusa_report = medusa.train(medusa.TrainSettings(**shared, out=tmp_path / "heads", cache_dir=tmp_path / "medusa",
                                                      num_heads=2, head_tokens=0, epochs=1, batch_size=64))
    assert {path: path.stat().st_mtime_ns for path in sorted(states.glob("*/*.pt"))} == written  # read, not redone
    assert len(medusa_report["answers"]["held_out_top1_per_head"]) == 2
    # what each trainer reads is its own pass's: EAGLE's split and Medusa's labels
    loaded = load_model(target, LoadSettings(dtype="float32"))
    layers = default_hidden_layers(target_facts(loaded).num_layers)
    rows = pool.pool_answer_rows(target, "float32", 24, 6, folder)
    train_seqs, _ = answer_sequences(loaded.tokenizer, rows, medusa.TrainSettings(**shared).corpus_spec())
    where = pool_states_folder(pool.answers_name(target, "float32", 24), layers)
    split = eagle_split(where, train_seqs)
    assert split.ids.tolist() == [token for sequence in train_seqs for token in sequence["ids"]]
    hidden, greedy = final_states(where, train_seqs)
    assert hidden.shape[0] == sum(len(s["ids"]) - s["answer_start"] + 1 for s in train_seqs)
    assert [g.numel() for g in greedy] == [len(s["ids"]) - s["answer_start"] + 1 for s in train_seqs]


def test_a_failed_states_write_keeps_the_answers_and_answers_on_without_states(target, tmp_path, monkeypatch, caplog):
    folder = tmp_path / "pool"
    prompts = [PoolPrompt("question", f"man:tool{i}.1", f"Why does tool {i} lock files?") for i in range(4)]
    pool_shards(folder).append(prompt.row(i) for i, prompt in enumerate(prompts))

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pool, "write_records", full_disk)
    assert pool.main(["--target", target, "--dtype", "float32", "--answer-tokens", "8", "--batch", "2", "--folder",
                      str(folder), "--phases", "answers"]) == 0
    answers = pool.read_answers(pool.PoolSettings(target, "float32", answer_tokens=8, folder=folder), prompts)
    assert sorted(answers) == [0, 1, 2, 3]  # every batch answered and kept
    assert "answering on without recording them" in caplog.text
