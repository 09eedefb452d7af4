"""Offline replay of n-gram rules: it counts the passes the engine makes, and reads bench JSONs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specdemo import bench, replay
from specdemo.drafters import NgramDrafter
from specdemo.draft_length import FixedDraftLength
from specdemo.engine import GenerationSettings, collect, speculative_decode
from specdemo.lm import CachedLM
from specdemo.models import clear_model_cache

from tiny import save_tiny_pair, qwen2, reference_greedy

pytestmark = pytest.mark.usefixtures("own_cache")


def test_replay_counts_the_passes_the_engine_makes():
    target = qwen2(3)
    prompt = [5, 6, 7, 8, 5, 6, 7, 9, 5, 6, 7, 8, 5, 6]
    for k in (1, 3, 6):
        for prefer in ("follow", "recent", "first"):
            final = collect(speculative_decode(CachedLM(target), NgramDrafter(1, 4, prefer), FixedDraftLength(k), prompt,
                                               GenerationSettings(max_new_tokens=20)))
            output = reference_greedy(target, prompt, 20)
            assert final.new_token_ids == output
            passes = replay.replay_passes(NgramDrafter(1, 4, prefer), prompt, output, k)
            assert passes == final.counters.target_passes, (k, prefer)


def test_replay_of_a_copied_answer():
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    output = [1, 2, 3, 4, 5, 6, 7, 8]
    # the prompt pass writes 1; then (1) occurred at 0: one round copies 2..7 and the target adds 8
    assert replay.replay_passes(NgramDrafter(1, 4), prompt, output, 10) == 2
    assert replay.replay_passes(NgramDrafter(1, 4), prompt, output, 0) == 8
    assert replay.replay_passes(NgramDrafter(1, 4), prompt, [], 4) == 0
    with pytest.raises(ValueError):
        replay.replay_passes(NgramDrafter(1, 4), prompt, output, -1)


def test_replay_cli_on_a_bench_json(tmp_path: Path, capsys):
    target, draft = save_tiny_pair(tmp_path / "pair")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        json.dumps({"id": "a", "category": "edit", "prompt": "one two three one two three one two"}) + "\n"
        + json.dumps({"id": "b", "category": "chat", "prompt": "hello there"}) + "\n"
    )
    out = tmp_path / "out.json"
    clear_model_cache()
    assert bench.main(["--target", target, "--prompts", str(prompts), "--modes", "plain,ngram", "--dtype", "float32",
                       "--device", "cpu", "--max-new-tokens", "10", "--warmup", "0", "--quiet", "--json", str(out),
                       "--num-draft-tokens", "4", "--ngram-prefer", "recent"]) == 0
    report = json.loads(out.read_text())
    assert report["config"]["draft_settings"]["ngram_prefer"] == "recent"
    plain = [r for r in report["results"] if r["mode"] == "plain"]
    assert all(len(r["prompt_ids"]) == r["prompt_tokens"] for r in plain)
    ngram = {r["id"]: r for r in report["results"] if r["mode"] == "ngram"}
    items = replay.load_items(out)
    for item in items:  # the replay reproduces the pass counts of the run
        assert replay.replay_passes(NgramDrafter(1, 4, "recent"), item.prompt_ids, item.output_ids, 4) == ngram[item.id]["target_passes"]

    assert replay.main([str(out), "--draft-tokens", "4"]) == 0
    table = capsys.readouterr().out
    assert "follow" in table and "transformers" in table and "ALL" in table and "edit" in table

    # a JSON written before prompt ids were recorded: the prompts are encoded again with the run's target
    for r in report["results"]:
        r.pop("prompt_ids", None)
    old = tmp_path / "old.json"
    old.write_text(json.dumps(report))
    assert [i.prompt_ids for i in replay.load_items(old)] == [i.prompt_ids for i in items]


@pytest.mark.parametrize(
    "content,message",
    [("not json", "not a readable bench JSON"), (json.dumps({"results": [], "config": {}}), "no plain results")],
)
def test_replay_refuses_bad_files(tmp_path: Path, capsys, content: str, message: str):
    path = tmp_path / "bad.json"
    path.write_text(content)
    assert replay.main([str(path)]) == 2
    assert message in capsys.readouterr().err
    assert replay.main([str(tmp_path / "missing.json")]) == 2
    assert replay.main([str(path), "--draft-tokens", "0"]) == 2
