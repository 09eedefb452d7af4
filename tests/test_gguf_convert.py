"""A GGUF converted straight into the stored kind a race reads: int8 weights and scales bit-identical to the old path
(transformers' float32 load, then the format), conversions resumable, refused in one line on a full disk."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specdemo.backends import formats, gguf_convert, offline
from specdemo.backends.gguf_embedding import GgufRowsEmbedding
from specdemo.backends.loading import LoadSettings, clear_model_cache, load_model

from test_real_gguf import write_tiny_qwen2_gguf

pytest.importorskip("gguf")


@pytest.fixture(scope="module", params=["f32-untied", "q8-tied"])
def tiny_gguf(request, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / f"tiny-{request.param}.gguf"
    quantized, tied = request.param.startswith("q8"), request.param.endswith("-tied")
    write_tiny_qwen2_gguf(path, seed=3, layers=5, tied=tied, quantized=quantized)
    return path


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SPECDEMO_CACHE", str(tmp_path / "cache"))
    clear_model_cache()
    yield tmp_path / "cache"
    clear_model_cache()


def _old_path(gguf: Path, fmt: str) -> torch.nn.Module:
    """What the float32 conversion gave: transformers' GGUF load in float32 saved as a folder, read back in
    bfloat16 (the dtype an int8-weight format loads in), then the format."""
    from transformers import AutoModelForCausalLM

    folder = gguf.parent / f"{gguf.stem}-float32"
    if not folder.is_dir():
        _old_float32(gguf).save_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16).eval()
    if fmt in formats.INT8_FORMATS:
        formats.to_int8_format(model, fmt)
    return model


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor a model computes with: parameters, buffers, and each w8a8 layer's int8 values."""
    state = {name: tensor for name, tensor in model.state_dict().items()}
    state.update({f"buffer:{name}": tensor for name, tensor in model.named_buffers()})
    for name, module in model.named_modules():
        if isinstance(module, GgufRowsEmbedding):  # the table kept in its GGUF blocks: the rows it gives
            del state[f"{name}.blocks"], state[f"buffer:{name}.blocks"]
            state[f"{name}.weight"] = module.weight
        if isinstance(module, formats.W8A8Linear):
            state[f"{name}.int8"] = module.dequantized()  # the stored int8 values times their scales, in bfloat16
            state[f"{name}.two_parts"] = torch.tensor(module.two_parts)
    return state


@pytest.mark.parametrize("fmt", ["w8a8", "int8", "bfloat16", "float32"])
def test_direct_conversion_is_bit_identical_to_the_float32_path(tiny_gguf: Path, cache: Path, fmt: str) -> None:
    loaded = load_model(str(tiny_gguf), LoadSettings(dtype=fmt, device="cpu"), progress=False)
    old = _old_float32(tiny_gguf) if fmt == "float32" else _old_path(tiny_gguf, fmt)
    new_state, old_state = _state(loaded.model), _state(old)
    assert sorted(new_state) == sorted(old_state)
    for name, tensor in old_state.items():
        assert new_state[name].dtype == tensor.dtype, name
        assert torch.equal(new_state[name], tensor), name
    assert loaded.format == fmt
    folders = [p.name for p in (cache / "models").iterdir() if not p.name.startswith(".")]
    assert folders == [f"gguf-{offline.cached_file_sha256(tiny_gguf, progress=False)[:16]}."
                       f"{gguf_convert.storage_for(fmt)}"]
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.inference_mode():
        assert torch.equal(loaded.model(ids).logits, old(ids).logits)


def _old_float32(gguf: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, GgufConfig

    return AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32,
                                                quantization_config=GgufConfig(dequantize=True)).eval()


