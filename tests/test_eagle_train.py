"""The EAGLE-3 trainer on a tiny target: the unrolled training forward is the drafter's own computation, a run
writes a head the drafter loads and that keeps greedy output exact, a stopped run resumes to the same weights, the
draft vocabulary, the held-out split, the Medusa trainer's answers reused, the benchmark prompts never read."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny import save_tiny_pair, spy_on_open

from specdemo.backends.formats import output_weight
from specdemo.backends.loading import LoadSettings, load_model
from specdemo.backends.transformers_lm import CachedLM
from specdemo.core.loop import collect, plain_decode, speculative_decode
from specdemo.core.settings import GenerationSettings, SamplingSettings
from specdemo.methods.draft_length import FixedDraftLength, TreeBudget
from specdemo.backends.eagle3_checkpoint import load_head, target_facts
from specdemo.backends.eagle3_head import EagleConfig, EagleHead, HeadKVCache
from specdemo.methods.eagle import EagleDrafter
from specdemo.training import common
from specdemo.training.common import (
    CorpusSpec,
    answers_key,
    build_sequences,
    generate_answers,
    is_held_out,
)
from specdemo.training.eagle import TrainSettings, train, widened_mlp
from specdemo.training.eagle_shape import (
    MAX_HEAD_BYTES,
    as_shipped,
    draft_vocabulary,
    head_bytes,
    head_fields,
    pass_through_init,
    ship_dtype,
)
from specdemo.training.eagle_unrolled import Split, load_split, make_batch, unrolled_forward

BENCHMARK_FILES = {"prompts.jsonl", "question.jsonl"}
#: tiny models gain nothing from threads, and lose much to a busy machine
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tiny_settings(tmp_path: Path, target: str, **changes) -> TrainSettings:
    settings = dict(
        target=target, out=tmp_path / "head", dtype="float32", sequences=4, sequence_tokens=160,
        held_out_sequences=2, answers=6, answer_tokens=20, generation_batch=3, held_out_every=3, epochs=2,
        steps_unrolled=3, draft_vocab_size=64, batch_tokens=300, learning_rate=3e-3, warmup_steps=2,
        cache_dir=tmp_path / "cache",
    )
    settings.update(changes)
    return TrainSettings(**settings)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("pair"))[0]


# ----------------------------------------------------------------------------------------------------------------
# the unrolled forward


def random_head(seed: int = 0) -> EagleHead:
    config = EagleConfig(64, 4, 2, 16, 96, 320, 40, (0, 1, 2), shared_lm_head=True)
    head = EagleHead(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
        head.draft_ids.copy_(torch.randperm(320, generator=generator)[:40].sort().values)
    return head


def test_the_unrolled_forward_is_what_the_drafter_computes_at_each_draft_step():
    head, steps = random_head(), 4
    embed = torch.randn(320, 64, generator=torch.Generator().manual_seed(1))
    lengths, starts = [11, 7], [3, 1]
    generator = torch.Generator().manual_seed(2)
    split = Split(
        ids=torch.randint(0, 320, (sum(lengths),), generator=generator, dtype=torch.int32),
        greedy=torch.randint(0, 320, (sum(lengths),), generator=generator, dtype=torch.int32),
        states=torch.randn(sum(lengths), 3 * 64, generator=generator),
        lengths=torch.tensor(lengths), answer_starts=torch.tensor(starts),
    )
    batch = make_batch(split, [0, 1], steps)
    with torch.no_grad():
        outputs = unrolled_forward(head, embed, batch, steps)
        offset, active_seen = 0, 0
        for s, length in enumerate(lengths):
            ids = split.ids[offset : offset + length].long()
            states = split.states[offset : offset + length]
            rows = length - 1
            for root in range(rows):
                # the drafter: commit rows 0..root (target features, the next token), then draft from the root
                cache = HeadKVCache()
                committed = head(head.features(states[: root + 1]), embed[ids[1 : root + 2]],
                                 torch.arange(root + 1), cache)
                flat = sum(lengths[:s]) - s + root
                assert torch.allclose(committed[-1], outputs[0][flat], atol=1e-5)
                if root < starts[s] - 1:
                    continue  # rows before the answer learn nothing: no further steps
                output = committed[-1]
                for j in range(2, steps + 1):
                    token = ids[root + j] if root + j < length else torch.tensor(0)
                    output = head(output.view(1, -1), embed[token.view(1)], torch.tensor([root + j - 1]), cache)[0]
                    assert torch.allclose(output, outputs[j - 1][active_seen], atol=1e-4), (s, root, j)
                active_seen += 1
            offset += length
        assert active_seen == outputs[1].shape[0]


def test_the_pass_through_init_starts_the_head_as_the_highest_layers_state():
    head = random_head()
    pass_through_init(head)
    states = torch.randn(5, 3 * 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        features = head.features(states)
        normed = head.input_norm(states) if head.input_norm is not None else states
        assert torch.allclose(features, normed[:, -64:])
        outputs = head(features, torch.randn(5, 64), torch.arange(5))
        layer = head.midlayer
        assert torch.allclose(outputs, layer.hidden_norm(features) if layer.norm_before_residual else features,
                              atol=1e-6)


def test_a_head_grown_wider_computes_what_it_did_and_its_new_units_can_learn():
    start = random_head()
    wide = EagleHead(replace(start.config, intermediate_size=start.config.intermediate_size + 64))
    with torch.no_grad():
        wide.load_state_dict(widened_mlp(start.state_dict(), wide.state_dict()))
        wide.draft_ids.copy_(start.draft_ids)
    for name, tensor in start.state_dict().items():  # every other weight, and the start's units, as they were
        assert torch.equal(wide.state_dict()[name][tuple(slice(0, n) for n in tensor.shape)], tensor), name
    new_down = wide.midlayer.mlp.down_proj.weight[:, start.config.intermediate_size:]
    assert torch.equal(new_down, torch.zeros_like(new_down))
    new_up = wide.midlayer.mlp.up_proj.weight[start.config.intermediate_size:]
    assert new_up.abs().sum() > 0  # random, so their down columns get a gradient
    hidden = torch.randn(5, start.config.hidden_size)
    torch.testing.assert_close(wide.midlayer.mlp(hidden), start.midlayer.mlp(hidden))


def test_the_draft_vocabulary_is_the_most_frequent_greedy_tokens_and_the_eos_ids():
    labels = torch.tensor([5, 5, 5, 9, 9, 2, 2, 7, -1, -1, -1, -1], dtype=torch.int32)
    assert draft_vocabulary(labels, 3, 20, eos_ids=[]).tolist() == [2, 5, 9]  # 2 and 9 tie: both twice
    assert draft_vocabulary(labels, 3, 20, eos_ids=[19]).tolist() == [2, 5, 19]
    assert draft_vocabulary(labels, 6, 20, eos_ids=[]).tolist() == [0, 1, 2, 5, 7, 9]  # too few: lowest unused


def test_the_default_head_for_the_offline_target_fits_40_mb():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, rope_theta=1e6, tie_word_embeddings=False)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    fields = head_fields(model, TrainSettings().draft_vocab_size, TrainSettings().intermediate_size)
    head = EagleConfig(**fields)
    assert head.shared_lm_head and head.hidden_layers == (2, 14, 25)
    assert head_bytes(head) <= MAX_HEAD_BYTES < head_bytes(EagleConfig(**{**fields, "intermediate_size":
                                                                           head.intermediate_size + 128}))
    assert ship_dtype(head) == torch.bfloat16
    # wider: its matrices go in int8 (one scale a row), 5,120 still under the cap, 5,248 not
    wide = EagleConfig(**{**fields, "intermediate_size": 5120})
    assert ship_dtype(wide) == torch.int8 and head_bytes(wide, torch.int8) <= MAX_HEAD_BYTES
    assert head_bytes(EagleConfig(**{**fields, "intermediate_size": 5248}), torch.int8) > MAX_HEAD_BYTES


def test_a_head_is_scored_as_its_file_will_hold_it():
    head = random_head()
    assert ship_dtype(head.config) == torch.bfloat16
    shipped = as_shipped(head)
    assert torch.equal(shipped.fc.weight, head.fc.weight.to(torch.bfloat16).float())
    assert torch.equal(shipped.lm_head.weight, head.lm_head.weight)  # the target's rows: not stored, not rounded


# ----------------------------------------------------------------------------------------------------------------
# whole runs


def test_a_run_writes_a_head_the_drafter_loads_and_greedy_output_stays_exact(pair, tmp_path, monkeypatch):
    settings = tiny_settings(tmp_path, pair)
    spec = settings.corpus_spec()
    loaded = load_model(pair, LoadSettings(dtype="float32"))
    # answers the Medusa trainer left in its cache are reused, not generated again
    monkeypatch.setattr(common, "CACHE_HOME", tmp_path / "home")
    medusa_answers = tmp_path / "home" / "medusa-train" / "k" / f"answers-{answers_key(pair, 'float32', spec)}"
    generate_answers(loaded, spec, medusa_answers / "answers.jsonl")
    opened = spy_on_open(monkeypatch)
    report = train(settings)
    monkeypatch.undo()
    assert opened and not [name for name in opened if Path(name).name in BENCHMARK_FILES]
    assert (settings.answers_path() / "answers.jsonl").read_text() == (medusa_answers / "answers.jsonl").read_text()
    assert report["answers"]["reused_from"] == str(medusa_answers / "answers.jsonl")

    assert report["complete"] and report["steps"]["done"] == report["steps"]["planned"]
    for split in ("standard_library", "answers"):
        figures = report["held_out"][split]
        assert len(figures["top1_per_step"]) == 3 and all(0.0 <= a <= 1.0 for a in figures["top1_per_step"])
        accepted = figures["mean_accepted_drafts"]
        assert len(accepted) == 3 and all(0.0 <= a <= k + 1 for k, a in enumerate(accepted))
        assert accepted == sorted(accepted)
    # a held-out figure after each epoch but the last (whose figures are the final ones)
    assert [entry["epoch"] for entry in report["held_out_per_epoch"]] == [1]
    assert len(report["held_out_per_epoch"][0]["answers"]) == 3
    written = json.loads((settings.out / "training.json").read_text())
    assert written["weights_sha256"] == report["weights_sha256"] and written["head"]["dtype"] == "bfloat16"
    assert set(written["seconds"]) == {"answers", "cache", "train", "evaluate", "total"}
    config = json.loads((settings.out / "config.json").read_text())
    assert config["shared_lm_head"] and config["torch_dtype"] == "bfloat16" and config["draft_vocab_size"] == 64
    assert "lm_head.weight" not in load_file(str(settings.out / "model.safetensors"))

    model = loaded.model
    head = load_head(settings.out, target_facts(loaded), expected_sha256=report["weights_sha256"],
                     lm_head_weight=lambda: output_weight(model))
    # the draft vocabulary holds the training answers' most frequent greedy tokens and the EOS id
    labels = torch.cat([load_split(settings.cache_path(), "train").labels(),
                        load_split(settings.answers_path(), "train").labels()]).long()
    counts = torch.bincount(labels, minlength=320)
    threshold = counts.sort(descending=True).values[63 - 1]
    assert set(torch.nonzero(counts > threshold).flatten().tolist()) <= set(head.draft_ids.tolist())
    assert loaded.tokenizer.eos_token_id in head.draft_ids.tolist()

    prompts = [list(range(40, 60)), loaded.tokenizer("def add(a, b):\n    return")["input_ids"]]
    settings_out = GenerationSettings(max_new_tokens=30)
    for prompt in prompts:
        expected = collect(plain_decode(CachedLM(model), prompt, settings_out)).new_token_ids
        for tree, policy in ((False, FixedDraftLength(4)), (True, TreeBudget(max_num_draft_tokens=8))):
            drafter = EagleDrafter(head, model.get_input_embeddings(), SamplingSettings(), 320, tree=tree)
            event = collect(speculative_decode(CachedLM(model), drafter, policy, prompt, settings_out))
            assert event.new_token_ids == expected, (prompt, tree)


def test_a_bad_init_or_train_dtype_is_refused_before_anything_loads(tmp_path, monkeypatch):
    import specdemo.backends.loading as loading

    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("loaded a model"))
    with pytest.raises(ValueError, match="--init zeros: random or pass-through"):
        train(tiny_settings(tmp_path, "unused", init="zeros"))
    with pytest.raises(ValueError, match="--train-dtype float16: bfloat16 or float32"):
        train(tiny_settings(tmp_path, "unused", train_dtype="float16"))
    with pytest.raises(ValueError, match="--init pass-through and --init-from: a head starts one way"):
        train(tiny_settings(tmp_path, "unused", init="pass-through", init_from=tmp_path))
    with pytest.raises(ValueError, match="--loss-target distribution: only the prompt pool's answers store"):
        train(tiny_settings(tmp_path, "unused", loss_target="distribution"))
    with pytest.raises(ValueError, match="--loss-target kl: greedy or distribution"):
        train(tiny_settings(tmp_path, "unused", loss_target="kl"))


def test_answers_committed_with_the_checkout_are_found_by_their_key(tmp_path, monkeypatch):
    assert common.CHECKOUT_ANSWERS == Path(__file__).resolve().parents[1] / "assets" / "training"
    monkeypatch.setattr(common, "CACHE_HOME", tmp_path / "home")
    monkeypatch.setattr(common, "CHECKOUT_ANSWERS", tmp_path / "assets")
    (tmp_path / "assets").mkdir()
    (tmp_path / "assets" / "answers-abc.jsonl").write_text('{"index": 0}\n')
    assert common.answers_elsewhere("abc") == [tmp_path / "assets" / "answers-abc.jsonl"]
    assert common.answers_elsewhere("other") == []
    monkeypatch.setattr(common, "CHECKOUT_ANSWERS", tmp_path / "checkout" / "assets" / "training")
    committed = common.CHECKOUT_ANSWERS / "answers-abc.jsonl"
    assert common.portable_path(committed) == "assets/training/answers-abc.jsonl"  # not this machine's layout
    assert common.portable_path(Path.home() / ".cache" / "x") == "~/.cache/x"


def test_a_stopped_run_resumes_to_the_weights_of_an_uninterrupted_one(pair, tmp_path):
    whole = train(tiny_settings(tmp_path, pair, answers=0, out=tmp_path / "whole"))
    planned = whole["steps"]["planned"]
    assert planned >= 6
    for checkpoint in (tmp_path / "cache").glob("checkpoint-*.pt"):
        checkpoint.unlink()
    cached = {path: path.stat().st_mtime_ns for path in (tmp_path / "cache").glob("train_*.pt")}
    for stop in (planned // 2 - 1, planned // 2 + 1):  # inside the first epoch, then inside the second
        stopped = train(tiny_settings(tmp_path, pair, answers=0, out=tmp_path / "resumed", stop_after_steps=stop))
        assert not stopped["complete"] and stopped["steps"]["done"] == stop
    resumed = train(tiny_settings(tmp_path, pair, answers=0, out=tmp_path / "resumed"))
    assert resumed["complete"] and resumed["steps"]["done"] == planned
    assert {path: path.stat().st_mtime_ns for path in (tmp_path / "cache").glob("train_*.pt")} == cached  # kept
    one, other = load_file(str(tmp_path / "whole" / "model.safetensors")), load_file(
        str(tmp_path / "resumed" / "model.safetensors"))
    assert one.keys() == other.keys() and all(torch.equal(one[name], other[name]) for name in one)
    assert resumed["weights_sha256"] == whole["weights_sha256"]
    # a finished run's checkpoint: a rerun trains nothing again and writes the same head
    again = train(tiny_settings(tmp_path, pair, answers=0, out=tmp_path / "again"))
    assert again["weights_sha256"] == whole["weights_sha256"]


def test_held_out_files_and_prompts_never_reach_the_training_set(pair):
    tokenizer = load_model(pair, LoadSettings(dtype="float32")).tokenizer
    spec = CorpusSpec(sequences=40, sequence_tokens=160, held_out_every=10, held_out_sequences=8, seed=0)
    train_seqs, held = build_sequences(tokenizer, spec)
    assert len(train_seqs) == 40 and len(held) == 8
    assert not {s["file"] for s in train_seqs} & {s["file"] for s in held}
    assert all(is_held_out(s["file"], 10) for s in held) and not any(is_held_out(s["file"], 10) for s in train_seqs)
    answers = [{"index": i, "kind": "k", "prompt": f"p{i}", "answer_ids": list(range(10))} for i in range(30)]
    answer_train, answer_held = common.answer_sequences(tokenizer, answers, spec)
    assert len(answer_held) == 3 and len(answer_train) == 27
    assert not {tuple(s["ids"]) for s in answer_train} & {tuple(s["ids"]) for s in answer_held}


def test_chat_prompts_are_count_stable_varied_and_none_is_a_benchmark_prompt():
    from specdemo.training.corpus import chat_prompts

    prompts = chat_prompts(240, seed=0)
    assert chat_prompts(60, seed=0) == prompts[:60]  # a larger set extends a smaller one
    assert len({p.text for p in prompts}) == 240 and chat_prompts(60, seed=1) != prompts[:60]
    kinds = {p.kind for p in prompts[:12]}
    assert {"advice", "reasoning", "roleplay", "writing", "stem", "extraction", "humanities"} <= kinds
    root = Path(__file__).resolve().parents[1]
    benchmark = {json.loads(line)["prompt"] for line in (root / "specdemo" / "data" / "prompts.jsonl").open()}
    questions = root.parent / "shared" / "specbench" / "question.jsonl"
    if questions.is_file():
        benchmark |= {turn for line in questions.open() for turn in json.loads(line)["turns"]}
    assert not {p.text for p in chat_prompts(1000, seed=0)} & benchmark


def test_chat_answers_join_the_corpus_and_a_larger_set_extends_the_answers_of_a_smaller_one(pair, tmp_path,
                                                                                           monkeypatch):
    from specdemo.training.corpus import chat_prompts

    monkeypatch.setattr(common, "CACHE_HOME", tmp_path / "home")
    small = train(tiny_settings(tmp_path, pair, answers=0, chat_answers=4, epochs=1, out=tmp_path / "small"))
    settings = tiny_settings(tmp_path, pair, answers=0, chat_answers=7, epochs=1)
    answers_file = settings.chat_answers_path() / "answers.jsonl"
    first_four = answers_file.read_text()
    assert len(first_four.splitlines()) == 4 and small["chat_answers"]["held_out_sequences"] == 2  # 0 and 3
    report = train(settings)
    assert answers_file.read_text().startswith(first_four)  # the four answers kept, three more appended
    rows = sorted((json.loads(line) for line in answers_file.read_text().splitlines()), key=lambda row: row["index"])
    assert [row["prompt"] for row in rows] == [p.text for p in chat_prompts(7, seed=0)]
    assert report["chat_answers"]["training_sequences"] + report["chat_answers"]["held_out_sequences"] <= 7
    figures = report["held_out"]["chat_answers"]
    assert len(figures["top1_per_step"]) == 3 and all(0.0 <= a <= 1.0 for a in figures["top1_per_step"])
    assert report["weights_sha256"] != small["weights_sha256"]
    # a row whose prompt is not the set's (a stale file) is answered again, not trained on
    loaded = load_model(pair, LoadSettings(dtype="float32"))
    stale = tmp_path / "stale.jsonl"
    stale.write_text(json.dumps({**rows[0], "prompt": "something else"}) + "\n")
    again = generate_answers(loaded, settings.corpus_spec(), stale, prompts=chat_prompts(1, seed=0))
    assert again[0]["prompt"] == rows[0]["prompt"] and again[0]["answer_ids"] == rows[0]["answer_ids"]


def test_the_pools_stored_answers_join_the_corpus_and_a_missing_one_is_refused(pair, tmp_path, monkeypatch):
    from specdemo.training import pool
    from specdemo.training.prompt_pool import PoolPrompt, pool_shards

    monkeypatch.setattr(common, "CACHE_HOME", tmp_path / "home")
    folder = tmp_path / "pool"
    prompts = [PoolPrompt("request", f"magpie:test#{i}", f"Tell me fact number {i} about the sea.") for i in range(8)]
    pool_shards(folder).append(prompt.row(i) for i, prompt in enumerate(prompts))
    settings = tiny_settings(tmp_path, pair, answers=0, pool_answers=7, pool_folder=folder, epochs=1)
    with pytest.raises(ValueError, match="7 of the pool's first 7 prompts have no stored answer"):
        train(settings)
    assert pool.main(["--target", pair, "--dtype", "float32", "--answer-tokens", "20", "--batch", "4", "--folder",
                      str(folder), "--phases", "answers"]) == 0
    report = train(settings)
    counts = report["pool_answers"]
    assert counts["training_sequences"] + counts["held_out_sequences"] <= 7 and counts["kinds"] == {"request": 7}
    assert counts["held_out_sequences"] >= 1 and counts["answer_positions"] > 7  # prompts 0 and 3 held out
    figures = report["held_out"]["pool_answers"]
    assert len(figures["top1_per_step"]) == 3 and all(0.0 <= a <= 1.0 for a in figures["top1_per_step"])
    # a part of the pool, trained further from that head: the starting head measured on the same held-out splits
    part = tiny_settings(tmp_path, pair, answers=0, pool_part="2/2", pool_folder=folder, epochs=1,
                         init_from=settings.out, out=tmp_path / "part")
    further = train(part)
    assert further["pool_answers"]["training_sequences"] + further["pool_answers"]["held_out_sequences"] <= 4
    assert further["held_out_at_start"].keys() == further["held_out"].keys()
    assert further["held_out_at_start"]["pool_answers"]["positions"] == further["held_out"]["pool_answers"]["positions"]
    assert "held_out_at_start" not in report  # measured only for a head trained further
    assert [run["weights_sha256"] for run in further["lineage"]] == [report["weights_sha256"], further["weights_sha256"]]
    assert further["lineage"][1]["training_positions"] == further["pool_answers"]["training_positions"] + \
        further["corpus"]["training_positions"]
    with pytest.raises(ValueError, match="--pool-answers and --pool-part: choose one"):
        train(tiny_settings(tmp_path, pair, answers=0, pool_answers=7, pool_part="1/2", pool_folder=folder))
    # the same part learning the target's whole distribution from its final states, which the pool's cache holds
    soft = train(replace(part, loss_target="distribution", sequences=0, out=tmp_path / "soft",
                         cache_dir=tmp_path / "soft-cache"))
    assert soft["settings"]["loss_target"] == "distribution" and soft["weights_sha256"] != further["weights_sha256"]
    assert all(v == v and v > 0 for v in soft["last_train_loss_per_step"])


def test_a_time_budget_that_ends_in_the_pools_state_fill_stops_before_training_and_a_rerun_goes_on(
        pair, tmp_path, monkeypatch, capsys):
    from specdemo.training import eagle, pool, pool_states
    from specdemo.training.prompt_pool import PoolPrompt, pool_shards

    monkeypatch.setattr(common, "CACHE_HOME", tmp_path / "home")
    folder = tmp_path / "pool"
    prompts = [PoolPrompt("request", f"magpie:test#{i}", f"Tell me fact number {i} about the sea.") for i in range(8)]
    pool_shards(folder).append(prompt.row(i) for i, prompt in enumerate(prompts))
    assert pool.main(["--target", pair, "--dtype", "float32", "--answer-tokens", "20", "--batch", "4", "--folder",
                      str(folder), "--phases", "answers", "--no-states"]) == 0  # answers whose states the run fills
    settings = tiny_settings(tmp_path, pair, answers=0, pool_answers=7, pool_folder=folder, epochs=1,
                             time_budget_minutes=60.0)
    real_batch, budget_passed, passes = pool_states.teacher_forced_batch, pool_states.Deadline.passed, []

    def budget_ends_after_two(model, sequences, layers):  # one sequence a pass; the budget ends after the second
        passes.append(len(sequences))
        if len(passes) == 2:
            monkeypatch.setattr(pool_states.Deadline, "passed", property(lambda self: True))
        return real_batch(model, sequences, layers)

    monkeypatch.setattr(pool_states, "length_batches", lambda sequences, max_tokens: [[s] for s in sequences])
    monkeypatch.setattr(pool_states, "teacher_forced_batch", budget_ends_after_two)
    with pytest.raises(pool_states.FillStopped, match="2 of the 7 sequences lacking them cached") as stopped:
        train(settings)
    assert stopped.value.report.sequences == 2 and not (settings.out / "model.safetensors").exists()
    (states,) = (tmp_path / "home" / "pool-states").iterdir()
    assert len(pool_states.stored(states)) == 2  # what was cached is kept
    monkeypatch.setattr(pool_states.Deadline, "passed", budget_passed)  # an hour's budget again
    report = train(settings)  # the same run again: the other five filled, then trained
    assert len(passes) == 7 and report["complete"] and len(pool_states.stored(states)) == 7
    monkeypatch.setattr(eagle, "train", lambda settings: (_ for _ in ()).throw(stopped.value))
    capsys.readouterr()
    assert eagle.main(["--out", str(tmp_path / "cli")]) == 0  # the command line says so in one line
    assert capsys.readouterr().out.startswith("stopped: the time budget ran out while caching")


def test_passage_prompts_quote_the_chat_answer_of_their_index_and_none_is_a_benchmark_prompt():
    from specdemo.training.corpus import PASSAGE_WORDS, chat_prompts, passage, passage_prompts

    words = "The council met on Tuesday. It chose a new bridge design after a long debate. " * 12
    texts = [f"## Answer {i}\n\n**Point {i}**: {words}\n\nA second paragraph, number {i}." for i in range(120)]
    rows = [{"index": i, "answer": text} for i, text in enumerate(texts)]
    prompts = passage_prompts(rows, seed=0)
    assert passage_prompts(rows[:30], seed=0) == prompts[:30]  # a larger set extends a smaller one
    assert passage_prompts(rows[:30], seed=1) != prompts[:30]
    assert {p.kind for p in prompts} == {"summary", "translation", "question", "extraction"}
    for i, prompt in enumerate(prompts):
        quoted = passage(texts[i], PASSAGE_WORDS // 2 if prompt.kind == "translation" else PASSAGE_WORDS)
        assert " ".join(quoted.split()) in " ".join(prompt.text.split()) and f"Point {i}" in prompt.text
        assert "**" not in prompt.text and "##" not in prompt.text
    # a passage keeps whole paragraphs while they fit, else the first one cut at a sentence end
    assert passage("one two.\n\nthree four five.", words=3) == "one two."
    assert passage("A b c. D e f. G h i j k.", words=7) == "A b c. D e f."
    assert passage("", words=5) == ""
    root = Path(__file__).resolve().parents[1]
    benchmark = {json.loads(line)["prompt"] for line in (root / "specdemo" / "data" / "prompts.jsonl").open()}
    questions = root.parent / "shared" / "specbench" / "question.jsonl"
    if questions.is_file():
        benchmark |= {turn for line in questions.open() for turn in json.loads(line)["turns"]}
    chat = [{"index": i, "answer": p.text} for i, p in enumerate(chat_prompts(200, seed=0))]
    assert not {p.text for p in passage_prompts(chat, seed=0)} & benchmark


def test_passage_answers_join_the_corpus_and_a_head_trains_further_from_another(pair, tmp_path, monkeypatch):
    from specdemo.training.corpus import chat_prompts, passage_prompts

    monkeypatch.setattr(common, "CACHE_HOME", tmp_path / "home")
    first = train(tiny_settings(tmp_path, pair, answers=0, epochs=1, out=tmp_path / "first"))
    # no library text at all: a head trained further on the passage answers alone
    settings = tiny_settings(tmp_path, pair, answers=0, passage_answers=5, epochs=1, learning_rate=1e-3,
                             draft_vocab_size=32, init_from=tmp_path / "first", sequences=0, held_out_sequences=0,
                             cache_dir=tmp_path / "cache-passages")
    report = train(settings)
    # the chat prompts are answered (the passages), only the passage answers are learned from
    chat_rows = [json.loads(line) for line in (settings.chat_answers_path() / "answers.jsonl").read_text().splitlines()]
    assert sorted(row["prompt"] for row in chat_rows) == sorted(p.text for p in chat_prompts(5, seed=0))
    passage_rows = sorted((json.loads(line) for line in
                           (settings.passage_answers_path() / "answers.jsonl").read_text().splitlines()),
                          key=lambda row: row["index"])
    chat_rows.sort(key=lambda row: row["index"])
    assert [row["prompt"] for row in passage_rows] == [p.text for p in passage_prompts(chat_rows, seed=0)]
    assert report["chat_answers"] is None and report["passage_answers"]["held_out_sequences"] == 2  # 0 and 3
    assert "standard_library" not in report["held_out"]  # no library text held out: no empty figure
    figures = report["held_out"]["passage_answers"]
    assert len(figures["top1_per_step"]) == 3 and all(0.0 <= a <= 1.0 for a in figures["top1_per_step"])
    # trained further: the first head's draft vocabulary and sizes, other weights
    loaded = load_model(pair, LoadSettings(dtype="float32"))
    model = loaded.model
    heads = [load_head(folder, target_facts(loaded), lm_head_weight=lambda: output_weight(model))
             for folder in (tmp_path / "first", settings.out)]
    assert torch.equal(heads[0].draft_ids, heads[1].draft_ids) and heads[1].config == heads[0].config
    assert report["weights_sha256"] != first["weights_sha256"]
    assert settings.train_key(heads[0].draft_ids, heads[0].config) != tiny_settings(
        tmp_path, pair, answers=0, passage_answers=5, epochs=1, learning_rate=1e-3).train_key(
        heads[0].draft_ids, heads[0].config)
    assert report["head"]["draft_vocab_from"] == "the starting head"
    # the draft vocabulary chosen anew from this run's answers, at another size; the rest of the sizes kept
    anew = train(TrainSettings(**{**settings.__dict__, "draft_vocab_size": 48, "new_draft_vocab": True,
                                  "out": tmp_path / "anew", "stop_after_steps": 1}))
    third = load_head(tmp_path / "anew", target_facts(loaded), lm_head_weight=lambda: output_weight(model))
    assert third.config == replace(heads[0].config, draft_vocab_size=48) and third.draft_ids.numel() == 48
    assert set(loaded.eos_token_ids) <= set(third.draft_ids.tolist())
    assert anew["head"]["draft_vocab_from"] == "this run's training answers" and anew["held_out_at_start"]
    # the MLP grown: the start's units kept, the head trained from there; never cut
    grown = train(TrainSettings(**{**settings.__dict__, "intermediate_size": heads[0].config.intermediate_size + 32,
                                   "out": tmp_path / "grown", "stop_after_steps": 1}))
    assert grown["head"]["intermediate_size"] == heads[0].config.intermediate_size + 32
    with pytest.raises(ValueError, match="narrower than --init-from's MLP"):
        train(TrainSettings(**{**settings.__dict__, "intermediate_size": 8, "out": tmp_path / "cut"}))
    with pytest.raises(ValueError, match="--new-draft-vocab needs --init-from"):
        train(tiny_settings(tmp_path, pair, new_draft_vocab=True))
    with pytest.raises(ValueError, match="EAGLE head not found"):
        train(tiny_settings(tmp_path, pair, answers=0, init_from=tmp_path / "nothing-here"))


def test_prompt_lookup_is_scored_where_the_head_is_and_follows_its_last_right_copy():
    from specdemo.training.head_accuracy import first_draft_hits

    head = random_head()
    # the answer (from position 6) copies the prompt: lookup is right at each copied token after the first
    ids = torch.tensor([5, 6, 7, 8, 9, 11, 5, 6, 7, 8, 9], dtype=torch.int32)
    greedy = torch.cat([ids[1:], torch.tensor([2], dtype=torch.int32)])
    split = Split(ids, greedy, torch.randn(len(ids), 192).to(torch.bfloat16), torch.tensor([len(ids)]),
                  torch.tensor([6]))
    embed = torch.randn(320, 64)
    head_hits, lookup_hits = first_draft_hits(head, embed, split)
    batch = make_batch(split, [0], 1)
    labelled = int((batch.labels[0, batch.active] >= 0).sum())
    assert head_hits.numel() == lookup_hits.numel() == labelled == 5  # rows drafting 6, 7, 8, 9 and 2
    assert lookup_hits.tolist() == [True, True, True, True, False]  # 2 never occurred before


def test_a_split_maps_its_shards_and_batches_as_the_same_split_in_memory(tmp_path):
    from specdemo.training.eagle_unrolled import StateRows

    torch.manual_seed(0)
    sequences = []
    for length, start in ((7, 3), (5, 2), (9, 4)):
        ids = torch.randint(0, 300, (length,), dtype=torch.int32)
        sequences.append({"ids": ids, "greedy": torch.cat([ids[1:], torch.tensor([2], dtype=torch.int32)]),
                          "states": torch.randn(length, 12).to(torch.bfloat16), "answer_start": start})

    def combine(rows: list[dict]) -> dict:
        return {"ids": torch.cat([r["ids"] for r in rows]), "greedy": torch.cat([r["greedy"] for r in rows]),
                "states": torch.cat([r["states"] for r in rows]),
                "lengths": torch.tensor([len(r["ids"]) for r in rows]),
                "answer_starts": torch.tensor([r["answer_start"] for r in rows])}

    torch.save(combine(sequences[:2]), tmp_path / "train_0000.pt")  # two shards, sequences whole in each
    torch.save(combine(sequences[2:]), tmp_path / "train_0001.pt")
    mapped = Split.join([load_split(tmp_path, "train"), load_split(tmp_path, "missing")])
    whole = combine(sequences)
    in_memory = Split(whole["ids"], whole["greedy"], whole["states"], whole["lengths"], whole["answer_starts"])
    assert len(mapped.states.parts) == 2 and len(mapped.states) == 21
    assert torch.equal(mapped.labels(), in_memory.labels())
    for members in ([0, 1, 2], [2, 0]):
        ours, theirs = make_batch(mapped, members, 3), make_batch(in_memory, members, 3)
        for name in ("mask", "states", "positions", "tokens", "labels", "active"):
            assert torch.equal(getattr(ours, name), getattr(theirs, name)), name
    with pytest.raises(IndexError):
        mapped.states[10:14]  # rows of two shards (the first holds 12)
    assert len(StateRows([])) == 0


def test_the_command_line_lists_one_flag_per_setting(capsys):
    from specdemo.training.eagle import main

    with pytest.raises(SystemExit) as stop:
        main(["--help"])
    assert stop.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--target", "--out", "--dtype", "--seed", "--sequences", "--held-out-sequences", "--answers", "--chat-answers",
                 "--passage-answers", "--pool-answers", "--pool-part", "--pool-folder", "--init-from",
                 "--epochs", "--steps-unrolled", "--draft-vocab-size", "--learning-rate", "--batch-tokens",
                 "--time-budget-minutes", "--loss-target"):
        assert flag in text


def test_each_step_learns_the_distribution_the_target_wrote_its_label_from():
    """``--loss-target distribution``: step j at row i reads the target's final state at position i + j, where
    its greedy label came from, and a distribution peaked on the label costs what the greedy token's loss does."""
    from specdemo.training.eagle_unrolled import StateRows, distribution_loss, step_labels

    head = random_head()
    draft_ids = head.draft_ids.long()
    sequences = []
    for length, start in ((7, 3), (9, 4)):
        greedy = torch.full((length,), -1, dtype=torch.int32)
        greedy[start - 1 : length - 1] = draft_ids[torch.randint(0, 40, (length - start,))].int()
        finals = torch.zeros(length - start + 1, 64)
        for row, label in enumerate(greedy[start - 1 :].tolist()):  # peaked where the label is known
            if label >= 0:
                finals[row] = 60.0 * torch.linalg.pinv(head.lm_head.weight.detach())[:, (draft_ids == label).nonzero()[0, 0]]
        sequences.append((torch.randint(0, 320, (length,), dtype=torch.int32), greedy, finals, start))
    split = Split(torch.cat([s[0] for s in sequences]), torch.cat([s[1] for s in sequences]),
                  torch.randn(16, 192), torch.tensor([7, 9]), torch.tensor([3, 4]),
                  StateRows([s[2] for s in sequences]))
    batch = make_batch(split, [0, 1], 3, with_finals=True)
    assert batch.finals.shape == (3, 14, 64)
    assert torch.equal(batch.finals[1, 6 + 3], sequences[1][2][3 + 2 - 3])  # sequence 1, row 3, step 2: position 5
    assert not batch.finals[2, 6 + 6].any()  # row 6 + 3 steps is past the end
    t2d = torch.full((320,), -1, dtype=torch.long)
    t2d[draft_ids] = torch.arange(40)
    logits = torch.randn(int(batch.active.sum()), 40)
    for j, labels in enumerate(step_labels(batch, t2d)):
        soft = distribution_loss(head, logits, batch.finals[j][batch.active], labels)
        hard = torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100)
        assert torch.allclose(soft, hard, atol=1e-3)
    with pytest.raises(ValueError, match="hold no final hidden states"):
        make_batch(replace(split, finals=None), [0], 3, with_finals=True)
