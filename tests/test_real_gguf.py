"""The whole offline path on a real file, in CI (which never installs the offline pack): a tiny Qwen2 written as a
GGUF by the ``gguf`` package, with a byte-level BPE tokenizer trained here, Qwen's chat template and its special
tokens, converted by the real converter (transformers' GGUF machinery, no stub), loaded through
``load_model`` and raced: every mode's greedy output equals plain decoding's, and the run stops at the chat's
end-of-turn token as the offline pack's target does."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from specdemo.backends import offline
from specdemo.backends.loading import LoadSettings, clear_model_cache, load_model

gguf = pytest.importorskip("gguf")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEXT = ("def add(a, b):\n    return a + b\n\nThe quick brown fox jumps over the lazy dog. " * 20
        + "print('hello world')\nfor i in range(10):\n    total += i\n" * 20)
HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 64, 2, 4, 2, 128


def _tokenizer_tables() -> tuple[list[str], list[str]]:
    """A byte-level BPE vocabulary (and its merges) trained on a few lines, the special tokens last, as Qwen's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator([TEXT], trainer)
    data = json.loads(tokenizer.to_str())
    vocab = sorted(data["model"]["vocab"].items(), key=lambda item: item[1])
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    return [token for token, _ in vocab] + SPECIALS, merges


def write_tiny_qwen2_gguf(path: Path, seed: int = 0, layers: int = LAYERS, tied: bool = False,
                          quantized: bool = False) -> int:
    """A random tiny Qwen2 as a GGUF file with a real tokenizer; returns the vocabulary size. Its tensors are
    float32, or with ``quantized`` its matrices Q8_0 blocks (as a pack's GGUF has); ``tied``: no head of its own
    (the embedding serves, as in Qwen2.5-Coder-1.5B's file)."""
    tokens, merges = _tokenizer_tables()
    vocab = len(tokens)
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_name("tiny-qwen2")
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.NORMAL] * (vocab - len(SPECIALS)) + [gguf.TokenType.CONTROL] * len(SPECIALS))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    writer.add_eos_token_id(tokens.index("<|endoftext|>"))
    writer.add_pad_token_id(tokens.index("<|endoftext|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    def tensor(name: str, *shape: int, scale: float = 0.08) -> None:
        values = (rng.standard_normal(shape) * scale).astype(np.float32)
        if quantized and len(shape) == 2:
            kind = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(name, gguf.quants.quantize(values, kind), raw_dtype=kind)
        else:
            writer.add_tensor(name, values)

    head_dim = HIDDEN // HEADS
    tensor("token_embd.weight", vocab, HIDDEN, scale=0.5)
    for layer in range(layers):
        writer.add_tensor(f"blk.{layer}.attn_norm.weight", np.ones(HIDDEN, dtype=np.float32))
        tensor(f"blk.{layer}.attn_q.weight", HIDDEN, HIDDEN)
        tensor(f"blk.{layer}.attn_q.bias", HIDDEN)
        tensor(f"blk.{layer}.attn_k.weight", KV_HEADS * head_dim, HIDDEN)
        tensor(f"blk.{layer}.attn_k.bias", KV_HEADS * head_dim)
        tensor(f"blk.{layer}.attn_v.weight", KV_HEADS * head_dim, HIDDEN)
        tensor(f"blk.{layer}.attn_v.bias", KV_HEADS * head_dim)
        tensor(f"blk.{layer}.attn_output.weight", HIDDEN, HIDDEN)
        writer.add_tensor(f"blk.{layer}.ffn_norm.weight", np.ones(HIDDEN, dtype=np.float32))
        tensor(f"blk.{layer}.ffn_gate.weight", FFN, HIDDEN)
        tensor(f"blk.{layer}.ffn_up.weight", FFN, HIDDEN)
        tensor(f"blk.{layer}.ffn_down.weight", HIDDEN, FFN)
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    if not tied:
        tensor("output.weight", vocab, HIDDEN, scale=0.5)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return vocab


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> tuple[Path, Path]:
    """(the GGUF file, the cache it was converted into), through the real converter."""
    folder = tmp_path_factory.mktemp("real-gguf")
    path = folder / "tiny-qwen2.gguf"
    write_tiny_qwen2_gguf(path)
    return path, folder / "cache"


def test_a_real_gguf_converts_with_its_tokenizer_chat_template_and_special_tokens(converted, monkeypatch):
    path, cache = converted
    monkeypatch.setenv("SPECDEMO_CACHE", str(cache))
    folder = offline.converted_from_gguf(path, progress=False)
    marker = json.loads((folder / offline.MARKER_NAME).read_text())
    assert marker["gguf_sha256"] == offline.cached_file_sha256(path, progress=False)
    clear_model_cache()
    loaded = load_model(str(path), LoadSettings(dtype="float32", device="cpu"), progress=False)
    tokenizer = loaded.tokenizer
    assert type(loaded.model).__name__ == "Qwen2ForCausalLM"
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in loaded.eos_token_ids  # the chat's end of turn stops a run, as for the offline pack
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "def add(a, b):"}],
                                           add_generation_prompt=True, tokenize=False)
    assert prompt == "<|im_start|>user\ndef add(a, b):<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>") and im_end in ids  # special tokens are single ids
    assert tokenizer.decode(ids) == prompt  # byte-level BPE round trip
    again = offline.converted_from_gguf(path, progress=False)
    assert again == folder  # converted once, by the file's sha256


