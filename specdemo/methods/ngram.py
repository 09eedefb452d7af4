"""n-gram prompt lookup: propose what followed an earlier occurrence of the context's longest suffix n-gram.

No draft model: drafting costs microseconds beside a target pass, so the draft-length policy treats drafts as free.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass
from typing import Sequence

from ..core.errors import InputError
from ..core.protocol import Proposal, RoundResult, TargetPass
from .base import BuildContext, Method

logger = logging.getLogger(__name__)


NGRAM_PREFERENCES = ("follow", "recent", "first")


class NgramIndex:
    """Maps every n-gram (min_n..max_n) of a growing token sequence to the ends of all its occurrences.

    Only occurrences followed by at least one token are indexed, so a lookup of the sequence's own suffix finds an
    earlier occurrence with a continuation. Which occurrence of the longest matching suffix is copied:

    - ``"recent"``: the most recent one (the one before it when the latest leaves too short a continuation, as in a
      repeated pattern);
    - ``"first"``: the first one (transformers' prompt lookup does this);
    - ``"follow"``: the first one at or after ``follow_from`` (the source position where the last accepted copy
      ended, so an output that copies the prompt in order with edits keeps copying from the right place), and the
      most recent one when there is none or no copy was accepted yet.

    Updating is incremental: each new position is indexed once. The index also keeps what following needs:
    :meth:`copy` remembers where its continuation came from, :meth:`follow` moves ``follow_from`` on past the
    copied tokens the target accepted, and a new sequence forgets both.
    """

    def __init__(self, min_n: int = 1, max_n: int = 4, prefer: str = "follow") -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        if prefer not in NGRAM_PREFERENCES:
            raise ValueError(f"n-gram preference must be one of {', '.join(NGRAM_PREFERENCES)}, got {prefer!r}")
        self.min_n = min_n
        self.max_n = max_n
        self.prefer = prefer
        self.tokens: list[int] = []
        self._ends: dict[tuple[int, ...], list[int]] = {}  # n-gram -> ends of its occurrences, ascending
        self._indexed_ends = 0  # ends 0.._indexed_ends-1 are in the table
        #: the source position after the last accepted copied token (where ``"follow"`` copies from next)
        self.follow_from: int | None = None
        self._copied_from: int | None = None  # end of the occurrence the last copy came from

    def reset(self) -> None:
        self.tokens = []
        self._ends = {}
        self._indexed_ends = 0
        self.follow_from = self._copied_from = None

    def extend(self, context: Sequence[int]) -> bool:
        """Bring the index up to date with ``context``; returns True when it had to start over (a new sequence)."""
        known = len(self.tokens)
        restarted = False
        if len(context) < known or list(context[max(0, known - 8) : known]) != self.tokens[max(0, known - 8) :]:
            self.reset()
            known = 0
            restarted = True
        self.tokens.extend(int(t) for t in context[known:])
        tokens = self.tokens
        for end in range(self._indexed_ends, len(tokens) - 1):
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                self._ends.setdefault(tuple(tokens[end - n + 1 : end + 1]), []).append(end)
        self._indexed_ends = max(self._indexed_ends, len(tokens) - 1)
        return restarted

    def find(self, num_draft_tokens: int, follow_from: int | None = None) -> tuple[list[int], int | None]:
        """The continuation to copy and the end of the occurrence it follows (None when nothing matches)."""
        tokens, source, _ = self.match(num_draft_tokens, follow_from)
        return tokens, source

    def match(self, num_draft_tokens: int, follow_from: int | None = None) -> tuple[list[int], int | None, int]:
        """As :meth:`find`, with the length of the n-gram matched (0 when nothing matches)."""
        tokens = self.tokens
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            ends = self._ends.get(tuple(tokens[len(tokens) - n :]))
            if not ends:
                continue
            after = len(ends)
            if self.prefer == "follow" and follow_from is not None:
                after = bisect.bisect_left(ends, follow_from)
            if self.prefer == "first":
                source = ends[0]
            elif after < len(ends):
                source = ends[after]
            else:
                source = self._recent(ends, num_draft_tokens)
            return tokens[source + 1 : source + 1 + num_draft_tokens], source, n
        return [], None, 0

    def copy(self, num_draft_tokens: int) -> tuple[list[int], int]:
        """The continuation to draft (at most ``num_draft_tokens`` tokens, following the last accepted copy) and the
        length of the n-gram matched; where it came from is kept for :meth:`follow`."""
        if num_draft_tokens <= 0:
            self._copied_from = None
            return [], 0
        tokens, self._copied_from, matched = self.match(num_draft_tokens, self.follow_from)
        return tokens, matched

    def follow(self, accepted: int) -> None:
        """The target accepted the first ``accepted`` tokens of the last copy: copy on from after them next time
        (nothing changes when it accepted none)."""
        if self._copied_from is not None and accepted > 0:
            self.follow_from = self._copied_from + accepted
        self._copied_from = None

    def lookup(self, num_draft_tokens: int) -> list[int]:
        """Continuation of the longest suffix n-gram that occurred before (see the class for which occurrence)."""
        return self.find(num_draft_tokens)[0]

    def _recent(self, ends: list[int], num_draft_tokens: int) -> int:
        latest = ends[-1]
        if len(ends) > 1 and len(self.tokens) - 1 - latest < num_draft_tokens:
            # the latest occurrence runs into the suffix: the one before it has a longer continuation
            return ends[-2]
        return latest


class NgramDrafter:
    """Prompt lookup decoding: propose what followed an earlier occurrence of the context's longest suffix n-gram."""

    name = "ngram"
    needs_hidden_states = False
    hidden_layers: tuple[int, ...] | None = None

    def __init__(self, min_n: int = 1, max_n: int = 4, prefer: str = "follow") -> None:
        self.index = NgramIndex(min_n, max_n, prefer)

    def start(self, prompt_ids: Sequence[int], prefill: TargetPass | None = None) -> None:
        self.index.reset()

    def propose(self, context: Sequence[int], num_draft_tokens: int) -> Proposal:
        if num_draft_tokens > 0:
            self.index.extend(context)
        tokens, _ = self.index.copy(num_draft_tokens)
        return Proposal(tokens, None)

    def feedback(self, result: RoundResult) -> None:
        self.index.follow(result.num_accepted)


#: a lookup branch's acceptance is counted per draft position up to this depth (deeper ones share the last count)
LOOKUP_DEPTHS = 8
#: ... and apart for matches of 1, 2 and 3 or more tokens (a longer match is copied right more often)
LOOKUP_MATCHES = 3
#: how much each earlier round still weighs in those counts (recent rounds matter most: copying comes in stretches)
LOOKUP_DECAY = 0.9
#: the counts' start (accepted, tested) at every position: 1 in 4 before anything is known
LOOKUP_PRIOR = (1.0, 4.0)


class LookupBranch:
    """Prompt lookup as one more branch of another drafter's tree (EAGLE's): the continuation the n-gram index
    copies, with each token's estimated chance that the target writes the whole branch up to it.

    The chance is learnt from the target's own output, whether or not the branch was verified, and however much of
    it the tree held: each branch proposed is kept until the target has written past its first wrong token (or its
    end), over as many rounds as that takes, then scored. Position j counts as tested when the branch's first j
    tokens were written and a (j+1)-th was. (Scoring a branch only against the round it was proposed in would
    never test the positions a tree leaves out, so a branch cut short once would stay short.) The conditional
    rates, per position and per length of the n-gram matched (decayed counts, :data:`LOOKUP_DECAY`), multiply into
    path probabilities, so they fall along the branch and a tree sized by them stays a tree.
    """

    def __init__(self, min_n: int = 1, max_n: int = 4, prefer: str = "follow") -> None:
        self.index = NgramIndex(min_n, max_n, prefer)
        accepted, tested = LOOKUP_PRIOR
        self._accepted = [[accepted] * LOOKUP_DEPTHS for _ in range(LOOKUP_MATCHES)]
        self._tested = [[tested] * LOOKUP_DEPTHS for _ in range(LOOKUP_MATCHES)]
        self._tokens: list[int] = []  # the branch last proposed
        #: branches not scored yet: (tokens written before it, its tokens, its match-length bucket)
        self._open: list[tuple[int, list[int], int]] = []

    def start(self) -> None:
        self.index.reset()
        self._tokens, self._open = [], []

    def rates(self, matched: int = 1) -> list[float]:
        """The estimated chance of each position's token given that the ones before it were right, for a copy
        after an n-gram of ``matched`` tokens."""
        bucket = match_bucket(matched)
        return [a / t for a, t in zip(self._accepted[bucket], self._tested[bucket])]

    def propose(self, context: Sequence[int], num_draft_tokens: int) -> tuple[list[int], list[float]]:
        """The branch after ``context`` (at most ``num_draft_tokens`` tokens) and each token's path probability; the
        branches proposed before are scored against ``context`` first."""
        if self.index.extend(context):
            self._open = []
        self._score(self.index.tokens)
        self._tokens, matched = self.index.copy(num_draft_tokens)
        if self._tokens:
            self._open.append((len(self.index.tokens), list(self._tokens), match_bucket(matched)))
        rates, probs, prob = self.rates(matched), [], 1.0
        for position in range(len(self._tokens)):
            prob *= rates[min(position, LOOKUP_DEPTHS - 1)]
            probs.append(prob)
        return list(self._tokens), probs

    def _score(self, tokens: Sequence[int]) -> None:
        """Count the open branches that ``tokens`` (the sequence so far) decides: written past a wrong token or
        past the branch's end."""
        still_open = []
        for offset, branch, bucket in self._open:
            written = tokens[offset : offset + len(branch)]
            matched = _agreeing(branch, written)
            if matched == len(written) < len(branch):  # right so far, the rest not written yet
                still_open.append((offset, branch, bucket))
                continue
            tested, hits = self._tested[bucket], self._accepted[bucket]
            for position in range(min(matched + 1, len(branch))):
                depth = min(position, LOOKUP_DEPTHS - 1)
                tested[depth] = LOOKUP_DECAY * tested[depth] + 1.0
                hits[depth] = LOOKUP_DECAY * hits[depth] + float(position < matched)
        self._open = still_open

    def feedback(self, accepted: Sequence[int]) -> int:
        """After a round that accepted the draft tokens ``accepted``: follow the copy on when the branch held
        some of them, and return how many it held (its accepted prefix). (What the branch learns from the round is
        counted at the next :meth:`propose`, which sees the tokens written.)"""
        held = _agreeing(self._tokens, accepted)
        self.index.follow(held)
        self._tokens = []
        return held


def match_bucket(matched: int, buckets: int = LOOKUP_MATCHES) -> int:
    """Which of ``buckets`` acceptance records a draft after a match of ``matched`` tokens uses (the last one for
    every longer match): a lookup branch's, or a suffix tree's."""
    return min(max(matched, 1), buckets) - 1


def _agreeing(first: Sequence[int], second: Sequence[int]) -> int:
    """How many leading tokens two sequences share."""
    count = 0
    while count < min(len(first), len(second)) and first[count] == second[count]:
        count += 1
    return count


@dataclass(frozen=True)
class NgramOptions:
    """The n-gram sizes looked up (longest first) and which earlier occurrence is copied."""

    ngram_min: int = 1
    ngram_max: int = 4
    ngram_prefer: str = "follow"

    def validate(self) -> None:
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise InputError(f"n-gram sizes must satisfy 1 <= min <= max, got {self.ngram_min}..{self.ngram_max}")
        if self.ngram_prefer not in NGRAM_PREFERENCES:
            raise InputError(f"n-gram preference must be one of: {', '.join(NGRAM_PREFERENCES)}")


def _build(context: BuildContext) -> NgramDrafter:
    options: NgramOptions = context.options
    return NgramDrafter(options.ngram_min, options.ngram_max, options.ngram_prefer)


METHOD = Method(
    name="ngram",
    label="n-gram prompt lookup (no draft model)",
    build=_build,
    options=NgramOptions,
    drafts_for_free=True,
)
