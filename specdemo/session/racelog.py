"""A race as data: its settings, each side's rounds on its own compute clock, and the outcome.

The log is what every recording (:mod:`specdemo.render.html_replay`, :mod:`specdemo.render.video`) is drawn from, and what the
``/race`` API returns under ``"log"``. It is stored as compact JSON: each round carries only what changed (the
tokens it kept, the drafts it rejected, its draft and verify seconds); the running counters, the metrics and the
figures are rebuilt from the rounds exactly as the engine added them up (:meth:`RaceLog.events`). Layout::

    {"format": "specdemo-race-log", "version": 1,
     "settings": {...RaceSettings...},
     "token_fields": ["id", "text", "kind", "draft_prob", "target_prob", "source"],
     "sides": {"plain": [ROUND, ...], "spec": [ROUND, ...]},
     "outcome": {"done": true, "divergence": null | {"position": 17, "logit_margin": 0.12},
                 "stop_reason": "time budget"},   # only when the race stopped early
     "figures": {"plain": RUN, "spec": RUN}}   # derived, for readers; ignored on load

    ROUND = {"round": 3, "t": 1.234, "draft_s": 0.02, "verify_s": 0.1, "drafted": 4, "accepted": 2,
             "depth": 3, "tokens": [[id, text, kind, draft_prob, target_prob, source], ...], "rejected": [...],
             "finish": "length"}

``t`` is the side's own compute clock at the end of the round; ``depth`` (trees only) is the tree's longest path,
which the per-position counts go by; a token's ``source`` (which part of a drafter with several proposed it, such
as EAGLE's head or its lookup branch) is left out where there is none, and logs written before it existed (their
``token_fields`` without it) are read as they are; zero counts, empty lists and a missing finish are left out.
``RUN`` is the one results schema (:class:`~specdemo.session.results.RunResult`). No torch here: a saved log is
re-rendered without loading it.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Iterator

from ..core.events import (
    ACCEPTED,
    BONUS,
    CORRECTED,
    DRAFTED_BY_BOTH,
    DRAFTED_BY_HEAD,
    DRAFTED_BY_LOOKUP,
    DRAFTED_FROM_OUTPUT,
    DRAFTED_FROM_PROMPT,
    EARLIER_ANSWER,
    PLAIN,
    REJECTED,
    Counters,
    RoundEvent,
    TokenEvent,
    answer_number,
)
from ..core.settings import MAX_NEW_TOKENS, MAX_NUM_DRAFT_TOKENS
from .results import race_runs

logger = logging.getLogger(__name__)

FORMAT = "specdemo-race-log"
VERSION = 1
TOKEN_FIELDS = ("id", "text", "kind", "draft_prob", "target_prob", "source")
#: the token fields of logs written before tokens had a source
OLDER_TOKEN_FIELDS = TOKEN_FIELDS[:5]
SIDES = ("plain", "spec")


#: what a log may hold, from what a race can produce: tokens per side (a run writes at most MAX_NEW_TOKENS, and its
#: last round at most a draft more), tokens and drafts per round, seconds on a side's clock (a day), the longest
#: token piece and setting text, the prompt, and the file itself
MAX_SIDE_TOKENS = MAX_NEW_TOKENS + MAX_NUM_DRAFT_TOKENS + 1
MAX_ROUND_TOKENS = MAX_NUM_DRAFT_TOKENS + 1
MAX_SECONDS = 24 * 3600.0
MAX_PIECE_CHARS = 1024
MAX_TEXT_CHARS = 1000
MAX_PROMPT_CHARS = 2_000_000
MAX_LOG_BYTES = 64 * 1024 * 1024
#: what the modes record about their parts (``settings.methods``), as JSON
MAX_METHODS_CHARS = 4096
#: the kinds a logged token may have
KINDS = (PLAIN, ACCEPTED, CORRECTED, BONUS, REJECTED)
#: the parts of a drafter a logged token may name as its source (besides an earlier answer, "answer N")
SOURCES = (DRAFTED_BY_HEAD, DRAFTED_BY_LOOKUP, DRAFTED_BY_BOTH, DRAFTED_FROM_PROMPT, DRAFTED_FROM_OUTPUT,
           EARLIER_ANSWER)


class RaceLogError(ValueError):
    """A file that is not a race log this version can read, with a one-line reason."""


def _whole(value: Any, name: str, low: int, high: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ValueError(f"{name} must be a whole number from {low} to {high}, not {_shown(value)}")
    return value


def _real(value: Any, name: str, low: float, high: float) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or not (
            low <= value <= high):
        raise ValueError(f"{name} must be a number from {low:g} to {high:g}, not {_shown(value)}")
    return float(value)


def _text(value: Any, name: str, longest: int = MAX_TEXT_CHARS) -> str:
    if not isinstance(value, str) or len(value) > longest:
        raise ValueError(f"{name} must be text of at most {longest} characters, not {_shown(value)}")
    return value


def _maybe(value: Any, read, *args) -> Any:
    return None if value is None else read(value, *args)


def _list(value: Any, name: str, longest: int) -> list:
    if not isinstance(value, list) or len(value) > longest:
        raise ValueError(f"{name} must be a list of at most {longest} items, not {_shown(value)}")
    return value


def _object(value: Any, name: str) -> dict:
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be an object, not {_shown(value)}")
    return value


def _shown(value: Any) -> str:
    """A value as an error message quotes it: its type for containers, a short repr otherwise."""
    if isinstance(value, (list, dict)):
        return f"a {'list' if isinstance(value, list) else 'object'} of {len(value)}"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


@dataclass(frozen=True)
class RaceSettings:
    """What was raced, how, and on what."""

    target: str
    draft: str | None
    mode: str
    num_draft_tokens_schedule: str  # "fixed", "adaptive" or "heuristic"
    num_draft_tokens: int | None  # fixed: every round's draft; else the first round's (None: the schedule's own)
    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    dtype: str
    device: str
    hardware: str
    prompt: str
    prompt_tokens: int
    chat: bool = True
    pair: str | None = None  # the preset raced (None: custom models)
    method_label: str = ""  # what drafts, in words (see specdemo.methods)
    max_num_draft_tokens: int | None = None  # the adaptive and heuristic schedules' cap (None: not recorded)
    #: what the mode records about its own parts, by mode, as the bench's ``methods`` (for example the EAGLE
    #: head's format); None: the mode records nothing, or the log predates the field
    methods: dict[str, dict[str, Any]] | None = None
    #: how the target's passes ran (``--compile``: the choice, the mode, why, the seconds compiling took); None:
    #: eager, or the log predates the field
    compile: dict[str, Any] | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass
class LoggedRound:
    """One target pass of one side: what it kept and rejected, what it cost, and the side's clock after it."""

    index: int
    tokens: list[TokenEvent]
    rejected: list[TokenEvent] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0  # round 0: the prompt pass
    clock: float = 0.0  # the side's own compute seconds at the end of this round
    finish_reason: str | None = None
    depth: int | None = None  # a tree's longest path, which the per-position counts go by (None: a chain)

    @classmethod
    def from_event(cls, event: RoundEvent) -> LoggedRound:
        return cls(
            index=event.round,
            tokens=list(event.tokens),
            rejected=list(event.rejected),
            drafted=event.drafted,
            accepted=event.accepted,
            draft_seconds=event.draft_seconds,
            verify_seconds=event.verify_seconds,
            clock=event.counters.seconds,
            finish_reason=event.finish_reason if event.finished else None,
            depth=event.depth,
        )

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"round": self.index, "t": self.clock}
        if self.draft_seconds:
            data["draft_s"] = self.draft_seconds
        data["verify_s"] = self.verify_seconds
        if self.drafted:
            data["drafted"] = self.drafted
        if self.accepted:
            data["accepted"] = self.accepted
        if self.depth is not None:
            data["depth"] = self.depth
        data["tokens"] = [_token_row(t) for t in self.tokens]
        if self.rejected:
            data["rejected"] = [_token_row(t) for t in self.rejected]
        if self.finish_reason:
            data["finish"] = self.finish_reason
        return data

    @classmethod
    def from_json(cls, data: Any, name: str = "a round") -> LoggedRound:
        """One round, every field checked for type and range (ValueError naming the field)."""
        data = _object(data, name)
        index = _whole(data["round"], f"{name}'s round", 0, MAX_SIDE_TOKENS)
        drafted = _whole(data.get("drafted", 0), f"{name}'s drafted", 0, MAX_NUM_DRAFT_TOKENS)
        tokens = _list(data["tokens"], f"{name}'s tokens", MAX_ROUND_TOKENS)
        rejected = _list(data.get("rejected", []), f"{name}'s rejected", MAX_NUM_DRAFT_TOKENS)
        return cls(
            index=index,
            tokens=[_token_event(row, index, f"{name}'s token") for row in tokens],
            rejected=[_token_event(row, index, f"{name}'s rejected token") for row in rejected],
            drafted=drafted,
            accepted=_whole(data.get("accepted", 0), f"{name}'s accepted", 0, drafted),
            draft_seconds=_real(data.get("draft_s", 0.0), f"{name}'s draft_s", 0.0, MAX_SECONDS),
            verify_seconds=_real(data["verify_s"], f"{name}'s verify_s", 0.0, MAX_SECONDS),
            clock=_real(data["t"], f"{name}'s t", 0.0, MAX_SECONDS),
            finish_reason=_maybe(data.get("finish"), _text, f"{name}'s finish", 64),
            depth=_maybe(data.get("depth"), _whole, f"{name}'s depth", 0, drafted),
        )


