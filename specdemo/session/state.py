"""A race as it runs: each side's tokens, counters and clock, the outcome, and the race as JSON.

:class:`RaceState` is built round by round from :class:`~specdemo.core.events.RoundEvent` objects, live (what
:meth:`specdemo.session.racer.Racer.run` yields) or rebuilt from a :class:`~specdemo.session.racelog.RaceLog` (the
recordings). The views of :mod:`specdemo.render` and the app draw it; :func:`result_dict` is what the ``/race`` API
returns, :func:`progress_dict` what it streams meanwhile. No torch here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from ..core.economics import CostCurve
from ..core.events import ACCEPTED, Counters, RoundEvent, TokenEvent
from ..core.metrics import Comparison, RunMetrics, compare, run_metrics
from .racelog import LoggedRound, RaceLog, RaceSettings
from .results import RunResult, race_runs

logger = logging.getLogger(__name__)


@dataclass
class PaneState:
    """One side of the race: its tokens in the order shown, counters and the tokens-over-time curve."""

    side: str
    #: every token in the order a pane shows it: a round's accepted drafts, its rejected drafts (struck through,
    #: hidden by default), then the target's own token
    shown: list[TokenEvent] = field(default_factory=list)
    tokens: list[TokenEvent] = field(default_factory=list)  # the output's tokens (no rejected drafts)
    rejected: list[TokenEvent] = field(default_factory=list)
    counters: Counters = field(default_factory=Counters)
    points: list[tuple[float, int]] = field(default_factory=lambda: [(0.0, 0)])  # (own seconds, tokens)
    finished: bool = False
    finish_reason: str | None = None
    text: str = ""
    ids: list[int] = field(default_factory=list)
    rounds: list[LoggedRound] = field(default_factory=list)  # what the race log records

    def add(self, event: RoundEvent) -> None:
        kept = event.tokens
        # the rejected drafts sat where the target's correction now stands: accepted, rejected, correction
        self.shown.extend(t for t in kept if t.kind == ACCEPTED)
        self.shown.extend(event.rejected)
        self.shown.extend(t for t in kept if t.kind != ACCEPTED)
        self.tokens.extend(kept)
        self.rounds.append(LoggedRound.from_event(event))
        self.rejected.extend(event.rejected)
        self.counters = event.counters
        self.points.append((event.counters.seconds, event.counters.new_tokens))
        if event.finished:
            self.finished = True
            self.finish_reason = event.finish_reason
            self.text = event.text
            self.ids = list(event.new_token_ids)

    def output_ids(self) -> list[int]:
        """The ids written so far (the whole output once finished)."""
        return list(self.ids) if self.finished else [t.id for t in self.tokens]

    def metrics(self) -> RunMetrics:
        return run_metrics(self.counters)


@dataclass
class RaceState:
    """Both sides, what was raced, and the outcome once both sides have finished (or the race stopped)."""

    settings: RaceSettings | None = None  # what was raced (None: nothing yet)
    plain: PaneState = field(default_factory=lambda: PaneState("plain"))
    spec: PaneState = field(default_factory=lambda: PaneState("spec"))
    done: bool = False  # both outputs were compared
    divergence: int | None = None  # first position where the outputs differ
    margin: float | None = None  # the target's top-1 minus top-2 logit there
    stop_reason: str | None = None  # set when the race ended before both sides finished (e.g. the time budget)

    @property
    def comparison(self) -> Comparison | None:
        if not self.plain.counters.new_tokens or not self.spec.counters.new_tokens:
            return None
        return compare(self.spec.metrics(), self.plain.metrics())

    @property
    def identical(self) -> bool | None:
        return self.divergence is None if self.done else None

    @property
    def greedy(self) -> bool:
        return self.settings is None or self.settings.greedy

    def runs(self) -> dict[str, RunResult]:
        """Both sides in the one results schema (:mod:`specdemo.session.results`)."""
        return race_runs(self.plain.counters, self.spec.counters, self.done, self.divergence, self.margin)

    def log(self) -> RaceLog:
        """The race so far as a :class:`RaceLog` (the recordings' source, and the ``/race`` API's ``"log"``)."""
        if self.settings is None:
            raise ValueError("a race state without settings cannot be logged")
        return RaceLog(
            self.settings,
            list(self.plain.rounds),
            list(self.spec.rounds),
            self.done,
            self.divergence,
            self.margin,
            self.stop_reason,
        )

    @classmethod
    def from_log(cls, log: RaceLog) -> RaceState:
        """The final state of a logged race, rebuilt round by round as it was built live."""
        state = cls(settings=log.settings)
        for pane in (state.plain, state.spec):
            for event in log.events(pane.side):
                pane.add(event)
        state.conclude(log)
        return state

    def conclude(self, log: RaceLog) -> None:
        """Take the logged race's outcome (once its rounds are in): done, where the outputs part, why it stopped."""
        self.done, self.divergence, self.margin = log.done, log.divergence, log.margin
        self.stop_reason = log.stop_reason


