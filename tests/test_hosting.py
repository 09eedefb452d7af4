"""A hosted app's model sources: custom models off unless asked for, Hub ids only (or the operator's folders), one
answer whether or not a path exists, capped downloads, caches that evict, and no remote code ever."""

from __future__ import annotations

import json
import os
import re
import types
from pathlib import Path

import pytest

import app as app_module
from specdemo.backends import loading, offline
from specdemo.backends.loading import LoadSettings, ModelLoadError, load_model
from specdemo.core.errors import InputError
from specdemo.session.config import SessionConfig
from specdemo.session.request import RaceRequest, check_request, hosted_source

REFUSED = "custom models on this server are Hub ids (owner/name) only"


# ----------------------------------------------------------------------------------------------------------------
# when an app is hosted, and what it offers then


@pytest.mark.parametrize("host,share,space,hosted", [
    ("127.0.0.1", False, False, False), ("localhost", False, False, False), ("::1", False, False, False),
    ("0.0.0.0", False, False, True), ("192.168.1.5", False, False, True), ("127.0.0.1", True, False, True),
    ("127.0.0.1", False, True, True),
])
def test_an_app_is_hosted_on_a_space_with_share_or_beyond_loopback(monkeypatch, host, share, space, hosted):
    monkeypatch.setattr(app_module.spaces_compat, "ON_SPACES", space)
    assert app_module.is_hosted(host, share) is hosted


def _config_of(monkeypatch, argv: list[str], env: dict[str, str] | None = None):
    """The AppConfig ``app.main(argv)`` would serve, without building or serving anything."""
    for name in ("SPECDEMO_CUSTOM_MODELS", "SPECDEMO_MODEL_ROOTS", "GRADIO_SERVER_NAME", "SPECDEMO_MAX_DOWNLOAD_GB"):
        monkeypatch.delenv(name, raising=False)
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(app_module.spaces_compat, "ON_SPACES", False)
    seen = {}
    from specdemo.app import ui

    monkeypatch.setattr(ui, "build_app", lambda config: seen.setdefault("config", config))
    monkeypatch.setattr(ui, "launch", lambda *args, **kwargs: None)
    assert app_module.main(argv) == 0
    return seen["config"]


def test_custom_models_are_off_when_hosted_unless_asked_for(monkeypatch, tmp_path):
    local = _config_of(monkeypatch, [])
    assert local.custom_models and not local.hosted
    for argv, env in (([ "--host", "0.0.0.0"], None), (["--share"], None), ([], {"GRADIO_SERVER_NAME": "0.0.0.0"})):
        hosted = _config_of(monkeypatch, argv, env)
        assert hosted.hosted and not hosted.custom_models, argv
    asked = _config_of(monkeypatch, ["--host", "0.0.0.0", "--custom-models", "--model-root", str(tmp_path),
                                     "--max-download-gb", "4"])
    assert asked.hosted and asked.custom_models and asked.model_roots == (str(tmp_path),)
    assert asked.max_download_gb == 4.0
    by_env = _config_of(monkeypatch, ["--share"], {"SPECDEMO_CUSTOM_MODELS": "1",
                                                    "SPECDEMO_MODEL_ROOTS": f"{tmp_path}{os.pathsep}/srv/models"})
    assert by_env.custom_models and by_env.model_roots == (str(tmp_path), "/srv/models")
    assert not _config_of(monkeypatch, ["--no-custom-models"]).custom_models


# ----------------------------------------------------------------------------------------------------------------
# which sources a hosted app races


def test_a_hosted_app_takes_hub_ids_and_offline_names_never_looked_up_on_disk():
    assert hosted_source("Qwen/Qwen2.5-0.5B-Instruct", ()) == ("Qwen/Qwen2.5-0.5B-Instruct", False)
    assert hosted_source("offline:qwen2.5-coder-1.5b", ()) == ("offline:qwen2.5-coder-1.5b", False)


def test_every_other_source_gets_one_answer_whether_or_not_it_exists(tmp_path):
    there = tmp_path / "model.gguf"
    there.write_bytes(b"GGUF")
    sources = ["/etc", "/etc/passwd", "~/.ssh", "~", str(there), str(tmp_path / "missing.gguf"), "../secrets",
               "./model", ".", "a/../b", "model.gguf", "C:\\models\\x", "/", "owner/name/extra", "tests"]
    answers = set()
    for source in sources:
        with pytest.raises(InputError) as caught:
            hosted_source(source, ())
        answers.add(str(caught.value))
    assert answers == {REFUSED}


