"""Loading a causal LM and its tokenizer from any supported source, with a process-wide cache.

Sources: ``offline:<name>`` (the offline pack), a local ``.gguf`` file, a local transformers folder,
or a Hugging Face Hub id. Remote code is never trusted (``trust_remote_code=False`` on every call). With
``LoadSettings(local_files=False)`` (a hosted app's custom models) a source is an offline name or a Hub id only,
never looked up on this machine's disk, and a Hub download is capped in size (``max_download_bytes``), fetched as
safetensors only, and the Hub cache it lands in keeps at most ``SPECDEMO_HUB_CACHE_GB`` (oldest used go first).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import socket
import threading
import weakref
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from ..core.errors import first_line
from . import formats, gguf_convert, int8_store, offline
from .memory import return_free_memory

logger = logging.getLogger(__name__)

ProgressCallback = Callable[[float, str], None]
CacheKey = tuple[str, str, str, str | None, bool]
#: a Hugging Face Hub id: owner/name, letters, digits, ".", "_" and "-" (what the Hub allows)
HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}")
#: what a capped Hub download fetches: configs, tokenizer files and safetensors weights (no pickles, no code)
HUB_DOWNLOAD_PATTERNS = ("*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja")
#: the Hub cache's size a hosted app keeps, in GB, unless SPECDEMO_HUB_CACHE_GB says otherwise
DEFAULT_HUB_CACHE_GB = 60.0

QUANTIZATIONS = (None, "4bit", "8bit")

_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
}

#: the number formats a target can run in: a torch dtype, or an int8-weight format (CPU only, see
#: :mod:`specdemo.backends.formats`): int8 (bfloat16 activations) or w8a8 (int8 activations with a scale per token)
FORMATS = ("bfloat16", "float16", "float32", formats.INT8, formats.W8A8)


class ModelLoadError(Exception):
    """A model could not be loaded; the message is one line meant for the user."""


@dataclass(frozen=True)
class LoadSettings:
    """How to load a model."""

    dtype: str = "auto"
    device: str = "auto"
    quantization: str | None = None  # None, "4bit", "8bit"
    #: may the source be a file or folder on this machine (False: an offline name or a Hub id only)
    local_files: bool = True
    #: the largest Hub download allowed, in bytes (None: no cap); checked before anything is fetched
    max_download_bytes: int | None = None


@dataclass
class LoadedModel:
    """A loaded model with its tokenizer and where/how it was loaded."""

    source: str
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    device: torch.device
    dtype: torch.dtype
    settings: LoadSettings = field(default_factory=LoadSettings)

    @property
    def format(self) -> str:
        """The number format the model runs in, as --dtype spells it: ``int8``, ``w8a8`` or the dtype's name."""
        return formats.int8_format_of(self.model) or str(self.dtype).removeprefix("torch.")

    @property
    def eos_token_ids(self) -> list[int]:
        """End-of-sequence ids: generation_config's, then the tokenizer's, without duplicates."""
        ids: list[int] = []
        gen = getattr(self.model, "generation_config", None)
        configured = getattr(gen, "eos_token_id", None) if gen is not None else None
        if isinstance(configured, int):
            ids.append(configured)
        elif configured is not None:
            ids.extend(int(i) for i in configured)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.append(int(self.tokenizer.eos_token_id))
        return list(dict.fromkeys(ids))

    @property
    def max_context(self) -> int | None:
        """The model's maximum context length (``max_position_embeddings``), if known."""
        value = getattr(self.model.config, "max_position_embeddings", None)
        return int(value) if isinstance(value, int) and value > 0 else None


# ---------------------------------------------------------------------------------------------
# Devices and dtypes


def _mps_available() -> bool:
    backend = getattr(torch.backends, "mps", None)
    return bool(backend is not None and backend.is_available())


