"""The one results schema: what every front end reports about one run of one mode on one prompt.

A :class:`RunResult` (JSON: :meth:`RunResult.as_dict`) is each per-prompt entry of the bench (which adds its
aggregates around it), each side of the ``/race`` API's result (which adds its texts and tokens), each side of the
race log's ``figures`` and of the server log's line. Its keys, in order:

- ``new_tokens``; ``seconds``: the run's time (a race side's own compute time; the bench's wall clock around the
  whole run); ``prefill_seconds``: the target's prompt pass (None where it is not timed: transformers' generate);
- ``target_passes``, ``drafted``, ``accepted`` (None without the engine's counters);
- ``acceptance_rate``: accepted / drafted (None when nothing was drafted); ``mean_accepted_length``: tokens per
  verification pass, the target's own token included (plain decoding: 1.0);
- ``identical``: the output equals plain decoding's (None: not compared); ``divergence``: None, or
  ``{"position", "logit_margin"}``, the first token where the outputs differ and the target's top-1 minus top-2
  logit there in plain's context (greedy runs only, else None);
- ``speedup``: tokens/s over plain decoding's on the same prompt (plain's own: 1.0).

No torch here: the race log and the recordings read these. :func:`read_plain_runs` reads a bench results file's
plain runs back (the replay and the EAGLE head's scorer start from them).
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

from ..core.errors import InputError, first_line
from ..core.events import Counters
from ..core.metrics import run_metrics

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Divergence:
    """Where two outputs part: the first differing position, and the target's logit margin there (or None)."""

    position: int
    logit_margin: float | None = None


@dataclass(frozen=True)
class RunResult:
    """One run of one mode on one prompt, as every front end reports it (see the module's docstring)."""

    new_tokens: int
    seconds: float
    prefill_seconds: float | None
    target_passes: int | None
    drafted: int | None
    accepted: int | None
    acceptance_rate: float | None
    mean_accepted_length: float | None
    identical: bool | None
    divergence: Divergence | None
    speedup: float | None

    @classmethod
    def of(
        cls,
        counters: Counters | None,
        new_tokens: int,
        seconds: float,
        identical: bool | None = None,
        divergence: Divergence | None = None,
        speedup: float | None = None,
    ) -> RunResult:
        """The result of a run with the engine's ``counters`` (None: a run without them, e.g. generate())."""
        metrics = run_metrics(counters) if counters is not None else None
        return cls(
            new_tokens=new_tokens,
            seconds=seconds,
            prefill_seconds=counters.prefill_seconds if counters is not None else None,
            target_passes=counters.target_passes if counters is not None else None,
            drafted=counters.drafted if counters is not None else None,
            accepted=counters.accepted if counters is not None else None,
            acceptance_rate=metrics.acceptance_rate if metrics is not None else None,
            mean_accepted_length=metrics.mean_accepted_length if metrics is not None else None,
            identical=identical,
            divergence=divergence,
            speedup=speedup,
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def divergence(reference: Sequence[int], other: Sequence[int]) -> int | None:
    """First position where two outputs differ (a shorter output differs where it ends), None when identical."""
    for position, (a, b) in enumerate(zip(reference, other)):
        if a != b:
            return position
    if len(reference) != len(other):
        return min(len(reference), len(other))
    return None


def rate_ratio(tokens: int, seconds: float, plain_tokens: int, plain_seconds: float) -> float | None:
    """Tokens per second over plain decoding's (None when either side wrote nothing or took no time)."""
    if tokens <= 0 or seconds <= 0 or plain_tokens <= 0 or plain_seconds <= 0:
        return None
    return (tokens / seconds) / (plain_tokens / plain_seconds)


def race_runs(
    plain: Counters, spec: Counters, done: bool, position: int | None, margin: float | None
) -> dict[str, RunResult]:
    """Both sides of a race as runs: plain is the reference (identical to itself, speedup 1.0 once it wrote
    something), the speculative side is compared with it once the race is ``done``."""
    plain_speedup = 1.0 if plain.new_tokens and plain.seconds > 0 else None
    spec_speedup = rate_ratio(spec.new_tokens, spec.seconds, plain.new_tokens, plain.seconds)
    parted = Divergence(position, margin) if done and position is not None else None
    return {
        "plain": RunResult.of(plain, plain.new_tokens, plain.seconds, True if done else None, None, plain_speedup),
        "spec": RunResult.of(spec, spec.new_tokens, spec.seconds, position is None if done else None, parted,
                             spec_speedup),
    }


#: the most bytes of a bench results file read back (the 44-prompt, four-mode run of docs/measurements.md: 0.5 MiB)
MAX_RESULTS_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class PlainRun:
    """One prompt's plain run in a bench results file, as the replay and the head scorer read it back."""

    id: str
    category: str
    prompt_ids: list[int] | None  # None in files written before the bench recorded them
    prompt_tokens: int | None
    new_token_ids: list[int]
    seconds: float | None
    prefill_seconds: float | None


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(_count(t) for t in value)


def _seconds(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0 else None


def read_plain_runs(path: Path) -> tuple[dict[str, Any], list[PlainRun]]:
    """A bench results file's ``config`` and its plain runs (``python -m specdemo.bench --json``); InputError in one
    line for a file that cannot be read, is not a results file, holds a plain run whose token ids are not token ids,
    or holds no plain run."""
    path = Path(path)
    try:
        size = path.stat().st_size
        data = None if size > MAX_RESULTS_BYTES else json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:  # JSON and UTF-8 errors are ValueErrors
        raise InputError(f"cannot read {path}: {first_line(error)}") from None
    if size > MAX_RESULTS_BYTES:
        raise InputError(f"{path} is over {MAX_RESULTS_BYTES // 2**20} MiB: not a bench results file")
    if not isinstance(data, dict) or not isinstance(data.get("results"), list) or not isinstance(
            data.get("config"), dict):
        raise InputError(f"{path} is not a bench results file (python -m specdemo.bench --json)")
    runs = []
    for row in data["results"]:
        if not isinstance(row, dict) or row.get("mode") != "plain":
            continue
        run_id, prompt_ids, new_token_ids = str(row.get("id", "")), row.get("prompt_ids"), row.get("new_token_ids")
        if not _token_ids(new_token_ids) or not (prompt_ids is None or _token_ids(prompt_ids)):
            raise InputError(f"{path}: plain run {run_id!r} holds no token ids where a bench run writes them")
        prompt_tokens = row.get("prompt_tokens")
        runs.append(PlainRun(
            run_id, str(row.get("category") or "none"), prompt_ids, prompt_tokens if _count(prompt_tokens) else None,
            new_token_ids, _seconds(row.get("seconds")), _seconds(row.get("prefill_seconds")),
        ))
    if not runs:
        raise InputError(f"{path} holds no plain run: run the bench with plain among --modes")
    return data["config"], runs
