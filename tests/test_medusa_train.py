"""The Medusa trainer on a tiny target: corpus, cache, training, held-out accuracy, written heads, restart."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import torch
from tiny import reference_greedy, save_tiny_pair

from specdemo.backends.medusa_checkpoint import load_heads
from specdemo.training.common import stdlib_files
from specdemo.training.corpus import training_prompts
from specdemo.training.medusa import TrainSettings, labels_for, train


def test_labels_are_the_targets_own_greedy_tokens_further_ahead():
    greedy = torch.tensor([10, 11, 12, 13])
    labels = labels_for(greedy, 3)
    assert labels.tolist() == [[11, 12, 13, -1], [12, 13, -1, -1], [13, -1, -1, -1]]


def test_the_corpus_is_the_standard_library_and_never_the_benchmark_prompts():
    files = stdlib_files()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    assert len(files) > 300
    assert all(stdlib in path.parents for path in files)
    assert not any(part in {"test", "site-packages", "idlelib"} for path in files for part in path.parts[-3:-1])
    assert not any(path.name in {"prompts.jsonl", "question.jsonl"} for path in files)


def test_training_writes_loadable_heads_with_provenance_and_restarts_from_its_cache(tmp_path):
    target, _ = save_tiny_pair(tmp_path / "pair")
    settings = TrainSettings(
        target=target, out=tmp_path / "heads", num_heads=2, head_tokens=200, sequences=4, sequence_tokens=256,
        held_out_sequences=2, epochs=2, batch_size=32, dtype="float32", cache_dir=tmp_path / "cache",
    )
    report = train(settings)
    assert len(report["held_out_top1_per_head"]) == 2
    assert all(0.0 <= a <= 1.0 for a in report["held_out_top1_per_head"])
    assert report["corpus"]["training_sequences"] == 4 and report["corpus"]["held_out_sequences"] == 2
    written = json.loads((tmp_path / "heads" / "training.json").read_text())
    heads = load_heads(tmp_path / "heads", 64, 320, expected_sha256=written["weights_sha256"])
    assert heads.config.num_heads == 2 and heads.config.head_tokens == 200
    config = json.loads((tmp_path / "heads" / "config.json").read_text())
    assert config["base_model_name_or_path"] == target and config["torch_dtype"] == "bfloat16"
    # a second run finds the cached states and the last epoch's checkpoint: nothing is computed again
    cached = {path: path.stat().st_mtime_ns for path in (tmp_path / "cache").glob("*.pt")}
    again = train(settings)
    assert {path: path.stat().st_mtime_ns for path in (tmp_path / "cache").glob("*.pt")} == cached
    assert again["weights_sha256"] == report["weights_sha256"]


def test_training_prompts_mix_every_kind_from_offline_material_and_are_seeded():
    files = stdlib_files()
    prompts = training_prompts(70, files, seed=3)
    assert len(prompts) == 70 and len({p.text for p in prompts}) == 70
    kinds = {p.kind for p in prompts}
    assert kinds == {"code editing", "code writing", "math", "question", "summary", "translation", "writing"}
    assert all(sum(p.kind == kind for p in prompts) == 10 for kind in kinds)
    assert training_prompts(70, files, seed=3) == prompts
    assert training_prompts(70, files, seed=4) != prompts
    edited = next(p.text for p in prompts if p.kind == "code editing")
    assert "```python\ndef " in edited  # a whole function, its first line dedented like the rest


def test_the_target_answers_prompts_itself_and_its_answers_join_the_corpus(tmp_path):
    target, _ = save_tiny_pair(tmp_path / "pair")
    settings = TrainSettings(
        target=target, out=tmp_path / "heads", num_heads=2, head_tokens=0, sequences=2, sequence_tokens=256,
        held_out_sequences=1, epochs=1, batch_size=64, dtype="float32", cache_dir=tmp_path / "cache",
        answers=12, answer_tokens=24, generation_batch=5, held_out_every=4,
    )
    report = train(settings)
    rows = [json.loads(line) for line in (settings.answers_path() / "answers.jsonl").read_text().splitlines()]
    assert sorted(r["index"] for r in rows) == list(range(12))
    # each answer is the target's own greedy continuation of its prompt, batched with left padding or not
    from specdemo.backends.loading import LoadSettings, load_model

    loaded = load_model(target, LoadSettings(dtype="float32"))
    for row in rows[:3]:
        header = loaded.tokenizer.apply_chat_template(
            [{"role": "user", "content": row["prompt"]}], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        alone = reference_greedy(loaded.model, list(header), 24, eos=[loaded.tokenizer.eos_token_id])
        assert row["answer_ids"] == alone
    answers = report["answers"]
    assert answers["training_sequences"] + answers["held_out_sequences"] <= 12
    assert answers["held_out_sequences"] == sum(1 for r in rows if r["index"] % 4 == 0 and len(r["answer_ids"]) >= 8)
    assert len(answers["held_out_top1_per_head"]) == 2
    # a rerun generates nothing again
    before = (settings.answers_path() / "answers.jsonl").stat().st_mtime_ns
    train(settings)
    assert (settings.answers_path() / "answers.jsonl").stat().st_mtime_ns == before


def answered_pool_settings(tmp_path: Path, prompts: list, **changes) -> TrainSettings:
    """A pool of ``prompts`` in ``tmp_path / "pool"``, answered by a tiny target (states recorded), and settings
    that train two heads on the first six stored answers and two library sequences."""
    from specdemo.training import pool
    from specdemo.training.prompt_pool import pool_shards

    target, _ = save_tiny_pair(tmp_path / "pair")
    folder = tmp_path / "pool"
    pool_shards(folder).append(prompt.row(i) for i, prompt in enumerate(prompts))
    assert pool.main(["--target", target, "--dtype", "float32", "--answer-tokens", "24", "--batch", "3", "--folder",
                      str(folder), "--phases", "answers"]) == 0
    return TrainSettings(
        target=target, out=tmp_path / "heads", num_heads=2, head_tokens=0, sequences=2, sequence_tokens=256,
        held_out_sequences=1, epochs=1, batch_size=64, dtype="float32", cache_dir=tmp_path / "cache",
        answer_tokens=24, held_out_every=4, pool_answers=6, pool_folder=folder, **changes,
    )


def test_the_pools_stored_answers_train_the_heads_instead_of_generated_ones(tmp_path):
    import pytest

    from specdemo.training.prompt_pool import PoolPrompt

    settings = answered_pool_settings(
        tmp_path, [PoolPrompt("summary", f"man:tool{i}.1", f"Summarize: tool {i} copies files quickly.") for i in range(6)])
    report = train(settings)
    answers = report["answers"]
    assert answers["prompts_per_kind"] == {"summary": 6} and len(answers["held_out_top1_per_head"]) == 2
    assert answers["training_sequences"] + answers["held_out_sequences"] <= 6
    assert not settings.answers_path().exists()  # nothing generated: the pool's answers were read
    with pytest.raises(ValueError, match="choose one"):
        train(TrainSettings(**{**settings.__dict__, "answers": 4}))
    # half of the pool, trained further from those heads: the starting heads measured on the same held-out text
    part = train(TrainSettings(**{**settings.__dict__, "pool_answers": 0, "pool_part": "1/2", "out": tmp_path / "p",
                                  "init_from": settings.out, "sequences": 0, "cache_dir": tmp_path / "c0"}))
    assert part["corpus"]["training_positions"] == 0  # no library text: the answers alone
    assert part["answers"]["training_sequences"] + part["answers"]["held_out_sequences"] <= 3  # half of the six
    assert part["held_out_at_start"].keys() == {"standard_library", "answers"} and "held_out_at_start" not in report
    assert len(part["held_out_at_start"]["answers"]) == 2
    assert [run["weights_sha256"] for run in part["lineage"]] == [report["weights_sha256"], part["weights_sha256"]]
    train(TrainSettings(**{**settings.__dict__, "num_heads": 1, "out": tmp_path / "one", "cache_dir": tmp_path / "c1"}))
    with pytest.raises(ValueError, match="1 heads scoring 0 tokens, these settings train 2 scoring 0"):
        train(TrainSettings(**{**settings.__dict__, "init_from": tmp_path / "one"}))



def test_a_time_budget_stops_in_the_state_fill_or_in_training_and_the_same_command_ends_as_one_run_would(
        tmp_path, monkeypatch, capsys):
    import pytest

    from specdemo.training import common, medusa, pool, pool_states
    from specdemo.training.prompt_pool import PoolPrompt, pool_shards

    monkeypatch.setattr(common, "CACHE_HOME", tmp_path / "home")
    target, _ = save_tiny_pair(tmp_path / "pair")
    folder = tmp_path / "pool"
    prompts = [PoolPrompt("request", f"magpie:test#{i}", f"Tell me fact number {i} about the sea.") for i in range(8)]
    pool_shards(folder).append(prompt.row(i) for i, prompt in enumerate(prompts))
    assert pool.main(["--target", target, "--dtype", "float32", "--answer-tokens", "24", "--batch", "4", "--folder",
                      str(folder), "--phases", "answers", "--no-states"]) == 0  # answers whose states the run fills
    settings = TrainSettings(
        target=target, out=tmp_path / "heads", num_heads=2, head_tokens=0, sequences=0, held_out_sequences=1,
        epochs=2, batch_size=16, dtype="float32", cache_dir=tmp_path / "cache", answer_tokens=24, held_out_every=4,
        pool_answers=7, pool_folder=folder, time_budget_minutes=60.0,
    )
    real_batch, real_step = pool_states.teacher_forced_batch, medusa.train_step
    budget_passed = pool_states.Deadline.passed
    calls = {"fill": 0, "step": 0}

    def ends_after(kind: str, count: int, real):
        def counted(*args):
            calls[kind] += 1
            if calls[kind] == count:
                monkeypatch.setattr(pool_states.Deadline, "passed", property(lambda self: True))
            return real(*args)
        return counted

    # the budget ends after the second of seven fill passes: what was cached is kept, nothing trained or written
    monkeypatch.setattr(pool_states, "length_batches", lambda sequences, max_tokens: [[s] for s in sequences])
    monkeypatch.setattr(pool_states, "teacher_forced_batch", ends_after("fill", 2, real_batch))
    with pytest.raises(pool_states.FillStopped, match="2 of the 7 sequences lacking them cached"):
        train(settings)
    (states,) = (tmp_path / "home" / "pool-states").iterdir()
    assert len(pool_states.stored(states)) == 2 and not settings.out.exists()
    # again: the other five filled, then the budget ends after the third optimizer step of the first epoch
    monkeypatch.setattr(pool_states.Deadline, "passed", budget_passed)
    monkeypatch.setattr(medusa, "train_step", ends_after("step", 3, real_step))
    stopped = train(settings)
    assert calls == {"fill": 7, "step": 3} and not stopped["complete"]
    # again: on from the fourth step, to the end; the heads are those of one uninterrupted run
    monkeypatch.setattr(pool_states.Deadline, "passed", budget_passed)
    monkeypatch.setattr(medusa, "train_step", real_step)
    resumed = train(settings)
    uninterrupted = train(TrainSettings(**{**settings.__dict__, "out": tmp_path / "one", "cache_dir": tmp_path / "c1",
                                           "time_budget_minutes": None}))
    assert resumed["complete"] and uninterrupted["complete"]
    assert resumed["weights_sha256"] == uninterrupted["weights_sha256"] != stopped["weights_sha256"]
    monkeypatch.setattr(medusa, "train", lambda settings: (_ for _ in ()).throw(pool_states.FillStopped(
        pool_states.FillReport(missing=7, sequences=2))))
    capsys.readouterr()
    assert medusa.main(["--out", str(tmp_path / "cli")]) == 0  # the command line says so in one line
    assert capsys.readouterr().out.startswith("stopped: the time budget ran out while caching")


def test_each_head_can_learn_the_distribution_its_label_was_written_from(tmp_path):
    """``--loss-target distribution``: head k's label at a cached position t is the target's argmax over its final
    state at t + k of the same flat cache (library text and pool answers alike): the state the loss reads there."""
    import pytest

    from specdemo.training.medusa import cache_corpus, load_states
    from specdemo.training.prompt_pool import PoolPrompt

    settings = answered_pool_settings(
        tmp_path, [PoolPrompt("request", f"magpie:test#{i}", f"Name {i} birds of the coast.") for i in range(6)],
        loss_target="distribution")
    report = train(settings)
    assert report["settings"]["loss_target"] == "distribution" and all(v > 0 for v in report["last_train_loss_per_head"])
    greedy = train(TrainSettings(**{**settings.__dict__, "loss_target": "greedy", "out": tmp_path / "greedy"}))
    assert greedy["weights_sha256"] != report["weights_sha256"]
    corpus = cache_corpus(settings)
    states = load_states(settings, corpus)
    for k in (1, 2):
        (at,) = (states.labels[k - 1] >= 0).nonzero(as_tuple=True)
        written = (states.hidden[at + k].float() @ corpus.weight.float().T).argmax(-1)
        assert at.numel() > 100 and float((written == states.labels[k - 1, at]).float().mean()) > 0.99
    with pytest.raises(ValueError, match="--loss-target soft: greedy or distribution"):
        train(TrainSettings(**{**settings.__dict__, "loss_target": "soft"}))


def test_a_cache_dir_of_other_corpus_settings_is_refused_before_anything_loads(tmp_path):
    import dataclasses

    import pytest

    from specdemo.training import eagle

    settings = TrainSettings(target="no-such-model", out=tmp_path / "heads", sequences=2, cache_dir=tmp_path / "cache")
    settings.claim_cache_dir()
    settings.claim_cache_dir()  # the same corpus: the folder stays this run's
    marker = json.loads((tmp_path / "cache" / "corpus-key.json").read_text())
    assert marker == {"corpus_key": settings.corpus_key()}
    # other --sequences on the same folder: its shards would be read as this run's (refused before the target loads)
    with pytest.raises(ValueError, match="holds the cache of other corpus settings"):
        train(dataclasses.replace(settings, sequences=3))
    with pytest.raises(ValueError, match="holds the cache of other corpus settings"):
        eagle.train(eagle.TrainSettings(target="no-such-model", out=tmp_path / "head", cache_dir=tmp_path / "cache"))
    # shards with no mark (a folder chosen by hand, or one written before the mark existed), and a mangled mark
    unmarked = tmp_path / "unmarked"
    unmarked.mkdir()
    (unmarked / "train_0000.pt").write_bytes(b"")
    with pytest.raises(ValueError, match="shards of unknown settings"):
        train(dataclasses.replace(settings, cache_dir=unmarked))
    (tmp_path / "cache" / "corpus-key.json").write_text("[not a mark")
    with pytest.raises(ValueError, match="corpus-key.json cannot be read"):
        settings.claim_cache_dir()
    # the default folder is named by the corpus and never marked
    dataclasses.replace(settings, cache_dir=None).claim_cache_dir()
