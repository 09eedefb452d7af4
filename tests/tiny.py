"""Tiny randomly initialised models for tests (float32, CPU, seconds)."""

from __future__ import annotations

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

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


def byte_tokenizer():
    """A small byte-level BPE tokenizer (trained here), with EOS and a minimal chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    corpus = [
        "def add(a, b):\n    return a + b\n",
        "The quick brown fox jumps over the lazy dog. Café naïve 日本語 😀",
        "Summarize the following text in two sentences. Translate to French: bonjour le monde.",
    ] * 20
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<eos>", "<pad>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", pad_token="<pad>")
    tokenizer.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
    return tokenizer


def save_tiny_pair(folder, vocab: int = 320) -> tuple[str, str]:
    """Save a tiny target and draft (same tokenizer) as local model folders; return their paths."""
    from pathlib import Path

    folder = Path(folder)
    tokenizer = byte_tokenizer()
    paths = []
    for name, seed, layers in (("target", 11, 2), ("draft", 12, 1)):
        model = llama(seed, layers=layers, vocab=vocab)
        model.config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        path = folder / name
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        paths.append(str(path))
    return paths[0], paths[1]


def save_tiny_heads(folder, hidden: int = 64, vocab: int = 320, num_heads: int = 3, seed: int = 0) -> str:
    """Random Medusa heads (shared LM head) for a tiny target, saved as a heads folder; return its path."""
    from pathlib import Path

    from specdemo.backends.medusa_heads import MedusaConfig, MedusaHeads

    heads = MedusaHeads(MedusaConfig(num_heads, 1, hidden, vocab))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in heads.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)
    heads.save(Path(folder), torch.float32)
    return str(folder)


def save_tiny_eagle_head(folder, hidden: int = 64, vocab: int = 320, layers: int = 2, draft_vocab: int = 128,
                         seed: int = 0) -> str:
    """A random EAGLE-3 head for a tiny target (this project's layout; the lowest ``draft_vocab`` ids drafted),
    saved as a folder; return its path."""
    from pathlib import Path

    from specdemo.backends.eagle3_checkpoint import save_head
    from specdemo.backends.eagle3_head import EagleConfig, EagleHead, default_hidden_layers

    head = EagleHead(EagleConfig(hidden, 4, 2, hidden // 4, 2 * hidden, vocab, draft_vocab,
                                 default_hidden_layers(layers)))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)
    save_head(head, Path(folder), torch.float32)
    return str(folder)


def spy_on_open(monkeypatch) -> list:
    """Every file opened through ``open`` (builtins and io) from now until ``monkeypatch`` is undone: the list."""
    import builtins
    import io

    opened: list[str] = []
    real_open = builtins.open

    def spying_open(file, *args, **kwargs):
        opened.append(str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", spying_open)
    monkeypatch.setattr(io, "open", spying_open)
    return opened
