"""Tests for specdemo.core.detok: incremental pieces must add up to a full decode."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

from tokenizers import (  # noqa: E402
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)
from transformers import PreTrainedTokenizerFast  # noqa: E402

from specdemo.core.detok import IncrementalDetokenizer  # noqa: E402

SPECIALS = ["<s>", "</s>", "<unk>", "<|im_end|>"]

CORPUS_LINES = [
    "The naïve café owner served crème brûlée and a piña colada to the façade painter.",
    "Größere Straßen führen über die Brücke; él comió jamón en la pequeña ciudad.",
    "日本語のテキストを少し書きます。東京は大きな都市です。中文文本也在这里。",
    "Emoji time 😀😃👍🏽 🎉 ❤️ 👨‍👩‍👧 and a rocket 🚀 launching.",
    "def add(a, b):\n    return a + b\n\nclass Box:\n    def __init__(self):\n        self.items = []\n",
    "for i in range(10):\n\tif i % 2 == 0:\n\t\tprint(i)  # even numbers\n",
    "I'm sure we've seen that they're here, isn't it? Yes, it's fine. Don't worry!",
    "Numbers like 3.14159, 2024-06-01 and $12.50 appear in texts too.",
    "    indented line with trailing spaces   \n\n\n",
    "Русский текст и ελληνικά γράμματα, plus עברית and العربية for good measure.",
]

TRICKY = [
    "naïve café — 日本語のテキスト 😀👍🏽",
    "def f(x):\n    return x  # tab\tend\n\n",
    "  leading spaces",
    "trailing spaces   ",
    "👨‍👩‍👧‍👦 family, 🏳️‍🌈 flag, 👩🏽‍💻 coder, 🧑‍🚀",
    "Ünïcödé ßtraße Ελληνικά русский עברית العربية",
    "Unseen chars: 𝄞 𝔘𝔫𝔦 ꙮ 🦩 ☃",
    "don't ' s won't I'm we've they're . , ! ? n't 'm 's 've 're",
    "\n\n\t\tindented\n    more\n",
    "mixed 中文and English混合text",
    "a  b   c    d     e",
    "x" * 50 + " " + "日本" * 40,
    "",
]

BYTE_TOKENS = [f"<0x{b:02X}>" for b in range(256)]


def _wrap(tok: Tokenizer, **kwargs: object) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_end|>"],
        **kwargs,
    )


def _corpus() -> list[str]:
    return CORPUS_LINES * 20


def build_byte_level() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    return _wrap(tok, clean_up_tokenization_spaces=False)


def build_sentencepiece_byte_fallback() -> PreTrainedTokenizerFast:
    """Llama-style: ▁ markers, byte fallback, Replace/ByteFallback/Fuse/Strip decoder."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, limit_alphabet=60, show_progress=False
    )
    tok.train_from_iterator(_corpus(), trainer)
    # Rebuild the model with <0xNN> byte tokens and byte_fallback switched on.
    state = json.loads(tok.to_str())
    vocab = state["model"]["vocab"]
    for byte_token in BYTE_TOKENS:
        vocab.setdefault(byte_token, len(vocab))
    state["model"]["byte_fallback"] = True
    tok = Tokenizer.from_str(json.dumps(state))
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return _wrap(tok, clean_up_tokenization_spaces=False)


