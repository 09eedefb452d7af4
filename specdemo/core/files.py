"""Files written whole or not at all, and sha256 digests: the one copy of each for the whole package."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator, Sequence

#: bytes read at a time when hashing
BLOCK = 8 * 1024 * 1024


def _current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_UMASK = _current_umask()


def relax_mode(path: Path, directory: bool = False) -> None:
    """Give a mkstemp/mkdtemp result the permissions a normally created file or folder would have."""
    with contextlib.suppress(OSError):
        os.chmod(path, (0o777 if directory else 0o666) & ~_UMASK)


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A fresh temporary path beside ``path`` (same suffix) that replaces ``path`` when the block succeeds; on any
    error nothing is left behind and ``path`` keeps what it held."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=f".partial{path.suffix}", dir=path.parent)
    os.close(fd)
    partial = Path(name)
    try:
        yield partial
        relax_mode(partial)
        os.replace(partial, path)
    finally:
        with contextlib.suppress(OSError):
            partial.unlink()


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all."""
    with atomic_path(path) as partial:
        partial.write_text(text, encoding="utf-8")


def write_json_atomic(path: str | Path, data: Any, indent: int | None = 2, sort_keys: bool = False) -> None:
    """Write ``data`` as JSON to ``path`` whole or not at all."""
    write_text_atomic(path, json.dumps(data, indent=indent, sort_keys=sort_keys))


def read_json_object(path: str | Path) -> dict[str, Any] | None:
    """The JSON object in ``path``; None when the file is missing, unreadable, not JSON or not an object."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def hash_files(
    paths: Sequence[Path], on_bytes: Callable[[int], None] | None = None, out: BinaryIO | None = None
) -> tuple[str, int]:
    """sha256 and byte count of the concatenation of ``paths``; each block read is reported to ``on_bytes`` and
    copied into ``out`` when given."""
    digest = hashlib.sha256()
    size = 0
    for path in paths:
        with open(path, "rb") as handle:
            while block := handle.read(BLOCK):
                digest.update(block)
                if out is not None:
                    out.write(block)
                size += len(block)
                if on_bytes is not None:
                    on_bytes(len(block))
    return digest.hexdigest(), size


def file_sha256(path: str | Path) -> str:
    """The sha256 of one file, as hex."""
    return hash_files([Path(path)])[0]
