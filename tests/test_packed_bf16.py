"""bfloat16 linear layers packed for oneDNN (:mod:`specdemo.backends.packed_bf16`) compute what the stock layers
compute, to bfloat16's rounding (the kernel is the same; at some row counts the stock call blocks its sums
differently): a tiny bfloat16 target's logits over a prompt pass and one-token passes before and after packing (on
CPUs with native bfloat16; elsewhere the packing is skipped, which is checked too)."""

from __future__ import annotations

import pytest
import torch
from tiny import llama, qwen2
from torch import nn

from specdemo.backends.packed_bf16 import PackedBF16Linear, pack_bf16_linears, packed_bf16_available

pytestmark = pytest.mark.usefixtures("one_torch_thread")

needs_native_bf16 = pytest.mark.skipif(not packed_bf16_available(),
                                       reason="this CPU has no native bfloat16 arithmetic in oneDNN (AVX-512 bf16 "
                                              "or AMX): packing is skipped here")


def _passes(model: nn.Module, prompts: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """The logits of a pass over ``prompts`` [rows, width], then of ``steps`` greedy one-token passes."""
    logits = []
    with torch.inference_mode():
        out = model(input_ids=prompts, use_cache=True)
        logits.append(out.logits)
        cache = out.past_key_values
        for _ in range(steps):
            out = model(input_ids=out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
            logits.append(out.logits)
    return logits


@needs_native_bf16
@pytest.mark.parametrize("make", [qwen2, llama])
def test_packed_layers_compute_what_the_stock_ones_do(make):
    model = make(3, layers=2).to(torch.bfloat16)
    prompts = torch.randint(0, model.config.vocab_size, (5, 23), generator=torch.Generator().manual_seed(1))
    stock = _passes(model, prompts, 6)
    head, weight = model.get_output_embeddings(), model.get_output_embeddings().weight
    assert pack_bf16_linears(model) == 7 * 2  # q, k, v, o, gate, up, down in each layer
    assert model.get_output_embeddings() is head and head.weight is weight  # the head (tied or not) is left alone
    assert all(not isinstance(m, nn.Linear) for m in model.get_decoder().modules())
    packed = _passes(model, prompts, 6)
    for a, b in zip(stock, packed, strict=True):
        torch.testing.assert_close(a, b)  # bfloat16's tolerances


@needs_native_bf16
def test_a_packed_layer_keeps_its_bias_and_shapes():
    linear = nn.Linear(48, 80).to(torch.bfloat16)
    layer = PackedBF16Linear(linear)
    x = torch.randn(2, 3, 48, dtype=torch.bfloat16)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), linear(x))
    assert "in_features=48, out_features=80, bias=True" in repr(layer)


def test_other_formats_are_left_alone():
    model = qwen2(4)  # float32: nothing to pack
    assert pack_bf16_linears(model) == 0
    assert sum(isinstance(m, nn.Linear) for m in model.modules()) == 7 * 2 + 1