def build_metaspace() -> PreTrainedTokenizerFast:
    """Metaspace pre-tokenizer and decoder (first-token leading-space strip), no byte fallback."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tok.decoder = decoders.Metaspace(prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=500, special_tokens=SPECIALS, limit_alphabet=120, show_progress=False
    )
    tok.train_from_iterator(_corpus(), trainer)
    return _wrap(tok, clean_up_tokenization_spaces=False)


def build_wordpiece() -> PreTrainedTokenizerFast:
    """BERT-like WordPiece with the WordPiece decoder (cleanup on) and transformers cleanup."""
    tok = Tokenizer(models.WordPiece(unk_token="<unk>"))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(cleanup=True)
    trainer = trainers.WordPieceTrainer(vocab_size=500, special_tokens=SPECIALS, show_progress=False)
    tok.train_from_iterator(_corpus(), trainer)
    return _wrap(tok, clean_up_tokenization_spaces=True)


BUILDERS = {
    "byte_level": build_byte_level,
    "sp_byte_fallback": build_sentencepiece_byte_fallback,
    "metaspace": build_metaspace,
    "wordpiece": build_wordpiece,
}

_CACHE: dict[str, PreTrainedTokenizerFast] = {}


def get_tokenizer(name: str) -> PreTrainedTokenizerFast:
    if name not in _CACHE:
        _CACHE[name] = BUILDERS[name]()
    return _CACHE[name]


def run_stream(tokenizer, ids: list[int], strategy: str = "auto", skip: bool = True) -> list[str]:
    """Feed ids one at a time; check the prefix/exactness contract; return the pieces."""
    expected = tokenizer.decode(ids, skip_special_tokens=skip)
    det = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip, strategy=strategy)
    mode = det.mode
    pieces: list[str] = []
    joined = ""
    for token_id in ids:
        piece = det.add(token_id)
        pieces.append(piece)
        joined += piece
        assert det.text == joined
        assert expected.startswith(joined), (joined, expected)
    tail = det.flush()
    assert joined + tail == expected
    assert det.text == expected
    assert det.ids == list(ids)
    assert det.mode == mode, "window mode fell back to full decoding"
    return pieces


def with_specials(tokenizer, ids: list[int]) -> list[int]:
    """Interleave special tokens at the start, middle and end."""
    bos, eos = tokenizer.convert_tokens_to_ids(["<s>", "</s>"])
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    mid = len(ids) // 2
    return [bos, bos] + ids[:mid] + [im_end] + ids[mid:] + [eos]


TOKENIZER_NAMES = list(BUILDERS)


@pytest.mark.parametrize("name", TOKENIZER_NAMES)
def test_auto_strategy_is_window_for_local_decoders(name: str) -> None:
    assert IncrementalDetokenizer(get_tokenizer(name)).mode == "window"


@pytest.mark.parametrize("strategy", ["auto", "full"])
@pytest.mark.parametrize("name", TOKENIZER_NAMES)
@pytest.mark.parametrize("text", TRICKY, ids=[f"s{i}" for i in range(len(TRICKY))])
def test_tricky_strings(name: str, strategy: str, text: str) -> None:
    tokenizer = get_tokenizer(name)
    ids = tokenizer.encode(text, add_special_tokens=False)
    run_stream(tokenizer, ids, strategy)


@pytest.mark.parametrize("name", TOKENIZER_NAMES)
def test_special_tokens_give_empty_pieces(name: str) -> None:
    tokenizer = get_tokenizer(name)
    special = set(tokenizer.all_special_ids)
    for text in TRICKY:
        ids = with_specials(tokenizer, tokenizer.encode(text, add_special_tokens=False))
        pieces = run_stream(tokenizer, ids)
        for token_id, piece in zip(ids, pieces):
            if token_id in special:
                assert piece == ""


@pytest.mark.parametrize("name", TOKENIZER_NAMES)
def test_keep_special_tokens(name: str) -> None:
    tokenizer = get_tokenizer(name)
    ids = with_specials(tokenizer, tokenizer.encode(TRICKY[0] + " " + TRICKY[1], add_special_tokens=False))
    run_stream(tokenizer, ids, skip=False)
    assert "<|im_end|>" in tokenizer.decode(ids, skip_special_tokens=False)


@pytest.mark.parametrize("name", TOKENIZER_NAMES)
def test_concatenated_corpus_long_stream(name: str) -> None:
    """Long enough to pass the periodic full-decode cross-checks (128, 256, ...)."""
    tokenizer = get_tokenizer(name)
    text = "\n".join(TRICKY + CORPUS_LINES) * 2
    ids = with_specials(tokenizer, tokenizer.encode(text, add_special_tokens=False))
    assert len(ids) > 300
    det = IncrementalDetokenizer(tokenizer)
    run_stream(tokenizer, ids)
    assert det.mode == "window"


def test_byte_level_split_character_is_held_back() -> None:
    tokenizer = get_tokenizer("byte_level")
    ids = tokenizer.encode("a𝄞", add_special_tokens=False)  # 𝄞 is 4 bytes, never merged
    assert len(ids) >= 3
    pieces = run_stream(tokenizer, ids)
    assert pieces[0] == "a"
    assert all(p == "" for p in pieces[1:-1])
    assert pieces[-1] == "𝄞"


def test_dangling_incomplete_character_comes_out_at_flush() -> None:
    tokenizer = get_tokenizer("byte_level")
    ids = tokenizer.encode("ok 𝄞", add_special_tokens=False)[:-1]  # drop the last byte
    det = IncrementalDetokenizer(tokenizer)
    joined = "".join(det.add_many(ids))
    assert joined == "ok "
    tail = det.flush()
    assert joined + tail == tokenizer.decode(ids, skip_special_tokens=True)
    assert tail.endswith("\ufffd")
    assert det.flush() == ""
    with pytest.raises(RuntimeError):
        det.add(ids[0])
    det.reset()
    assert det.text == "" and det.ids == []
    assert "".join(det.add_many(ids[:1])) + det.flush() == tokenizer.decode(ids[:1])


def test_sentencepiece_leading_space() -> None:
    tokenizer = get_tokenizer("sp_byte_fallback")
    ids = tokenizer.encode("Hello world", add_special_tokens=False)
    assert tokenizer.convert_ids_to_tokens(ids)[0].startswith("▁")
    pieces = run_stream(tokenizer, with_specials(tokenizer, ids))
    assert "".join(pieces) == "Hello world"
    assert not "".join(pieces).startswith(" ")


def test_wordpiece_cleanup_never_retracts() -> None:
    tokenizer = get_tokenizer("wordpiece")
    tokens = ["it", "n", "'", "t", "we", "'", "v", "##e", "I", "'", "m", ",", "it", "'", "s", "fine", "."]
    ids = tokenizer.convert_tokens_to_ids(tokens)
    assert tokenizer.unk_token_id not in ids
    run_stream(tokenizer, ids)
    run_stream(tokenizer, ids, "full")
    assert tokenizer.decode(ids) == "itn't we've I'm, it's fine."


@pytest.mark.parametrize("name", TOKENIZER_NAMES)
def test_random_id_sequences(name: str) -> None:
    tokenizer = get_tokenizer(name)
    vocab_size = len(tokenizer)
    rng = random.Random(1234)
    byte_ids = [i for t, i in tokenizer.get_vocab().items() if t in BYTE_TOKENS or len(t) == 1]
    for trial in range(150):
        length = rng.randint(1, 80)
        if trial % 3 == 0 and byte_ids:  # mostly single-byte tokens: lots of invalid UTF-8
            ids = [rng.choice(byte_ids) if rng.random() < 0.8 else rng.randrange(vocab_size) for _ in range(length)]
        else:
            ids = [rng.randrange(vocab_size) for _ in range(length)]
        for strategy in ("auto", "full"):
            run_stream(tokenizer, ids, strategy)


def test_full_mode_for_custom_decode() -> None:
    class ByteTokenizer:
        """Toy tokenizer: ids 0-255 are bytes, 256 is a special token."""

        all_special_ids = [256]

        def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
            data = b"".join(b"<sp>" if i == 256 else bytes([i]) for i in ids if i < 256 or not skip_special_tokens)
            return data.decode("utf-8", errors="replace")

    tok = ByteTokenizer()
    det = IncrementalDetokenizer(tok)
    assert det.mode == "full"
    data = list("naïve 😀 日本".encode()) + [256] + list(b"\xe6\x97") + list(b"ok")
    run_stream(tok, data)


def test_invalid_strategy() -> None:
    with pytest.raises(ValueError):
        IncrementalDetokenizer(get_tokenizer("byte_level"), strategy="fast")  # type: ignore[arg-type]


def test_window_mode_cost_is_flat() -> None:
    """Window mode does not grow with sequence length: every step decodes a short window, and the full decodes
    that cross-check it come at 1, 2, 4, ..., 64 and every 128 tokens (counted, not timed)."""
    tokenizer = get_tokenizer("byte_level")
    ids = tokenizer.encode(("\n".join(CORPUS_LINES) + "\n") * 12, add_special_tokens=False)[:2000]
    det = IncrementalDetokenizer(tokenizer)
    decoded: list[tuple[int, int]] = []  # (ids decoded, ids so far) per decode call
    real_decode = det._decode

    def counting(part):
        decoded.append((len(part), len(det._ids)))
        return real_decode(part)

    det._decode = counting
    for token in ids:
        det.add_many([token])
    det.flush()
    assert det.text == tokenizer.decode(ids, skip_special_tokens=True)
    windows = [length for length, total in decoded if length < total]
    full = [total for length, total in decoded if length == total and total > 1]
    assert windows and max(windows) <= 32
    assert len(full) <= 2 * (len(ids) // 128 + 8)


MODELS_DIR = Path.home() / ".cache" / "specdemo" / "models"
REAL_TOKENIZERS = ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "smollm2-135m"]


@pytest.mark.parametrize("folder", REAL_TOKENIZERS)
def test_real_offline_tokenizer(folder: str) -> None:
    path = MODELS_DIR / folder
    if not (path / "tokenizer.json").is_file():
        pytest.skip(f"offline tokenizer not converted (yet) at {path}")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    assert IncrementalDetokenizer(tokenizer).mode == "window"
    special = [i for i in tokenizer.all_special_ids if i is not None]
    for text in TRICKY + ["\n".join(CORPUS_LINES) * 3]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        run_stream(tokenizer, ids)
        mid = len(ids) // 2
        mixed = special[:1] + ids[:mid] + special[-1:] + ids[mid:] + special[:1]
        pieces = run_stream(tokenizer, mixed)
        assert all(p == "" for i, p in zip(mixed, pieces) if i in special)
        run_stream(tokenizer, mixed, skip=False)
    rng = random.Random(7)
    for _ in range(40):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 60))]
        run_stream(tokenizer, ids)