def _token_row(token: TokenEvent) -> list[Any]:
    row = [token.id, token.text, token.kind, token.draft_prob, token.target_prob]
    return row + [token.source] if token.source is not None else row


def _token_event(row: Any, index: int, name: str) -> TokenEvent:
    values = _list(row, name, len(TOKEN_FIELDS))
    if len(values) < len(OLDER_TOKEN_FIELDS):
        raise ValueError(f"{name} must hold {', '.join(OLDER_TOKEN_FIELDS)} and optionally source, not "
                         f"{_shown(row)}")
    token_id, text, kind, draft_prob, target_prob = values[:5]
    if kind not in KINDS:
        raise ValueError(f"{name}'s kind must be one of {', '.join(KINDS)}, not {_shown(kind)}")
    return TokenEvent(
        _whole(token_id, f"{name}'s id", 0, 2**31 - 1),
        _text(text, f"{name}'s text", MAX_PIECE_CHARS),
        kind,
        index,
        _maybe(draft_prob, _real, f"{name}'s draft_prob", 0.0, 1.0 + 1e-3),
        _maybe(target_prob, _real, f"{name}'s target_prob", 0.0, 1.0 + 1e-3),
        _maybe(values[5] if len(values) > 5 else None, _source, f"{name}'s source"),
    )