def resolve_device(name: str) -> torch.device:
    """``auto`` picks cuda, then mps, then cpu; explicit names are checked for availability."""
    text = (name or "auto").strip().lower()
    if text == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if _mps_available():
            return torch.device("mps")
        return torch.device("cpu")
    if text == "cpu":
        return torch.device("cpu")
    if text == "mps":
        if not _mps_available():
            raise ModelLoadError("device 'mps' is not available on this machine")
        return torch.device("mps")
    if text == "cuda" or text.startswith("cuda:"):
        index_text = text.partition(":")[2]
        if index_text and not index_text.isdigit():
            raise ModelLoadError(f"invalid device '{name}'; use cuda or cuda:N")
        if not torch.cuda.is_available():
            raise ModelLoadError(f"device '{name}' is not available: no CUDA GPU found")
        if index_text:
            index = int(index_text)
            count = torch.cuda.device_count()
            if index >= count:
                raise ModelLoadError(f"device '{name}' is not available: this machine has {count} CUDA device(s)")
            return torch.device("cuda", index)
        return torch.device("cuda")
    raise ModelLoadError(f"unknown device '{name}'; use auto, cpu, cuda, cuda:N or mps")


def resolve_format(name: str, device: torch.device) -> str:
    """The number format ``name`` stands for on ``device``, as one of :data:`FORMATS`.

    ``auto`` is bfloat16 on CPU and on CUDA when supported (else float16), float16 on MPS. The app and the bench
    refine ``auto`` on a CPU by measurement (:func:`specdemo.session.calibration.choose_format`).
    """
    text = (name or "auto").strip().lower().removeprefix("torch.")
    if text == "auto":
        if device.type == "cuda":
            return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
        if device.type == "mps":
            return "float16"
        return "bfloat16"
    if text in formats.INT8_FORMATS:
        if device.type != "cpu":
            raise ModelLoadError(f"the {text} format is for CPU targets; on a GPU use --load-in 8bit")
        if text == formats.INT8 and not formats.int8_kernel_available():
            raise ModelLoadError("the int8 format needs a torch build with the weight-only int8 CPU kernel")
        if text == formats.W8A8 and not formats.w8a8_kernel_available():
            raise ModelLoadError("the w8a8 format needs a torch build with FBGEMM (x86 CPUs)")
        if text == formats.W8A8:
            try:
                formats.w8a8_kernel()
            except ValueError as error:  # a misspelt SPECDEMO_W8A8_KERNEL: one line, before any loading
                raise ModelLoadError(str(error)) from None
        return text
    try:
        return str(_DTYPES[text]).removeprefix("torch.")
    except KeyError:
        raise ModelLoadError(f"unknown dtype '{name}'; use auto, {', '.join(FORMATS)}") from None


