"""A bench run kept prompt by prompt, so that a stopped run resumes where it stopped.

With ``--json OUT`` the bench keeps ``OUT.partial`` beside it: after each prompt, every mode's results entry and
counters on it and the answer its suffix memory took, written whole or not at all. The same command run again on
the same machine reads it back, skips the prompts it holds, refills the memory with their answers in order, warms
up and compiles as any run does, and times the rest; the report then lists every process that timed a part
(``processes``). Each prompt's modes are timed side by side within one process, so a ratio of a resumed run still
sets runs against each other that ran minutes apart, never sessions apart.

A checkpoint written by another command (other settings, prompts or target) or on another machine (another CPU, its
instruction sets, thread count, torch or kernels, or another GPU) is not resumed: the run starts over and says why
in one line. So is one that cannot be read. The finished JSON replaces it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .core.economics import Hardware
from .core.events import Counters
from .core.files import write_json_atomic

logger = logging.getLogger(__name__)

#: what the checkpoint's name adds to the results JSON's
CHECKPOINT_SUFFIX = ".partial"
#: the checkpoint's layout; another is not resumed
CHECKPOINT_VERSION = 1


def checkpoint_path(json_path: Path) -> Path:
    """Where the bench keeps the run that will write ``json_path``."""
    return json_path.with_name(json_path.name + CHECKPOINT_SUFFIX)


def run_key(config: dict[str, Any], prompts: list[tuple[str, str, str]], hardware: Hardware) -> dict[str, Any]:
    """What a checkpoint must match to be resumed: the bench's settings, its prompts (id, category, text; hashed)
    and the machine."""
    digest = hashlib.sha256(json.dumps(prompts, ensure_ascii=False).encode()).hexdigest()
    key = {"version": CHECKPOINT_VERSION, "config": config, "prompts": digest, "machine": asdict(hardware)}
    return json.loads(json.dumps(key))  # as it reads back (tuples as lists), so that equal keys compare equal


@dataclass
class PromptRecord:
    """One prompt's finished runs: its results entries, each mode's counters, the answer the memory took."""

    rows: list[dict[str, Any]]
    counters: dict[str, dict[str, Any]]  # mode -> the fields of its Counters
    remembered: list[int] | None = None

    def counters_by_mode(self) -> dict[str, Counters]:
        return {mode: Counters(**fields) for mode, fields in self.counters.items()}


@dataclass
class BenchCheckpoint:
    """The prompts a run has finished, in order, and the processes that timed them; saved after each prompt."""

    path: Path
    key: dict[str, Any]
    done: list[PromptRecord] = field(default_factory=list)
    #: one entry per process that timed prompts of this run: when it started, the first prompt it timed, its
    #: compilation
    processes: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def open(cls, json_path: Path, key: dict[str, Any]) -> "BenchCheckpoint":
        """The run kept for ``json_path`` when it matches ``key`` (its finished prompts printed), else a fresh one
        (why printed when a checkpoint was there)."""
        checkpoint = cls(checkpoint_path(json_path), key)
        if not checkpoint.path.exists():
            return checkpoint
        why = checkpoint._load()
        if why is None:
            print(f"resuming: {len(checkpoint.done)} prompts already timed, kept in {checkpoint.path}", flush=True)
        else:
            print(f"{checkpoint.path} not resumed ({why}): the run starts over", flush=True)
        return checkpoint

    def _load(self) -> str | None:
        """Read the kept run into this one; why not, in a few words, when it cannot be resumed."""
        try:
            kept = json.loads(self.path.read_text())
            if kept.get("key") != self.key:
                return _mismatch(kept.get("key"), self.key)
            done = [PromptRecord(**record) for record in kept["done"]]
            processes = list(kept["processes"])
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as error:
            return f"unreadable: {type(error).__name__}"
        self.done, self.processes = done, processes
        return None

    def begin(self, compile_record: dict[str, Any]) -> None:
        """Note this process: it times from the first prompt not yet done, with the graphs it compiled."""
        started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        self.processes.append({"started": started, "first_prompt": len(self.done), "compile": compile_record})

    def save(self, record: PromptRecord) -> None:
        """Add a finished prompt and write the whole run (whole or not at all)."""
        self.done.append(record)
        data = {"key": self.key, "done": [asdict(r) for r in self.done], "processes": self.processes}
        write_json_atomic(self.path, data, indent=None)

    def discard(self) -> None:
        """The run is written: its checkpoint goes."""
        self.path.unlink(missing_ok=True)


def _mismatch(kept: Any, key: dict[str, Any]) -> str:
    """What differs between a kept run's key and this run's, in a few words."""
    if not isinstance(kept, dict) or kept.get("version") != key["version"]:
        return "another layout"
    if kept.get("machine") != key["machine"]:
        return "measured on another machine"
    if kept.get("prompts") != key["prompts"]:
        return "other prompts"
    config = kept.get("config") if isinstance(kept.get("config"), dict) else {}
    changed = sorted(name for name in set(config) | set(key["config"]) if config.get(name) != key["config"].get(name))
    return f"other settings: {', '.join(changed)}" if changed else "another run"
