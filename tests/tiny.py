"""Tiny randomly initialised models for tests (float32, CPU, seconds)."""

from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

VOCAB = 96


def llama(seed: int, layers: int = 2, vocab: int = VOCAB, hidden: int = 64) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    return LlamaForCausalLM(config).eval()


def qwen2(seed: int, layers: int = 2, vocab: int = VOCAB) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    return Qwen2ForCausalLM(config).eval()


def gpt2(seed: int, layers: int = 2, vocab: int = VOCAB) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=vocab, n_embd=64, n_layer=layers, n_head=4, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config).eval()


def reference_greedy(model, prompt: list[int], max_new_tokens: int, eos: list[int] | None = None) -> list[int]:
    """What stock ``model.generate(do_sample=False)`` writes."""
    from transformers import GenerationConfig

    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos or None,
        pad_token_id=(eos or [0])[0],
    )
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long), generation_config=config)
    return out[0, len(prompt) :].tolist()