def draft_dtype(name: str) -> str:
    """The dtype a draft loads in beside a target in ``name``: drafts of an int8-weight target load in bfloat16 and
    make their own int8 copy (see :func:`specdemo.methods.base.int8_copy`); a draft's rows need no batch invariance."""
    return "bfloat16" if (name or "").strip().lower() in formats.INT8_FORMATS else name


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The activation dtype of the format ``name`` resolves to on ``device`` (bfloat16 for int8, float32 for
    w8a8)."""
    return _activation_dtype(resolve_format(name, device))


def _activation_dtype(fmt: str) -> torch.dtype:
    return formats.activation_dtype(fmt) if fmt in formats.INT8_FORMATS else _DTYPES[fmt]


# ---------------------------------------------------------------------------------------------
# Cache


_cache: dict[CacheKey, LoadedModel] = {}
_cache_lock = threading.Lock()
_key_locks: dict[CacheKey, threading.Lock] = {}


def clear_model_cache(keep: Collection[CacheKey] = ()) -> None:
    """Forget every cached model but those under the keys in ``keep`` (memory is freed once no one else holds
    them)."""
    with _cache_lock:
        for key in [key for key in _cache if key not in keep]:
            del _cache[key]
        for key in [key for key in _key_locks if key not in keep]:
            del _key_locks[key]


def _resolve(source: str, settings: LoadSettings) -> tuple[CacheKey, torch.device, torch.dtype]:
    """The cache key of ``source`` with ``settings``, and the device and dtype it resolves to (loads nothing)."""
    if not source or not source.strip():
        raise ModelLoadError("no model given")
    device = resolve_device(settings.device)
    fmt = resolve_format(settings.dtype, device)
    if not settings.local_files:
        _check_remote_source(source)
    key = (_normalise_source(source, settings.local_files), fmt, str(device), settings.quantization,
           settings.local_files)
    return key, device, _activation_dtype(fmt)


def cache_key(source: str, settings: LoadSettings = LoadSettings()) -> CacheKey:
    """The key under which :func:`load_model` caches ``source`` loaded with ``settings`` (loads nothing)."""
    return _resolve(source, settings)[0]


def forget_model(source: str, settings: LoadSettings = LoadSettings()) -> None:
    """Drop ``source`` loaded with ``settings`` from the cache (freed once no one else holds it)."""
    key = _resolve(source, settings)[0]
    with _cache_lock:
        _cache.pop(key, None)
        _key_locks.pop(key, None)
    return_free_memory()


def cached_models() -> list[CacheKey]:
    """Keys (source, format, device, quantization, local_files) of the cached models."""
    with _cache_lock:
        return list(_cache)


def _normalise_source(source: str, local_files: bool = True) -> str:
    text = source.strip()
    if offline.is_offline_source(text):
        return offline.OFFLINE_PREFIX + offline.offline_name(text)
    if local_files and _looks_like_path(text):
        return str(Path(text).expanduser().resolve())
    return text


def _looks_like_path(text: str) -> bool:
    if text.startswith(("/", "./", "../", "~", ".\\", "..\\")) or text in (".", ".."):
        return True
    if text.lower().endswith(".gguf") or os.path.isabs(text):
        return True
    return Path(text).expanduser().exists()


def _check_remote_source(source: str) -> None:
    """Refuse, in one line and without looking at the disk, a source that is neither an offline name nor a Hub id."""
    text = source.strip()
    if offline.is_offline_source(text) or (HUB_ID.fullmatch(text) and ".." not in text):
        return
    raise ModelLoadError(f"cannot load '{text}': only Hub ids (owner/name) and offline:NAME models are allowed here")


def load_model(
    source: str,
    settings: LoadSettings = LoadSettings(),
    progress: bool = True,
    on_progress: ProgressCallback | None = None,
) -> LoadedModel:
    """Load (or fetch from the process-wide cache) the model and tokenizer named by ``source``."""
    key, device, dtype = _resolve(source, settings)  # a hosted app's remote-only source is checked here
    source = key[0]  # normalised: an offline name, a resolved path or a Hub id
    _check_quantization(settings.quantization, device)

    with _cache_lock:
        hit = _cache.get(key)
        if hit is not None:
            return hit
        key_lock = _key_locks.setdefault(key, threading.Lock())
    with key_lock:
        with _cache_lock:
            hit = _cache.get(key)
        if hit is not None:
            return hit
        loaded = _load_uncached(source, settings, device, dtype, progress, on_progress)
        return_free_memory()  # e.g. the float32 tensors a bfloat16 model was cast from
        with _cache_lock:
            _cache[key] = loaded
        return loaded


def _check_quantization(quantization: str | None, device: torch.device) -> None:
    if quantization not in QUANTIZATIONS:
        raise ModelLoadError(f"unknown quantization '{quantization}'; use none, 4bit or 8bit")
    if quantization is None:
        return
    if device.type != "cuda":
        raise ModelLoadError("4-bit/8-bit loading needs a CUDA GPU (bitsandbytes); this machine has none")
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ModelLoadError("4-bit/8-bit loading needs the bitsandbytes package: pip install bitsandbytes")


# ---------------------------------------------------------------------------------------------
# Resolving a source to something from_pretrained can read


def _resolve_source(
    source: str, progress: bool, on_progress: ProgressCallback | None, settings: LoadSettings = LoadSettings()
) -> tuple[str, bool]:
    """``(path_or_hub_id, is_local)`` for ``source``; converts offline/GGUF sources first, and fetches a Hub id
    whole (capped, safetensors only) when local files are off."""
    if offline.is_offline_source(source):
        name = offline.offline_name(source)
        if name not in offline.OFFLINE_MODELS:
            known = ", ".join(offline.OFFLINE_PREFIX + k for k in offline.OFFLINE_MODELS)
            raise ModelLoadError(f"unknown offline model '{name}'; known: {known}")
        missing = offline.missing_distributions(name)
        if missing:
            raise ModelLoadError(
                f"offline model '{name}' is not installed (missing {', '.join(missing)}); "
                f"install the pack with: {offline.INSTALL_HINT}"
            )
        try:
            return str(offline.converted_folder(name, _storage(settings), progress=progress,
                                                on_progress=on_progress)), True
        except offline.OfflinePackError as err:
            raise ModelLoadError(str(err)) from err
        finally:
            gguf_convert.forget_opened()  # the file and what a format measurement kept of it

    if not settings.local_files:
        return str(_capped_snapshot(source, settings.max_download_bytes)), True
    if _looks_like_path(source):
        path = Path(source).expanduser()
        if path.is_file():
            if path.suffix.lower() != ".gguf":
                raise ModelLoadError(f"cannot load '{source}': a file must be a .gguf; otherwise give a model folder")
            try:
                return str(offline.converted_from_gguf(path, _storage(settings), progress=progress,
                                                       on_progress=on_progress)), True
            except offline.OfflinePackError as err:
                raise ModelLoadError(str(err)) from err
            finally:
                gguf_convert.forget_opened()
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise ModelLoadError(f"cannot load '{source}': the folder has no config.json")
            return str(path), True
        raise ModelLoadError(f"cannot load '{source}': no such file or folder")
    return source, False


def _storage(settings: LoadSettings) -> str:
    """The stored kind a GGUF converts into for ``settings``' number format (int8 for both int8-weight formats)."""
    return gguf_convert.storage_for(resolve_format(settings.dtype, resolve_device(settings.device)))