def _source(value: Any, name: str) -> str:
    if value not in SOURCES and (not isinstance(value, str) or answer_number(value) is None):
        raise ValueError(f"{name} must be one of {', '.join(SOURCES)} or \"answer N\", not {_shown(value)}")
    return value


def _methods(value: Any, name: str) -> dict[str, dict[str, Any]]:
    """What modes record about their parts: an object of objects, at most :data:`MAX_METHODS_CHARS` as JSON."""
    methods = _object(value, name)
    for mode, facts in methods.items():
        _object(facts, f"{name}.{_shown(mode)}")
    if len(json.dumps(methods)) > MAX_METHODS_CHARS:
        raise ValueError(f"{name} is over {MAX_METHODS_CHARS} characters as JSON")
    return {mode: dict(facts) for mode, facts in methods.items()}


def _compile_record(value: Any, name: str) -> dict[str, Any]:
    """How the target's passes ran: an object, at most :data:`MAX_METHODS_CHARS` as JSON."""
    record = _object(value, name)
    if len(json.dumps(record)) > MAX_METHODS_CHARS:
        raise ValueError(f"{name} is over {MAX_METHODS_CHARS} characters as JSON")
    return dict(record)


def _draft_length(raw: dict[str, Any]) -> dict[str, Any]:
    """Settings written before the draft length's schedule had its own field, in today's: their
    ``num_draft_tokens`` (once ``draft_tokens``) was "adaptive" or "heuristic" (that schedule from its own start) or
    a whole number k (fixed)."""
    if "draft_tokens" in raw:  # logs written before the setting had its one name
        raw.setdefault("num_draft_tokens", raw.pop("draft_tokens"))
    if "num_draft_tokens_schedule" not in raw and "num_draft_tokens" in raw:
        value = raw["num_draft_tokens"]
        if isinstance(value, str):
            raw["num_draft_tokens_schedule"], raw["num_draft_tokens"] = value, None
        else:
            raw["num_draft_tokens_schedule"] = "fixed"
    return raw


