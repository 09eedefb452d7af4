"""Tiny random models, tokenizers and an AppConfig for the app's tests (CPU, float32, no network, seconds)."""

from __future__ import annotations

import copy
import socket
import time
from contextlib import contextmanager
from functools import lru_cache

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from specdemo.backends.loading import LoadedModel, LoadSettings, ModelLoadError
from specdemo.session.presets import PairPreset
from specdemo.session.prompts import Prompt

SPECIALS = ["<unk>", "<s>", "</s>", "<|im_end|>"]
WORDS = (
    "the a cat dog sat on mat and ran to house def return if else for in print x y z = + ( ) : , . "
    "hello world code fast slow model draft target token every round we see it is not yes no "
    "one two three four five six seven eight nine ten red green blue <b> & \" ' < > { } $ "
).split()
CHAT_TEMPLATE = "{% for m in messages %}<s> {{ m['content'] }} </s> {% endfor %}{% if add_generation_prompt %}<s> {% endif %}"
VOCAB = 128



@contextmanager
def one_thread():
    """Tiny models gain nothing from threads, and OpenMP threads spinning against other processes on a busy
    2-core machine make them 10-50x slower: one torch thread while the app's tests run, restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def tokenizer(shift: int = 0) -> PreTrainedTokenizerFast:
    """A word-level tokenizer (words decode with spaces between them); ``shift`` permutes the ids."""
    words = SPECIALS + [w for w in dict.fromkeys(WORDS + ["\n", "    "]) if w not in SPECIALS]
    words += [f"w{i}" for i in range(VOCAB - len(words))]
    assert len(words) == VOCAB
    if shift:
        body = words[len(SPECIALS) :]
        words = SPECIALS + body[shift:] + body[:shift]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>", clean_up_tokenization_spaces=False
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _model(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=None,
        pad_token_id=None,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight[2].zero_()  # "</s>" (EOS) rarely wins: runs go to max_new_tokens
    return model


@lru_cache(maxsize=None)
def _models() -> dict[str, LoadedModel]:
    target = _model(11)
    draft = copy.deepcopy(target)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():  # a perturbed copy: agrees with the target often, not always
        draft.lm_head.weight.add_(0.012 * torch.randn(draft.lm_head.weight.shape, generator=gen))
    slow = copy.deepcopy(target)
    fast_forward = slow.forward

    def slow_forward(*args, **kwargs):
        time.sleep(0.02)  # a target that takes its time: races last seconds, so Stop has something to stop
        return fast_forward(*args, **kwargs)

    slow.forward = slow_forward
    cpu = torch.device("cpu")
    settings = LoadSettings(dtype="float32", device="cpu")
    made = {
        "tiny:target": LoadedModel("tiny:target", target, tokenizer(), cpu, torch.float32, settings),
        "tiny:draft": LoadedModel("tiny:draft", draft, tokenizer(), cpu, torch.float32, settings),
        "tiny:slow": LoadedModel("tiny:slow", slow, tokenizer(), cpu, torch.float32, settings),
        "tiny:other": LoadedModel("tiny:other", _model(12), tokenizer(shift=7), cpu, torch.float32, settings),
    }
    return made


def loader(source: str, settings: LoadSettings = LoadSettings(), progress: bool = True, on_progress=None) -> LoadedModel:
    """A stand-in for ``load_model``: tiny models by name, ModelLoadError otherwise."""
    if on_progress is not None:
        on_progress(0.0, f"Loading {source}")
    if source == "tiny:broken":
        raise ModelLoadError(f"cannot load '{source}': the folder has no config.json")
    try:
        loaded = _models()[source]
    except KeyError:
        raise ModelLoadError(f"cannot load '{source}': no such model on the Hugging Face Hub (or it is private)") from None
    if on_progress is not None:
        on_progress(1.0, f"Loaded {source}")
    return loaded


PRESETS = {
    "tiny": PairPreset("tiny", "Tiny pair (random weights)", "tiny:target", "tiny:draft", "Tiny random test pair.", "CPU ok"),
    "tiny-mismatch": PairPreset(
        "tiny-mismatch", "Tiny mismatched pair", "tiny:target", "tiny:other", "Different tokenizers.", "CPU ok"
    ),
    "tiny-slow": PairPreset("tiny-slow", "Tiny slow pair", "tiny:slow", "tiny:draft", "A slow target.", "CPU ok"),
    "tiny-broken": PairPreset("tiny-broken", "Tiny broken pair", "tiny:broken", "tiny:draft", "Fails to load.", "CPU ok"),
}

EXAMPLES = [
    Prompt("c1", "chat", "hello world the cat sat on the mat"),
    Prompt("w1", "code-writing", "def f ( x ) : return x + y"),
    Prompt("e1", "code-editing", "for x in y : print ( x )"),
    Prompt("s1", "summarization", "the dog ran to the house and the cat sat"),
    Prompt("t1", "translation", "red green blue one two three"),
]


def config(**overrides):
    from specdemo.app.config import AppConfig

    values = dict(
        pair="tiny",
        device="cpu",
        dtype="float32",
        presets=dict(PRESETS),
        loader=loader,
        forget_models=None,
        update_interval=0.0,
        max_new_tokens=40,
        max_new_tokens_limit=512,
        warmup_tokens=0,
        examples=list(EXAMPLES),
        quantization_reason="4-bit/8-bit needs a CUDA GPU (bitsandbytes); none found",
        gpu_duration=60,
        calibrate=False,  # tests that want the cost curve ask for it (and give it a cache folder of their own)
    )
    values.update(overrides)
    return AppConfig(**values)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def served_with_spied_races(spied: list, **overrides):
    """The app on tiny models served on a free port (yields its URL), with the decoders of every race appended to
    ``spied``, to see when a race is closed."""
    from specdemo.app import ui
    from specdemo.session import racer

    real_race = racer.race

    def spying_race(plain, spec):
        spied.extend([plain, spec])
        return real_race(plain, spec)

    racer.race = spying_race
    demo = ui.build_app(config(**overrides))
    port = free_port()
    try:
        ui.launch(demo, server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
        yield f"http://127.0.0.1:{port}/"
    finally:
        demo.close()
        racer.race = real_race
