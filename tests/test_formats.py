"""The int8 format: batch-invariant passes (a token's logits never depend on the other tokens of its pass), hence
speculative output identical to plain decoding in that format, for draft models, n-gram lookup and Medusa trees."""

from __future__ import annotations

import pytest
import torch

from specdemo.draft_length import FixedDraftLength, TreeBudget, make_policy
from specdemo.drafters import DraftModelDrafter, NgramDrafter
from specdemo.engine import GenerationSettings, collect, speculative_decode
from specdemo.formats import (
    Int8WeightLinear,
    is_int8_format,
    output_rows,
    output_weight,
    row_wise_attention,
    to_int8_format,
)
from specdemo.lm import CachedLM, tree_attention_mask
from specdemo.medusa import MedusaDrafter
from specdemo.models import (
    LoadedModel,
    LoadSettings,
    ModelLoadError,
    cache_key,
    draft_dtype,
    resolve_dtype,
    resolve_format,
)

from test_medusa import GREEDY, PROMPTS, plain_ids, random_heads
from tiny import VOCAB, gpt2, llama, qwen2


def int8_model(factory, seed: int, **kwargs):
    return to_int8_format(factory(seed, **kwargs))


def test_int8_linear_rows_do_not_depend_on_their_neighbours():
    torch.manual_seed(0)
    layer = Int8WeightLinear(torch.nn.Linear(96, 200, bias=True))
    rows = torch.randn(70, 96, dtype=torch.bfloat16)
    alone = torch.cat([layer(rows[i : i + 1]) for i in range(70)])
    for count in (2, 3, 4, 5, 7, 8, 16, 17, 33, 64, 70):
        assert torch.equal(layer(rows[:count]), alone[:count]), count
    # the int8 values stand for the float weights: one scale per output channel, error within half a step
    linear = torch.nn.Linear(96, 200)
    quantized = Int8WeightLinear(linear)
    step = linear.weight.abs().amax(dim=1, keepdim=True) / 127
    assert ((quantized.dequantized().float() - linear.weight).abs() <= step * 0.51 + 1e-3).all()


@pytest.mark.parametrize("factory", [llama, qwen2, gpt2], ids=["llama", "qwen2", "gpt2"])
def test_a_verify_pass_gives_every_token_the_logits_of_a_one_token_pass(factory):
    model = int8_model(factory, 1)
    assert is_int8_format(model) and output_rows(model) == VOCAB
    prompt = PROMPTS[0]
    steps = CachedLM(model)
    logits = [steps.forward(torch.tensor(prompt))[-1:]]
    tokens = [int(logits[-1].argmax())]
    for _ in range(12):
        logits.append(steps.forward(torch.tensor([tokens[-1]]))[-1:])
        tokens.append(int(logits[-1].argmax()))
    one_token = torch.cat(logits[1:])
    for k in (2, 4, 7, 12):
        verify = CachedLM(model)
        verify.forward(torch.tensor(prompt))
        assert torch.equal(verify.forward(torch.tensor(tokens[:k])), one_token[:k]), k


@pytest.mark.parametrize("cached", [5, 58, 63, 64, 120, 250])
def test_each_query_attends_as_in_a_one_token_pass(cached):
    """The attention alone, chains and trees whose queries straddle a key bucket: each row of a pass is bit-equal
    to a one-token pass over that query's keys (the cached ones, then its ancestors), as plain decoding makes it."""
    torch.manual_seed(cached)
    count, heads, kv_heads, head_dim = 12, 6, 2, 16
    query = torch.randn(1, heads, count, head_dim, dtype=torch.bfloat16)
    key, value = (torch.randn(1, kv_heads, cached + count, head_dim, dtype=torch.bfloat16) for _ in range(2))
    chain = list(range(-1, count - 1))
    tree = [-1, 0, 0, 1, 1, 2, 3, 3, 4, 6, 7, 8]
    for parents in (chain, tree):
        mask = tree_attention_mask(parents, cached, torch.bfloat16, torch.device("cpu"))
        out, _ = row_wise_attention(torch.nn.Module(), query, key, value, mask, scaling=0.25)
        for row in range(count):
            seen = (mask[0, 0, row] == 0).nonzero().squeeze(-1)
            alone, _ = row_wise_attention(
                torch.nn.Module(), query[:, :, row : row + 1], key[:, :, seen], value[:, :, seen], None, scaling=0.25
            )
            assert torch.equal(out[:, row], alone[:, 0]), (parents is tree, row)