def test_the_operators_model_roots_are_raced_by_their_real_path(tmp_path):
    root = tmp_path / "models"
    (root / "tiny").mkdir(parents=True)
    outside = tmp_path / "private"
    outside.mkdir()
    (root / "escape").symlink_to(outside)
    assert hosted_source(str(root / "tiny"), [str(root)]) == (str((root / "tiny").resolve()), True)
    assert hosted_source(str(root / "missing"), [str(root)])[1]  # under a root: the loader says what is missing
    refusal = "custom models on this server are Hub ids (owner/name) and paths under this server's model roots only"
    for source in (str(root / "escape"), str(root / "tiny" / ".." / ".." / "private"), str(outside), "/etc"):
        with pytest.raises(InputError, match=re.escape(refusal)):
            hosted_source(source, [str(root)])


def test_a_hosted_request_is_refused_before_any_model_work_and_marks_hub_ids_remote_only():
    config = SessionConfig(hosted=True, calibrate=False)
    for source in ("/etc", "/root/.ssh/id_rsa.gguf"):
        with pytest.raises(InputError, match=re.escape(REFUSED)) as caught:
            check_request(RaceRequest("hi", target=source, mode="ngram"), config)
        assert caught.value.field == "pair"
    checked = check_request(RaceRequest("hi", target="someone/model", draft="someone/draft", mode="draft"), config)
    assert checked.remote_only == {"someone/model", "someone/draft"}
    local = check_request(RaceRequest("hi", target="/etc", mode="ngram"), SessionConfig(calibrate=False))
    assert local.target_source == "/etc" and not local.remote_only  # a local app keeps today's freedom
    with pytest.raises(InputError, match="switched off"):
        check_request(RaceRequest("hi", target="someone/model", mode="ngram"),
                      SessionConfig(hosted=True, custom_models=False))


# ----------------------------------------------------------------------------------------------------------------
# the loader: remote-only sources, capped downloads, no remote code


def _hub_stub(monkeypatch, sizes: dict[str, int], folder: Path | None = None) -> list:
    """huggingface_hub's model_info and snapshot_download replaced: a repository of files of these sizes."""
    import huggingface_hub

    calls = []

    class Api:
        def model_info(self, repo_id, files_metadata=False):
            calls.append(("info", repo_id))
            return types.SimpleNamespace(siblings=[types.SimpleNamespace(rfilename=n, size=s) for n, s in sizes.items()])

    def snapshot(repo_id, allow_patterns=None, local_files_only=False):
        calls.append(("download", repo_id, tuple(allow_patterns or ())))
        if folder is None:
            raise OSError("no files here")
        return str(folder)

    monkeypatch.setattr(huggingface_hub, "HfApi", Api)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot)
    monkeypatch.setattr(loading, "_hub_reachable", lambda timeout=3.0: True)
    monkeypatch.setattr(loading, "_hub_offline", lambda: False)
    monkeypatch.setattr(loading, "trim_hub_cache", lambda keep=None, budget_bytes=None: [])
    return calls


def test_a_remote_only_source_is_never_read_from_disk(tmp_path, monkeypatch):
    from tiny import save_tiny_pair

    monkeypatch.chdir(tmp_path)
    target, _ = save_tiny_pair(tmp_path / "owner")  # ./owner/target exists, and looks like a Hub id
    calls = _hub_stub(monkeypatch, {"config.json": 10, "model.safetensors": 100})
    with pytest.raises(ModelLoadError):
        load_model("owner/target", LoadSettings(dtype="float32", device="cpu", local_files=False), progress=False)
    assert ("info", "owner/target") in calls and calls[-1][0] == "download"  # the Hub was asked, not the disk
    with pytest.raises(ModelLoadError, match="only Hub ids"):
        load_model(target, LoadSettings(dtype="float32", device="cpu", local_files=False), progress=False)
    assert load_model("owner/target", LoadSettings(dtype="float32", device="cpu"), progress=False).model is not None


def test_a_hub_download_over_the_cap_is_refused_before_anything_is_fetched(monkeypatch):
    calls = _hub_stub(monkeypatch, {"config.json": 10, "model-1.safetensors": 9 * 10**9,
                                    "model-2.safetensors": 9 * 10**9, "pytorch_model.bin": 10**12})
    settings = LoadSettings(dtype="float32", device="cpu", local_files=False, max_download_bytes=16 * 10**9)
    with pytest.raises(ModelLoadError, match=r"its weights take 18.0 GB, more than the 16.0 GB this server downloads"):
        load_model("big/model", settings, progress=False)
    assert [c[0] for c in calls] == ["info"]
    calls = _hub_stub(monkeypatch, {"config.json": 10, "pytorch_model.bin": 10})
    with pytest.raises(ModelLoadError, match="no safetensors weights"):
        load_model("pickled/model", settings, progress=False)


