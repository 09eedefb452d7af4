"""The heads shipped in the package: present, the size a wheel may carry, digests as registered, provenance beside
them, and (for EAGLE) a config that fits the offline target, checked without the offline pack."""

from __future__ import annotations

import json

import pytest
import torch

from specdemo.core.files import file_sha256
from specdemo.backends import eagle3_checkpoint as eagle
from specdemo.backends import medusa_checkpoint as medusa

#: the most a shipped head's weights may take
MAX_SHIPPED_BYTES = 40 * 1000 * 1000
#: the offline target's shape (Qwen2.5-Coder-1.5B-Instruct): hidden size, LM-head rows, decoder layers
OFFLINE_TARGET = {"qwen2.5-coder-1.5b": (1536, 151936, 28)}

#: the weights file each layout keeps (FasterDecoding's for Medusa, EAGLE-3's for EAGLE)
WEIGHTS = {"medusa": "medusa_lm_head.safetensors", "eagle": "model.safetensors"}

SHIPPED = [("medusa", name, folder, digest) for name, (folder, digest) in medusa.SHIPPED_HEADS.items()] + [
    ("eagle", name, folder, digest) for name, (folder, digest) in eagle.SHIPPED_HEADS.items()]


@pytest.mark.parametrize("method,name,folder,digest", SHIPPED, ids=[f"{m}-{n}" for m, n, _, _ in SHIPPED])
def test_a_shipped_head_is_whole_and_registered(method, name, folder, digest):
    weights = folder / WEIGHTS[method]
    assert weights.is_file(), f"{weights} is registered but missing (package data?)"
    assert weights.stat().st_size <= MAX_SHIPPED_BYTES
    assert file_sha256(weights) == digest
    provenance = json.loads((folder / "training.json").read_text())
    assert provenance["command"].startswith(f"python -m specdemo.training.{method}")
    if method == "eagle":
        assert provenance["weights_sha256"] == digest
        assert provenance["complete"] is True
        held_out = set(provenance["held_out"])  # the target's own answers: its chat answers or the pool's
        assert "standard_library" in held_out and held_out & {"answers", "pool_answers"}


@pytest.mark.parametrize("name", sorted(eagle.SHIPPED_HEADS))
def test_the_shipped_eagle_head_loads_for_its_offline_target(name):
    from specdemo.backends.offline import OFFLINE_MODELS

    hidden, vocab, layers = OFFLINE_TARGET[name]
    facts = eagle.TargetFacts(
        source=f"offline:{name}", hidden_size=hidden, vocab_size=vocab, num_layers=layers,
        names=(f"offline:{name}", OFFLINE_MODELS[name].description.split(",")[0]),
        architectures=("Qwen2ForCausalLM",))
    folder, digest = eagle.SHIPPED_HEADS[name]
    lm_head = torch.zeros(1, hidden).expand(vocab, hidden)  # rows are indexed, never all held
    head = eagle.load_head(folder, facts, expected_sha256=digest, lm_head_weight=lambda: lm_head)
    assert head.config.shared_lm_head and head.config.hidden_layers == eagle.default_hidden_layers(layers)
    assert int(head.draft_ids.max()) < vocab and head.draft_ids.unique().numel() == head.config.draft_vocab_size
    wrong = eagle.TargetFacts(source="offline:other", hidden_size=hidden, vocab_size=vocab + 1, num_layers=layers)
    with pytest.raises(eagle.EagleLoadError, match="vocabulary"):
        eagle.load_head(folder, wrong, lm_head_weight=lambda: lm_head)