def _from_gguf(name: str, settings: LoadSettings) -> bool:
    """Whether the (normalised) source ``name`` is read from a GGUF file: an offline model or a local ``.gguf``."""
    return offline.is_offline_source(name) or (settings.local_files and name.lower().endswith(".gguf"))


def prepare_weights(source: str, settings: LoadSettings = LoadSettings(), convert: bool = True) -> None:
    """Make ``source``'s weights ready to load with ``settings`` without loading them: an offline model or a local
    GGUF is joined and verified (hashed), then, with ``convert``, converted, as the first load would do; anything
    else is left alone. Lets a caller prepare a draft while the target is prepared."""
    name = _resolve(source, settings)[0][0]
    if not _from_gguf(name, settings):
        return
    if convert:
        _resolve_source(name, False, None, settings)
    elif bytes_to_convert(name, settings):  # joined, verified and parsed (kept for the conversion that follows)
        gguf_convert.open_gguf(offline.joined_gguf(offline.offline_name(name), progress=False))
    elif not offline.is_offline_source(name):
        offline.cached_file_sha256(Path(name), progress=False)


def load_first_layers(source: str, settings: LoadSettings, layers: int) -> tuple[PreTrainedModel, int]:
    """``source`` cut to its first ``layers`` decoder layers, with its real weights in bfloat16 (embedding, final
    norm and head kept), and the number of layers of the whole model: what a format is measured on before the
    whole model is converted or loaded. A GGUF (offline or local) dequantises only those tensors."""
    name = _resolve(source, settings)[0][0]
    try:
        if _from_gguf(name, settings):
            if offline.is_offline_source(name):
                gguf = offline.joined_gguf(offline.offline_name(name), progress=False)
            else:
                gguf = Path(name)
            return gguf_convert.load_first_layers(gguf, layers)
        location, is_local = _resolve_source(name, False, None, settings)
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(location, trust_remote_code=False, local_files_only=is_local)
        total = int(config.num_hidden_layers)
        model = AutoModelForCausalLM.from_pretrained(location, num_hidden_layers=min(layers, total),
                                                     dtype=torch.bfloat16, trust_remote_code=False)
        return model.eval(), total
    except (offline.OfflinePackError, gguf_convert.ConversionError) as err:
        raise ModelLoadError(str(err)) from err
    except (OSError, ValueError, KeyError, ImportError, RuntimeError, AttributeError) as err:
        raise ModelLoadError(f"cannot load '{source}': {first_line(err)}") from err