def test_int8_storage_keeps_no_float_copy(tiny_gguf: Path, cache: Path) -> None:
    folder = offline.converted_from_gguf(tiny_gguf, gguf_convert.INT8_STORAGE, progress=False)
    from safetensors import safe_open

    index = json.loads((folder / gguf_convert.INDEX_NAME).read_text())
    dtypes = {}
    for shard in set(index["weight_map"].values()):
        with safe_open(str(folder / shard), framework="pt") as handle:
            dtypes.update({name: handle.get_slice(name).get_dtype() for name in handle.keys()})
    assert dtypes["lm_head.qweight"] == "I8" and dtypes["lm_head.scale"] == "F32"
    assert dtypes["model.layers.0.mlp.down_proj.qweight"] == "I8"
    assert "model.layers.0.mlp.down_proj.weight" not in dtypes
    plain = {dtype for name, dtype in dtypes.items() if not name.endswith(("qweight", "scale", "gguf_blocks",
                                                                           "gguf_type"))}
    assert plain == {"BF16"}
    if "q8" in tiny_gguf.name:  # a quantised embedding stays in its blocks
        assert dtypes["model.embed_tokens.gguf_blocks"] == "U8" and "model.embed_tokens.weight" not in dtypes
    marker = json.loads((folder / offline.MARKER_NAME).read_text())
    assert marker["storage"] == "int8" and marker["format"] == offline.MARKER_FORMAT


def test_a_cut_off_conversion_resumes_and_never_loads(tiny_gguf: Path, cache: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gguf_convert, "LAYERS_PER_SHARD", 2)  # 5 layers: shards of 2, 2, 1 layers, then the rest
    written: list[str] = []
    real_write = gguf_convert._write_shard

    def killed_after_two(path: Path, tensors: dict, out_dir: Path) -> None:
        if len(written) == 2:
            raise KeyboardInterrupt("killed mid-conversion")
        real_write(path, tensors, out_dir)
        written.append(path.name)

    monkeypatch.setattr(gguf_convert, "_write_shard", killed_after_two)
    with pytest.raises(KeyboardInterrupt):
        offline.converted_from_gguf(tiny_gguf, "int8", progress=False)
    models = cache / "models"
    assert [p.name for p in models.iterdir() if not p.name.startswith(".")] == []  # nothing that loads
    partial = next(models.glob(".*.partial"))
    assert sorted(p.name for p in partial.glob("*.safetensors")) == sorted(written)

    redone: list[str] = []

    def counting(path: Path, tensors: dict, out_dir: Path) -> None:
        redone.append(path.name)
        real_write(path, tensors, out_dir)

    monkeypatch.setattr(gguf_convert, "_write_shard", counting)
    folder = offline.converted_from_gguf(tiny_gguf, "int8", progress=False)
    assert len(redone) == 2 and not set(redone) & set(written)  # only the missing shards were converted
    assert not partial.exists() and offline.folder_ready(folder, offline.cached_file_sha256(tiny_gguf), "int8")
    resumed = _state(load_model(str(tiny_gguf), LoadSettings(dtype="w8a8", device="cpu"), progress=False).model)
    clear_model_cache()
    import shutil

    shutil.rmtree(folder)
    monkeypatch.setattr(gguf_convert, "_write_shard", real_write)
    whole = _state(load_model(str(tiny_gguf), LoadSettings(dtype="w8a8", device="cpu"), progress=False).model)
    assert all(torch.equal(resumed[name], whole[name]) for name in whole)


def test_a_shard_of_another_plan_is_not_kept(tiny_gguf: Path, cache: Path) -> None:
    sha = offline.cached_file_sha256(tiny_gguf, progress=False)
    partial = cache / "models" / f".gguf-{sha[:16]}.int8.partial"
    partial.mkdir(parents=True)
    (partial / "model-00001-of-00002.safetensors").write_bytes(b"half a file")
    (partial / gguf_convert.PLAN_NAME).write_text(json.dumps({"identity": "another"}))
    folder = offline.converted_from_gguf(tiny_gguf, "int8", progress=False)
    assert (folder / offline.MARKER_NAME).is_file() and not partial.exists()


def test_a_full_disk_is_refused_in_one_line_naming_the_folder(tiny_gguf: Path, cache: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(offline.OfflinePackError) as error:
        offline.converted_from_gguf(tiny_gguf, "int8", progress=False)
    message = str(error.value)
    assert "\n" not in message and str(cache / "models") in message and "GB" in message
    assert [p.name for p in (cache / "models").iterdir() if not p.name.startswith(".")] == []


def test_a_disk_that_fills_during_the_conversion_says_so(tiny_gguf: Path, cache: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("safetensors.torch.save_file", full)
    with pytest.raises(offline.OfflinePackError, match="disk is full") as error:
        offline.converted_from_gguf(tiny_gguf, "bfloat16", progress=False)
    assert str(cache / "models") in str(error.value)