# ----------------------------------------------------------------------------------------------------------------
# the race as JSON (the /race API)


def _token_dict(token: TokenEvent) -> dict[str, Any]:
    return {
        "id": token.id,
        "text": token.text,
        "kind": token.kind,
        "round": token.round,
        "draft_prob": token.draft_prob,
        "target_prob": token.target_prob,
        "source": token.source,
    }


def result_dict(
    state: RaceState, format_reason: str | None = None, calibration: CostCurve | None = None
) -> dict[str, Any]:
    """The race as the ``/race`` API returns it: per side the one results schema plus its text, token kinds and
    tokens; the comparison; what was raced (with why the target runs in its format, and the machine's cost curve,
    when given); and the race log under ``"log"``."""
    runs = state.runs()

    def side(pane: PaneState) -> dict[str, Any]:
        return {
            **runs[pane.side].as_dict(),
            "text": pane.text if pane.finished else "".join(t.text for t in pane.tokens),
            "kinds": [t.kind for t in pane.tokens],
            "tokens": [_token_dict(t) for t in pane.tokens],
            "finish_reason": pane.finish_reason,
        }

    spec_side = side(state.spec)
    spec_side["rejected"] = [_token_dict(t) for t in state.spec.rejected]
    comparison = state.comparison
    result: dict[str, Any] = {
        "plain": side(state.plain),
        "spec": spec_side,
        "comparison": comparison.as_dict() if comparison else None,
        "stopped": state.stop_reason is not None,
        "stop_reason": state.stop_reason,
    }
    settings = state.settings
    if settings is not None:
        result.update(
            {
                "pair": settings.pair,
                "target": settings.target,
                "draft": settings.draft,
                "mode": settings.mode,
                "num_draft_tokens_schedule": settings.num_draft_tokens_schedule,
                "num_draft_tokens": settings.num_draft_tokens,
                "max_num_draft_tokens": settings.max_num_draft_tokens,
                "max_new_tokens": settings.max_new_tokens,
                "temperature": settings.temperature,
                "top_p": settings.top_p,
                "seed": settings.seed,
                "dtype": settings.dtype,
                "format_reason": format_reason,
                "device": settings.device,
                "prompt_tokens": settings.prompt_tokens,
                "methods": settings.methods,
                "compile": settings.compile,
                "calibration": calibration.as_dict() if calibration is not None else None,
                "log": state.log().to_json(),
            }
        )
    return result


def progress_dict(state: RaceState) -> dict[str, Any]:
    """What the ``/race`` API streams while a race runs: tokens written and own compute seconds per side."""
    return {
        "running": True,
        "plain": {"new_tokens": state.plain.counters.new_tokens, "seconds": state.plain.counters.seconds},
        "spec": {"new_tokens": state.spec.counters.new_tokens, "seconds": state.spec.counters.seconds},
    }