def bytes_to_convert(source: str, settings: LoadSettings) -> int:
    """The bytes of GGUF that loading ``source`` with ``settings`` would convert first (0: none, or unknown)."""
    try:
        name = _resolve(source, settings)[0][0]
    except ModelLoadError:
        return 0
    if not offline.is_offline_source(name) or offline.offline_name(name) not in offline.OFFLINE_MODELS:
        return 0
    model, storage = offline.get_offline_model(name), _storage(settings)
    folder = offline.cache_home() / "models" / offline.stored_folder_name(model.name, storage)
    return 0 if offline.folder_ready(folder, model.sha256, storage) else int(model.size or 0)


def _capped_snapshot(repo_id: str, max_bytes: int | None) -> Path:
    """The local snapshot of Hub model ``repo_id`` (configs, tokenizer, safetensors), downloaded only when its
    files fit ``max_bytes``; afterwards the Hub cache is trimmed to its budget, this snapshot kept."""
    from fnmatch import fnmatch

    from huggingface_hub import HfApi, snapshot_download

    offline_mode = _hub_offline() or not _hub_reachable()
    try:
        if not offline_mode:
            info = HfApi().model_info(repo_id, files_metadata=True)
            files = [s for s in info.siblings or [] if any(fnmatch(s.rfilename, p) for p in HUB_DOWNLOAD_PATTERNS)]
            if not any(s.rfilename.endswith(".safetensors") for s in files):
                raise ModelLoadError(f"cannot load '{repo_id}': it has no safetensors weights (only those are "
                                     "loaded here)")
            size = sum(s.size or 0 for s in files)
            if max_bytes is not None and size > max_bytes:
                raise ModelLoadError(f"cannot load '{repo_id}': its weights take {size / 1e9:.1f} GB, more than the "
                                     f"{max_bytes / 1e9:.1f} GB this server downloads")
        folder = Path(snapshot_download(repo_id, allow_patterns=list(HUB_DOWNLOAD_PATTERNS),
                                        local_files_only=offline_mode))
    except ModelLoadError:
        raise
    except (OSError, ValueError, KeyError, ImportError, RuntimeError) as err:
        raise _hub_error(repo_id, err, offline_mode) from err
    trim_hub_cache(keep=repo_id)
    return folder


def trim_hub_cache(keep: str | None = None, budget_bytes: int | None = None) -> list[str]:
    """Delete the least recently used model repositories of the Hub cache until it fits ``budget_bytes``
    (default ``SPECDEMO_HUB_CACHE_GB``, 60 GB), never ``keep``; returns the repositories deleted."""
    from huggingface_hub import scan_cache_dir

    if budget_bytes is None:
        budget_bytes = offline.env_bytes("SPECDEMO_HUB_CACHE_GB", DEFAULT_HUB_CACHE_GB)
    try:
        cache = scan_cache_dir()
    except (OSError, ValueError) as err:  # no cache yet, or one that cannot be read
        logger.debug("Hub cache not scanned: %s", first_line(err))
        return []
    total = cache.size_on_disk
    deleted: list[str] = []
    repos = sorted((r for r in cache.repos if r.repo_type == "model" and r.repo_id != keep),
                   key=lambda r: r.last_accessed)
    for repo in repos:
        if total <= budget_bytes:
            break
        cache.delete_revisions(*(rev.commit_hash for rev in repo.revisions)).execute()
        total -= repo.size_on_disk
        deleted.append(repo.repo_id)
        logger.info("Removed %s from the Hub cache (over its %.0f GB budget)", repo.repo_id, budget_bytes / 1e9)
    return deleted


