"""The Medusa trainer on a tiny target: corpus, cache, training, held-out accuracy, written heads, restart."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import torch

from specdemo.medusa import load_heads
from specdemo.medusa_train import TrainSettings, labels_for, stdlib_files, train

from tiny import save_tiny_pair


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
