"""What decoding reports, round by round: token events, round events and running counters.

No torch here: the render layer (views, HTML replay, video) and the race log read these without loading torch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Sequence

logger = logging.getLogger(__name__)

#: how a token came to be
ACCEPTED, CORRECTED, BONUS, PLAIN, REJECTED = "accepted", "corrected", "bonus", "plain", "rejected"
#: which part of a drafter proposed a draft token, where a drafter has several (EAGLE's head and its lookup branch)
DRAFTED_BY_HEAD, DRAFTED_BY_LOOKUP, DRAFTED_BY_BOTH = "head", "lookup", "head+lookup"
#: where a suffix-decoding draft token came from: the race's prompt, its own output so far, or an earlier race's
#: answer (:func:`drafted_from_answer` names which; the counters add them up as :data:`EARLIER_ANSWER`)
DRAFTED_FROM_PROMPT, DRAFTED_FROM_OUTPUT, EARLIER_ANSWER = "prompt", "output", "earlier answer"
_ANSWER = "answer "


def drafted_from_answer(number: int) -> str:
    """The source of a draft token that came from the earlier answer numbered ``number``."""
    return f"{_ANSWER}{number}"


def answer_number(source: str | None) -> int | None:
    """Which earlier answer a draft token's ``source`` names (None: it names none)."""
    if source is None or not source.startswith(_ANSWER) or not source[len(_ANSWER) :].isdigit():
        return None
    return int(source[len(_ANSWER) :])


def source_kind(source: str) -> str:
    """A source as the counters add it up: every earlier answer as one (:data:`EARLIER_ANSWER`)."""
    return EARLIER_ANSWER if answer_number(source) is not None else source


@dataclass
class TokenEvent:
    """One token as shown: its id, its text piece, how it was made, and the probabilities behind it."""

    id: int
    text: str
    kind: str
    round: int
    draft_prob: float | None = None
    target_prob: float | None = None
    #: for a draft token of a drafter with several parts, which proposed it (see DRAFTED_BY_HEAD ...)
    source: str | None = None