def _settings(raw: Any) -> RaceSettings:
    """The race's settings, each checked for type and range; fields this version does not know are ignored."""
    raw = _draft_length(dict(_object(raw, "settings")))

    def flag(value: Any, name: str) -> bool:
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be true or false, not {_shown(value)}")
        return value

    checks: dict[str, Callable[[Any, str], Any]] = {
        "target": _text, "mode": _text, "dtype": _text, "device": _text, "hardware": _text, "method_label": _text,
        "draft": lambda v, n: _maybe(v, _text, n), "pair": lambda v, n: _maybe(v, _text, n),
        "prompt": lambda v, n: _text(v, n, MAX_PROMPT_CHARS),
        "prompt_tokens": lambda v, n: _whole(v, n, 0, MAX_PROMPT_CHARS),
        "max_new_tokens": lambda v, n: _whole(v, n, 1, MAX_NEW_TOKENS),
        "num_draft_tokens_schedule": lambda v, n: _text(v, n, 32),
        "num_draft_tokens": lambda v, n: _maybe(v, _whole, n, 1, MAX_NUM_DRAFT_TOKENS),
        "max_num_draft_tokens": lambda v, n: _maybe(v, _whole, n, 1, MAX_NUM_DRAFT_TOKENS),
        "temperature": lambda v, n: _real(v, n, 0.0, 100.0),
        "top_p": lambda v, n: _real(v, n, 0.0, 1.0),
        "seed": lambda v, n: _maybe(v, _whole, n, -(2**63), 2**64 - 1),
        "chat": flag,
        "methods": lambda v, n: _maybe(v, _methods, n),
        "compile": lambda v, n: _maybe(v, _compile_record, n),
    }
    values = {f.name: checks[f.name](raw[f.name], f"settings.{f.name}") for f in fields(RaceSettings) if f.name in raw}
    if values.get("num_draft_tokens_schedule") == "fixed" and values.get("num_draft_tokens") is None:
        raise ValueError("settings.num_draft_tokens must be a whole number with the fixed schedule, not null")
    try:
        return RaceSettings(**values)
    except TypeError as error:  # a required field missing
        missing = str(error).split(":")[-1].strip()
        raise ValueError(f"settings lack {missing}") from None


def _side(rows: Any, side: str) -> list[LoggedRound]:
    """One side's rounds: each checked, numbered 0, 1, 2 ... on a clock that never runs back, with at most
    :data:`MAX_SIDE_TOKENS` tokens in all."""
    rounds = [LoggedRound.from_json(row, f"{side} round {n}")
              for n, row in enumerate(_list(rows, f"the {side} side", MAX_SIDE_TOKENS + 1))]
    tokens = 0
    for n, logged in enumerate(rounds):
        if logged.index != n:
            raise ValueError(f"{side} round {n} is numbered {logged.index}")
        if n and logged.clock < rounds[n - 1].clock - 1e-6:
            raise ValueError(f"{side} round {n}'s clock runs back ({logged.clock:g} s after {rounds[n - 1].clock:g} s)")
        tokens += len(logged.tokens)
        if tokens > MAX_SIDE_TOKENS:
            raise ValueError(f"the {side} side holds more than {MAX_SIDE_TOKENS} tokens")
    return rounds