@pytest.mark.parametrize("mode", ["draft", "ngram", "eagle", "eagle-chain", "medusa"])
def test_every_mode_on_the_converted_model_is_identical_to_plain(converted, monkeypatch, mode, tmp_path):
    from specdemo.core.loop import collect
    from specdemo.core.settings import GenerationSettings
    from specdemo.methods import SpecSettings, check_pair
    from specdemo.session.pipeline import encode_prompt, plain_events, spec_events

    path, cache = converted
    monkeypatch.setenv("SPECDEMO_CACHE", str(cache))
    settings32 = LoadSettings(dtype="float32", device="cpu")
    target = load_model(str(path), settings32, progress=False)
    draft = None
    if mode == "draft":  # another random model with the same real tokenizer, from its own GGUF
        draft_path = path.with_name("tiny-qwen2-draft.gguf")
        if not draft_path.exists():
            write_tiny_qwen2_gguf(draft_path, seed=1)
        draft = load_model(str(draft_path), settings32, progress=False)
    prompt_ids = encode_prompt(target, "def add(a, b):\n    return a + b\nprint(", chat=True)
    settings = GenerationSettings(max_new_tokens=24)
    plain = collect(plain_events(target, prompt_ids, settings))
    spec = SpecSettings(mode=mode, num_draft_tokens_schedule="fixed", num_draft_tokens=3,
                        **_heads(mode, target, tmp_path))
    check_pair(spec, target, draft)
    final = collect(spec_events(target, draft, prompt_ids, settings, spec, None))
    assert final.new_token_ids == plain.new_token_ids and final.finish_reason == plain.finish_reason
    assert final.counters.drafted > 0 or mode == "ngram"


def _heads(mode: str, loaded, folder: Path) -> dict:
    """Random heads for the head modes, written in their own layouts for this target."""
    if mode.startswith("eagle"):
        from tiny import save_tiny_eagle_head

        vocab = int(loaded.model.get_output_embeddings().weight.shape[0])
        return {"eagle_head": save_tiny_eagle_head(folder / "eagle", hidden=HIDDEN, vocab=vocab, layers=LAYERS,
                                                   draft_vocab=min(128, vocab))}
    if mode.startswith("medusa"):
        from tiny import save_tiny_heads

        vocab = int(loaded.model.get_output_embeddings().weight.shape[0])
        return {"medusa_heads": save_tiny_heads(folder / "medusa", hidden=HIDDEN, vocab=vocab)}
    return {}