@dataclass
class Counters:
    """Running totals of one decoding run."""

    new_tokens: int = 0
    target_passes: int = 0
    rounds: int = 0  # verification rounds (passes after the prefill)
    drafted: int = 0
    accepted: int = 0
    rejection_rounds: int = 0  # rounds in which a draft token was rejected
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    accepted_lengths: list[int] = field(default_factory=list)  # tokens per verification round (bonus included)
    draft_lengths: list[int] = field(default_factory=list)  # tokens drafted in each verification round
    drafted_at: list[int] = field(default_factory=list)  # per draft position: how often a token was drafted there
    accepted_at: list[int] = field(default_factory=list)  # ... and accepted there
    tested_at: list[int] = field(default_factory=list)  # ... and checked there (every earlier one accepted)
    #: accepted draft tokens written, by the part of the drafter that proposed them (drafters with several parts)
    accepted_by_source: dict[str, int] = field(default_factory=dict)
    #: seconds of each verification round's target pass, in the order of ``draft_lengths`` (its pass holds the
    #: last token and the draft: ``draft_lengths[i] + 1`` tokens), so a run's cost per pass size can be read off
    verify_seconds_by_round: list[float] = field(default_factory=list)

    def snapshot(self) -> "Counters":
        """A copy that later rounds do not change."""
        return replace(
            self,
            accepted_lengths=list(self.accepted_lengths),
            draft_lengths=list(self.draft_lengths),
            drafted_at=list(self.drafted_at),
            accepted_at=list(self.accepted_at),
            tested_at=list(self.tested_at),
            accepted_by_source=dict(self.accepted_by_source),
            verify_seconds_by_round=list(self.verify_seconds_by_round),
        )

    @property
    def seconds(self) -> float:
        return self.prefill_seconds + self.draft_seconds + self.verify_seconds

    def observe_prefill(self, seconds: float, new_tokens: int) -> None:
        """The prompt's pass: ``seconds`` of it, and ``new_tokens`` written by it (the first)."""
        self.prefill_seconds += seconds
        self.target_passes += 1
        self.new_tokens = new_tokens

    def observe(
        self,
        num_draft_tokens: int,
        num_accepted: int,
        *,
        new_tokens: int | None = None,
        depth: int | None = None,
        sources: Sequence[str] = (),
        draft_seconds: float = 0.0,
        verify_seconds: float = 0.0,
    ) -> None:
        """The one way a verify round enters the counters (a plain step is a round with no draft):
        ``num_draft_tokens`` tokens drafted (tree nodes), ``num_accepted`` of them accepted (the accepted path's
        length), so ``num_accepted + 1`` tokens came from the pass; ``new_tokens``: the run's written tokens after
        it (None: not counted here); per-position counts go by ``depth`` (a chain's depth is its length);
        ``sources``: who drafted each accepted token written (an EOS inside the path cuts it), for a drafter with
        several parts (every earlier answer counted as one, :func:`source_kind`); ``draft_seconds`` and ``verify_seconds``: its drafting and its target pass."""
        depth = num_draft_tokens if depth is None else depth
        if new_tokens is not None:
            self.new_tokens = new_tokens
        self.draft_seconds += draft_seconds
        self.verify_seconds += verify_seconds
        self.verify_seconds_by_round.append(verify_seconds)
        for source in map(source_kind, sources):
            self.accepted_by_source[source] = self.accepted_by_source.get(source, 0) + 1
        self.rounds += 1
        self.target_passes += 1
        self.drafted += num_draft_tokens
        self.accepted += num_accepted
        if num_accepted < num_draft_tokens:
            self.rejection_rounds += 1
        self.accepted_lengths.append(num_accepted + 1)
        self.draft_lengths.append(num_draft_tokens)
        self._observe_positions(depth, num_accepted)

    def _observe_positions(self, depth: int, num_accepted: int) -> None:
        """Per draft position up to ``depth``: drafted, checked (every earlier one accepted), accepted."""
        while len(self.drafted_at) < depth:
            self.drafted_at.append(0)
            self.accepted_at.append(0)
            self.tested_at.append(0)
        for position in range(depth):
            self.drafted_at[position] += 1
            if position <= num_accepted:
                self.tested_at[position] += 1
            if position < num_accepted:
                self.accepted_at[position] += 1

    @classmethod
    def total(cls, runs: Sequence["Counters"]) -> "Counters":
        """The counters of several runs added up, as if they were one run."""
        total = cls()
        for run in runs:
            for name in (
                "new_tokens", "target_passes", "rounds", "drafted", "accepted", "rejection_rounds",
                "prefill_seconds", "draft_seconds", "verify_seconds",
            ):
                setattr(total, name, getattr(total, name) + getattr(run, name))
            total.accepted_lengths.extend(run.accepted_lengths)
            total.draft_lengths.extend(run.draft_lengths)
            total.verify_seconds_by_round.extend(run.verify_seconds_by_round)
            for name in ("drafted_at", "accepted_at", "tested_at"):
                mine, theirs = getattr(total, name), getattr(run, name)
                mine.extend([0] * (len(theirs) - len(mine)))
                for position, count in enumerate(theirs):
                    mine[position] += count
            for source, count in run.accepted_by_source.items():
                total.accepted_by_source[source] = total.accepted_by_source.get(source, 0) + count
        return total


@dataclass
class RoundEvent:
    """What one target forward pass produced."""

    side: str  # "plain" or "spec"
    round: int  # 0 = the prefill pass
    tokens: list[TokenEvent]
    rejected: list[TokenEvent]
    drafted: int
    accepted: int
    draft_seconds: float
    verify_seconds: float
    counters: Counters
    finished: bool = False
    finish_reason: str | None = None  # "eos" or "length"
    new_token_ids: list[int] = field(default_factory=list)  # the whole output so far (set on the final event)
    text: str = ""  # the whole output text so far (set on the final event)
    depth: int | None = None  # a tree's depth, its longest path (None: a chain, as deep as it is long)