def _hub_offline() -> bool:
    """True when the Hub is switched off by environment (checked now, not at import time)."""
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(var, "").strip().upper() in {"1", "ON", "YES", "TRUE"}:
            return True
    try:
        from huggingface_hub import constants

        return bool(constants.is_offline_mode())
    except (ImportError, AttributeError):
        return False


def _hub_reachable(timeout: float = 3.0) -> bool:
    """A quick TCP probe of the Hub endpoint, to fail fast instead of retrying for half a minute."""
    if any(os.environ.get(var) for var in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True  # a proxy decides; let the HTTP client try
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    parsed = urlparse(endpoint)
    host = parsed.hostname or "huggingface.co"
    port = parsed.port or (80 if parsed.scheme == "http" else 443)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _error_chain(err: BaseException) -> list[BaseException]:
    chain: list[BaseException] = []
    current: BaseException | None = err
    while current is not None and current not in chain:
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


def _hub_error(source: str, err: BaseException, offline_mode: bool) -> ModelLoadError:
    names = {type(e).__name__ for e in _error_chain(err)}
    if {"GatedRepoError"} & names:
        return ModelLoadError(
            f"cannot load '{source}': the model is gated; accept its licence on huggingface.co "
            f"and log in (hf auth login)"
        )
    if {"RepositoryNotFoundError"} & names:
        return ModelLoadError(f"cannot load '{source}': no such model on the Hugging Face Hub (or it is private)")
    unreachable = {
        "LocalEntryNotFoundError",
        "OfflineModeIsEnabled",
        "ConnectError",
        "ConnectionError",
        "ConnectTimeout",
        "gaierror",
        "TimeoutError",
    }
    if offline_mode or unreachable & names:
        return ModelLoadError(
            f"cannot load '{source}': not a local path and the Hugging Face Hub is unreachable (offline); "
            f"use an offline:... model or a local folder"
        )
    return ModelLoadError(f"cannot load '{source}': {first_line(err)}")


# ---------------------------------------------------------------------------------------------
# Loading


def _load_uncached(
    source: str,
    settings: LoadSettings,
    device: torch.device,
    dtype: torch.dtype,
    progress: bool,
    on_progress: ProgressCallback | None,
) -> LoadedModel:
    location, is_local = _resolve_source(source, progress, on_progress, settings)
    common: dict[str, Any] = {"trust_remote_code": False}  # never: a model's own code does not run here
    offline_mode = False
    if not is_local:
        offline_mode = _hub_offline() or not _hub_reachable()
        if offline_mode:
            common["local_files_only"] = True

    key_format = resolve_format(settings.dtype, device)
    # w8a8 quantises its linear layers from bfloat16 weights (half the memory of float32 while it converts)
    model_kwargs: dict[str, Any] = {"dtype": torch.bfloat16 if key_format == formats.W8A8 else dtype, **common}
    if settings.quantization is not None:
        from transformers import BitsAndBytesConfig

        if settings.quantization == "4bit":
            model_kwargs["quantization_config"] = BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_compute_dtype=dtype, bnb_4bit_quant_type="nf4"
            )
        else:
            model_kwargs["quantization_config"] = BitsAndBytesConfig(load_in_8bit=True)
        model_kwargs["device_map"] = {"": device}
    elif device.type == "cuda":
        model_kwargs["device_map"] = {"": device}  # straight onto the GPU, no CPU copy

    if is_local and key_format in formats.INT8_FORMATS and offline.stored_kind(Path(location)) == gguf_convert.INT8_STORAGE:
        return _load_stored_int8(source, location, key_format, device, dtype, settings, on_progress)

    quant_note = f", {settings.quantization}" if settings.quantization else ""
    if key_format == formats.INT8:
        quant_note += ", int8 weights"
    elif key_format == formats.W8A8:
        quant_note += ", int8 weights and activations"
    logger.info("Loading %s (%s, %s%s)", source, device, dtype, quant_note)
    if on_progress is not None:
        on_progress(0.0, f"Loading {source}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(location, **common)
        model = AutoModelForCausalLM.from_pretrained(location, **model_kwargs)
    except ModelLoadError:
        raise
    except (OSError, ValueError, KeyError, ImportError, RuntimeError) as err:
        if is_local:
            raise ModelLoadError(f"cannot load '{source}': {first_line(err)}") from err
        raise _hub_error(source, err, offline_mode) from err

    if "device_map" not in model_kwargs:
        model = model.to(device)
    model.eval()
    if key_format in formats.INT8_FORMATS:
        formats.to_int8_format(model, key_format)
    _fill_special_ids(model, tokenizer)
    if on_progress is not None:
        on_progress(1.0, f"Loaded {source}")
    return LoadedModel(source=source, model=model, tokenizer=tokenizer, device=device, dtype=dtype, settings=settings)


def _load_stored_int8(source: str, location: str, fmt: str, device: torch.device, dtype: torch.dtype,
                      settings: LoadSettings, on_progress: ProgressCallback | None) -> LoadedModel:
    """A converted GGUF's int8 storage, built straight into the int8-weight format ``fmt`` (no float copy)."""
    logger.info("Loading %s (%s, %s, stored int8 weights)", source, device, fmt)
    if on_progress is not None:
        on_progress(0.0, f"Loading {source}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(location, trust_remote_code=False)
        model = int8_store.load_int8_folder(Path(location), fmt)
    except (OSError, ValueError, KeyError, ImportError, RuntimeError) as err:
        raise ModelLoadError(f"cannot load '{source}': {first_line(err)}") from err
    _fill_special_ids(model, tokenizer)
    if on_progress is not None:
        on_progress(1.0, f"Loaded {source}")
    return LoadedModel(source=source, model=model, tokenizer=tokenizer, device=device, dtype=dtype, settings=settings)


def _fill_special_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """Give generation_config an eos and a pad id (first eos), and the tokenizer a pad token."""
    gen = getattr(model, "generation_config", None)
    if gen is None:
        return
    if gen.eos_token_id is None and tokenizer.eos_token_id is not None:
        gen.eos_token_id = tokenizer.eos_token_id
    eos = gen.eos_token_id
    first_eos = eos if isinstance(eos, int) else (list(eos)[0] if eos else None)
    if gen.pad_token_id is None and first_eos is not None:
        gen.pad_token_id = first_eos
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token


#: tokenizer -> {other tokenizer -> same vocabulary?}, weakly keyed (comparing two vocabularies takes 0.2 s)
_SAME_VOCAB: "weakref.WeakKeyDictionary[Any, weakref.WeakKeyDictionary[Any, bool]]" = weakref.WeakKeyDictionary()


def same_tokenizer(a: PreTrainedTokenizerBase, b: PreTrainedTokenizerBase) -> bool:
    """True when both tokenizers map the same token strings to the same ids (worked out once per pair: every
    draft-mode run checks its pair, and the answer is no cost of the run)."""
    if a is b:
        return True
    known = _SAME_VOCAB.setdefault(a, weakref.WeakKeyDictionary())
    if b not in known:
        known[b] = a.get_vocab() == b.get_vocab()
    return known[b]