@dataclass
class RaceLog:
    """One race, both sides, round by round."""

    settings: RaceSettings
    plain: list[LoggedRound] = field(default_factory=list)
    spec: list[LoggedRound] = field(default_factory=list)
    done: bool = False  # both sides finished and were compared
    divergence: int | None = None  # first position where the outputs differ (None: identical, or not done)
    margin: float | None = None  # the target's top-1 minus top-2 logit there
    stop_reason: str | None = None  # why the race ended before both sides finished (e.g. "time budget")

    def rounds(self, side: str) -> list[LoggedRound]:
        if side not in SIDES:
            raise ValueError(f"unknown side {side!r}; sides are {', '.join(SIDES)}")
        return self.plain if side == "plain" else self.spec

    def events(self, side: str) -> Iterator[RoundEvent]:
        """The side's rounds as the engine yielded them, running counters rebuilt in the engine's order."""
        counters = Counters()
        ids: list[int] = []
        pieces: list[str] = []
        for logged in self.rounds(side):
            ids.extend(t.id for t in logged.tokens)
            pieces.extend(t.text for t in logged.tokens)
            if logged.index == 0:
                counters.observe_prefill(logged.verify_seconds, len(ids))
            else:
                sources = [t.source for t in logged.tokens if t.kind == ACCEPTED and t.source is not None]
                counters.observe(logged.drafted, logged.accepted, new_tokens=len(ids), depth=logged.depth,
                                 sources=sources, draft_seconds=logged.draft_seconds,
                                 verify_seconds=logged.verify_seconds)
            finished = logged.finish_reason is not None
            yield RoundEvent(
                side,
                logged.index,
                list(logged.tokens),
                list(logged.rejected),
                logged.drafted,
                logged.accepted,
                logged.draft_seconds,
                logged.verify_seconds,
                counters.snapshot(),
                finished=finished,
                finish_reason=logged.finish_reason,
                new_token_ids=list(ids) if finished else [],
                text="".join(pieces) if finished else "",
                depth=logged.depth,
            )

    def timeline(self) -> list[RoundEvent]:
        """Both sides' rounds merged in order of their own clocks (plain first on a tie): what a replay shows as
        its clock runs."""
        events = [
            (event.counters.seconds, order, event) for order, side in enumerate(SIDES) for event in self.events(side)
        ]
        return [event for _, _, event in sorted(events, key=lambda item: item[:2])]

    def counters(self, side: str) -> Counters:
        """The side's counters at the end of the race."""
        last = Counters()
        for event in self.events(side):
            last = event.counters
        return last

    @property
    def seconds(self) -> float:
        """How long the race lasts on the fair clock: the slower side's own compute time."""
        return max((rounds[-1].clock for rounds in (self.plain, self.spec) if rounds), default=0.0)

    @property
    def identical(self) -> bool | None:
        return self.divergence is None if self.done else None

    def figures(self) -> dict[str, Any]:
        """Both sides in the one results schema (:class:`~specdemo.session.results.RunResult`): tokens, seconds,
        acceptance, mean accepted length, identical or not and where they part, speedup."""
        runs = race_runs(self.counters("plain"), self.counters("spec"), self.done, self.divergence, self.margin)
        return {side: run.as_dict() for side, run in runs.items()}

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "settings": asdict(self.settings),
            "token_fields": list(TOKEN_FIELDS),
            "sides": {side: [r.to_json() for r in self.rounds(side)] for side in SIDES},
            "outcome": {
                "done": self.done,
                "divergence": None
                if self.divergence is None
                else {"position": self.divergence, "logit_margin": self.margin},
                **({"stop_reason": self.stop_reason} if self.stop_reason else {}),
            },
            "figures": self.figures(),
        }

    @classmethod
    def from_json(cls, data: Any, source: str = "the data") -> RaceLog:
        """A log from its JSON, or from a ``/race`` response that holds one under ``"log"``."""
        if isinstance(data, dict) and isinstance(data.get("log"), dict) and "format" not in data:
            data = data["log"]
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise RaceLogError(
                f"{source} is not a specdemo race log (no \"format\": \"{FORMAT}\"): record one with "
                "python -m specdemo.record --json, or pass a /race response"
            )
        version = data.get("version")
        if version != VERSION:
            raise RaceLogError(
                f"{source} is a race log of version {version!r}; this specdemo reads version {VERSION} only: "
                "record the race again"
            )
        try:
            settings = _settings(data["settings"])
            if data["token_fields"] not in (list(TOKEN_FIELDS), list(OLDER_TOKEN_FIELDS)):
                raise ValueError(f"token fields {_shown(data['token_fields'])} are not {list(TOKEN_FIELDS)}")
            sides = _object(data["sides"], "sides")
            rounds = {side: _side(sides[side], side) for side in SIDES}
            outcome = _object(data["outcome"], "outcome")
            done = outcome["done"]
            if not isinstance(done, bool):
                raise ValueError(f"outcome.done must be true or false, not {_shown(done)}")
            divergence = outcome.get("divergence")
            position = margin = None
            if divergence is not None:
                divergence = _object(divergence, "outcome.divergence")
                position = _whole(divergence["position"], "outcome.divergence.position", 0, MAX_SIDE_TOKENS)
                margin = _maybe(divergence.get("logit_margin"), _real, "outcome.divergence.logit_margin", 0.0, 1e6)
            return cls(
                settings,
                rounds["plain"],
                rounds["spec"],
                done=done,
                divergence=position,
                margin=margin,
                stop_reason=_maybe(outcome.get("stop_reason"), _text, "outcome.stop_reason"),
            )
        except (KeyError, TypeError, ValueError) as error:
            detail = f"missing {error}" if isinstance(error, KeyError) else str(error).splitlines()[0]
            raise RaceLogError(f"{source} is a damaged race log ({detail})") from None


def dumps(log: RaceLog) -> str:
    """The log as compact JSON text."""
    return json.dumps(log.to_json(), ensure_ascii=False, separators=(",", ":"))


def dump(log: RaceLog, path: str | Path) -> None:
    Path(path).write_text(dumps(log), encoding="utf-8")


def load(path: str | Path) -> RaceLog:
    """A log from a file written by :func:`dump`, the app's download, or a saved ``/race`` response."""
    path = Path(path)
    try:
        if path.stat().st_size > MAX_LOG_BYTES:
            raise RaceLogError(f"{path} takes {path.stat().st_size / 2**20:.0f} MiB: more than any race log "
                               f"({MAX_LOG_BYTES // 2**20} MiB at most)")
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise RaceLogError(f"cannot read {path}: {getattr(error, 'strerror', None) or error}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise RaceLogError(f"{path} is not JSON ({error.msg} at line {error.lineno})") from None
    return RaceLog.from_json(data, source=str(path))