def test_greedy_speculation_in_int8_equals_plain_int8_decoding():
    settings = GenerationSettings(max_new_tokens=24)
    for factory, seed in ((llama, 1), (qwen2, 3), (gpt2, 5)):
        target = int8_model(factory, seed)
        for prompt in PROMPTS:
            expected = plain_ids(target, prompt, settings)
            drafters = {
                "small-model": DraftModelDrafter(factory(seed + 1, layers=1), GREEDY, VOCAB),
                "random-model": DraftModelDrafter(llama(99, layers=1), GREEDY, VOCAB),
                "ngram": NgramDrafter(1, 3),
            }
            for k in (1, 3, 6, "adaptive"):
                for label, drafter in drafters.items():
                    final = collect(speculative_decode(CachedLM(target), drafter, make_policy(k), prompt, settings))
                    assert final.new_token_ids == expected, (factory.__name__, k, label, prompt)


def test_length_limits_and_eos_in_int8():
    target = int8_model(qwen2, 3)
    prompt = PROMPTS[2]
    full = plain_ids(target, prompt, GenerationSettings(max_new_tokens=16))
    for limit in (1, 2, 5, 9, 16):
        drafter = DraftModelDrafter(qwen2(4, layers=1), GREEDY, VOCAB)
        final = collect(speculative_decode(CachedLM(target), drafter, FixedDraftLength(4), prompt,
                                           GenerationSettings(max_new_tokens=limit)))
        assert final.new_token_ids == full[:limit]
    for eos_at in (0, 3, 8):
        eos = [full[eos_at]]
        expected = plain_ids(target, prompt, GenerationSettings(max_new_tokens=16), eos)
        final = collect(speculative_decode(CachedLM(target), NgramDrafter(1, 3), FixedDraftLength(5), prompt,
                                           GenerationSettings(max_new_tokens=16), eos))
        assert final.new_token_ids == expected and final.finish_reason == "eos"


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_medusa_in_int8_equals_plain_int8_decoding(tree):
    target = int8_model(llama, 1)
    heads = random_heads(target, seed=4).to(torch.bfloat16)  # as the pipeline casts them to the target's dtype
    weight = output_weight(target)
    assert weight.shape == (VOCAB, 64) and output_weight(target) is weight  # dequantised once per model
    settings = GenerationSettings(max_new_tokens=24)
    for prompt in PROMPTS:
        expected = plain_ids(target, prompt, settings)
        for budget in (3, 8):
            drafter = MedusaDrafter(heads, weight, GREEDY, VOCAB, tree=tree, top_width=3)
            policy = TreeBudget(k_max=budget) if tree else FixedDraftLength(budget)
            final = collect(speculative_decode(CachedLM(target), drafter, policy, prompt, settings))
            assert final.new_token_ids == expected, (prompt, budget)


def loaded_targets() -> tuple[LoadedModel, LoadedModel]:
    """The same tiny target loaded in the int8 format and in bfloat16, on the CPU."""
    cpu = torch.device("cpu")
    return (
        LoadedModel("tiny", int8_model(llama, 1), None, cpu, torch.bfloat16, LoadSettings(dtype="int8")),
        LoadedModel("tiny", llama(1).to(torch.bfloat16), None, cpu, torch.bfloat16, LoadSettings(dtype="bf16")),
    )


def test_format_names():
    cpu = torch.device("cpu")
    int8, bf16 = loaded_targets()
    assert int8.format == "int8" and bf16.format == "bfloat16"
    assert cache_key("tiny:x", LoadSettings(dtype="int8"))[1] == "int8"
    assert resolve_format("int8", cpu) == "int8" and resolve_dtype("int8", cpu) == torch.bfloat16
    assert resolve_format("bf16", cpu) == "bfloat16" and resolve_format("float32", cpu) == "float32"
    assert resolve_format("auto", cpu) == "bfloat16"
    assert draft_dtype("int8") == "bfloat16" and draft_dtype("float32") == "float32"
    with pytest.raises(ModelLoadError, match="unknown dtype 'int4'"):
        resolve_format("int4", cpu)
    with pytest.raises(ModelLoadError, match="for CPU targets"):
        resolve_format("int8", torch.device("meta"))


def test_every_verify_pass_fits_the_row_wise_attention():
    from specdemo.formats import ROW_WISE_MAX_QUERIES
    from specdemo.pipeline import InputError, SpecSettings

    SpecSettings(max_draft_length=64).validate()
    assert 64 + 1 <= ROW_WISE_MAX_QUERIES  # the longest draft plus the last token
    with pytest.raises(InputError, match="between 1 and 64"):
        SpecSettings(max_draft_length=65).validate()


def test_a_universal_drafter_beside_an_int8_target_drafts_in_int8():
    from specdemo.pipeline import SpecSettings, uag_draft_int8

    cpu = torch.device("cpu")
    int8, bf16 = loaded_targets()
    draft = LoadedModel("draft", llama(2), None, cpu, torch.float32, LoadSettings())
    uag = SpecSettings(mode="uag")
    assert uag_draft_int8(uag, int8, draft) and not uag_draft_int8(uag, bf16, draft)
    assert not uag_draft_int8(SpecSettings(mode="uag", draft_int8=False), int8, draft)
    assert uag_draft_int8(SpecSettings(mode="uag", draft_int8=True), bf16, draft)