def test_a_capped_download_fetches_configs_tokenizers_and_safetensors_only(tmp_path, monkeypatch):
    from tiny import save_tiny_pair

    target, _ = save_tiny_pair(tmp_path)
    calls = _hub_stub(monkeypatch, {"config.json": 10, "model.safetensors": 100}, folder=Path(target))
    settings = LoadSettings(dtype="float32", device="cpu", local_files=False, max_download_bytes=10**9)
    loaded = load_model("someone/tiny", settings, progress=False)
    assert loaded.source == "someone/tiny"
    patterns = calls[-1][2]
    assert "*.safetensors" in patterns and not any(p.endswith((".bin", ".py", ".pt", ".pth", ".gguf")) for p in patterns)


def test_remote_code_is_never_trusted(tmp_path, monkeypatch):
    from tiny import save_tiny_pair
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target, _ = save_tiny_pair(tmp_path)
    seen = []
    real_model, real_tokenizer = AutoModelForCausalLM.from_pretrained, AutoTokenizer.from_pretrained

    def spy(real):
        def call(*args, **kwargs):
            seen.append(kwargs.get("trust_remote_code"))
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", spy(real_model))
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", spy(real_tokenizer))
    load_model(target, LoadSettings(dtype="float32", device="cpu"), progress=False)
    assert seen == [False, False]
    assert "trust_remote_code" not in {f.name for f in __import__("dataclasses").fields(LoadSettings)}

    # a checkpoint that asks for its own code: refused in one line, its code never run
    hostile = tmp_path / "hostile"
    hostile.mkdir()
    marker = tmp_path / "ran"
    (hostile / "modeling_evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    config = json.loads((Path(target) / "config.json").read_text())
    config.update(model_type="evil", architectures=["EvilForCausalLM"],
                  auto_map={"AutoConfig": "modeling_evil.EvilConfig",
                            "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"})
    (hostile / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError) as caught:
        load_model(str(hostile), LoadSettings(dtype="float32", device="cpu"), progress=False)
    assert "\n" not in str(caught.value) and not marker.exists()


# ----------------------------------------------------------------------------------------------------------------
# caches that evict


def _conversion(models: Path, name: str, size: int, age: float) -> Path:
    folder = models / name
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"0" * size)
    marker = folder / offline.MARKER_NAME
    marker.write_text("{}")
    os.utime(marker, (age, age))
    return folder


def test_conversions_of_local_gguf_files_are_evicted_oldest_first(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEMO_CACHE", str(tmp_path))
    models = tmp_path / "models"
    pack = _conversion(models, "qwen2.5-coder-1.5b", 5000, 1.0)  # the offline pack's: never evicted
    old = _conversion(models, "gguf-aaaa", 3000, 10.0)
    newer = _conversion(models, "gguf-bbbb", 3000, 20.0)
    kept = _conversion(models, "gguf-cccc", 3000, 5.0)  # the oldest, but just used
    assert offline.trim_conversions(keep=kept, budget_bytes=6500) == [old]
    assert pack.exists() and newer.exists() and kept.exists()
    assert offline.trim_conversions(budget_bytes=100) == [kept, newer]
    assert pack.exists()


def test_the_hub_cache_is_trimmed_to_its_budget_least_recently_used_first(monkeypatch):
    import huggingface_hub

    deleted = []

    def repo(repo_id, size, used):
        return types.SimpleNamespace(repo_id=repo_id, repo_type="model", size_on_disk=size, last_accessed=used,
                                     revisions=[types.SimpleNamespace(commit_hash=f"{repo_id}-rev")])

    class Cache:
        repos = [repo("a/old", 40, 1.0), repo("b/newer", 40, 2.0), repo("c/now", 40, 0.5)]
        size_on_disk = 120

        def delete_revisions(self, *hashes):
            return types.SimpleNamespace(execute=lambda: deleted.extend(hashes))

    monkeypatch.setattr(huggingface_hub, "scan_cache_dir", lambda: Cache())
    assert loading.trim_hub_cache(keep="c/now", budget_bytes=50) == ["a/old", "b/newer"]
    assert deleted == ["a/old-rev", "b/newer-rev"]
    monkeypatch.setenv("SPECDEMO_HUB_CACHE_GB", "1")
    assert loading.trim_hub_cache(keep="c/now") == []
