"""Rows (JSON objects with an ``index``) kept as gzip JSON-lines shards in a folder, built up run by run.

A long generation (the target's answers to thousands of prompts, the requests it writes itself) runs over many
sessions and machines; what one run wrote must be there for the next. So a set of rows is a folder of sealed
shards, ``NAME-0000.jsonl.gz``, ``NAME-0001.jsonl.gz`` ..., each holding ``rows_per_shard`` rows and never written
again (committed with the checkout), and one open file, ``NAME-open.jsonl``, where each finished row is appended at
once (a run stopped mid-batch loses that batch only). When the open file holds a shard's worth of rows they are
sealed into the next shard: written to a temporary file, then renamed, so a shard is whole or absent.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
from pathlib import Path
from typing import Iterable, Iterator

logger = logging.getLogger(__name__)

#: rows a sealed shard holds (a few hundred answers: about half a megabyte compressed)
ROWS_PER_SHARD = 500


class RowShards:
    """The rows of one set in ``folder`` (``NAME-*.jsonl.gz`` sealed, ``NAME-open.jsonl`` growing)."""

    def __init__(self, folder: Path, name: str, rows_per_shard: int = ROWS_PER_SHARD) -> None:
        if rows_per_shard < 1:
            raise ValueError(f"rows_per_shard must be >= 1, got {rows_per_shard}")
        self.folder = Path(folder)
        self.name = name
        self.rows_per_shard = rows_per_shard

    @property
    def open_path(self) -> Path:
        return self.folder / f"{self.name}-open.jsonl"

    def sealed_paths(self) -> list[Path]:
        return sorted(self.folder.glob(f"{self.name}-[0-9][0-9][0-9][0-9].jsonl.gz"))

    def rows(self) -> dict[int, dict]:
        """Every row written, by index (a later row with the same index replaces an earlier one). A torn last
        line of the open file (a run killed mid-write) is skipped."""
        found: dict[int, dict] = {}
        for path in self.sealed_paths():
            with gzip.open(path, "rt", encoding="utf-8") as handle:
                for row in _parsed(handle, path, tolerate_torn_end=False):
                    found[row["index"]] = row
        if self.open_path.is_file():
            with self.open_path.open(encoding="utf-8") as handle:
                for row in _parsed(handle, self.open_path, tolerate_torn_end=True):
                    found[row["index"]] = row
        return found

    def append(self, rows: Iterable[dict]) -> None:
        """Append finished rows to the open file (flushed to disk), sealing a shard whenever it is full."""
        self.folder.mkdir(parents=True, exist_ok=True)
        self._drop_torn_tail()
        with self.open_path.open("a", encoding="utf-8") as handle:
            for row in rows:
                handle.write(json.dumps(row, ensure_ascii=False) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        self.seal(only_full=True)

    def _drop_torn_tail(self) -> None:
        """Cut a last line a stopped run left half-written, so the next row starts on a line of its own."""
        if not self.open_path.is_file():
            return
        data = self.open_path.read_bytes()
        if data and not data.endswith(b"\n"):
            with self.open_path.open("r+b") as handle:
                handle.truncate(data.rfind(b"\n") + 1)

    def seal(self, only_full: bool = True) -> int:
        """Move the open file's rows into sealed shards: whole shards only, or (``only_full=False``) the rest too,
        as a last, smaller shard. Returns how many shards were written."""
        if not self.open_path.is_file():
            return 0
        with self.open_path.open(encoding="utf-8") as handle:
            pending = list(_parsed(handle, self.open_path, tolerate_torn_end=True))
        written = 0
        while len(pending) >= self.rows_per_shard or (pending and not only_full):
            chunk, pending = pending[: self.rows_per_shard], pending[self.rows_per_shard :]
            self._write_shard(chunk)
            written += 1
        if written:
            _replace_text(self.open_path, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in pending))
            if not pending:
                self.open_path.unlink()
        return written

    def _write_shard(self, rows: list[dict]) -> None:
        number = len(self.sealed_paths())
        path = self.folder / f"{self.name}-{number:04d}.jsonl.gz"
        temporary = path.with_name(path.name + ".tmp")
        # mtime=0: the same rows give the same bytes, so a shard sealed again on another machine is no change
        with open(temporary, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as handle:
            for row in rows:
                handle.write((json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8"))
        os.replace(temporary, path)
        logger.info("sealed %s (%d rows)", path, len(rows))


def _parsed(lines: Iterable[str], path: Path, tolerate_torn_end: bool) -> Iterator[dict]:
    pending_error: str | None = None
    for number, line in enumerate(lines, 1):
        if pending_error is not None:
            raise ValueError(pending_error)
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            pending_error = f"{path}: line {number} is not JSON"
            continue
        if not isinstance(row, dict) or not isinstance(row.get("index"), int):
            raise ValueError(f"{path}: line {number} is not a row with an integer index")
        yield row
    if pending_error is not None and not tolerate_torn_end:
        raise ValueError(pending_error)
    if pending_error is not None:
        logger.warning("%s: its last line was cut off (a run stopped mid-write); that row is written again", path)


def _replace_text(path: Path, text: str) -> None:
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(text, encoding="utf-8")
    os.replace(temporary, path)
