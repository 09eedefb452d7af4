"""How many tokens to draft each round: fixed, HF's +2/-1 heuristic, or a cost-aware adaptive policy; and, for
drafters that propose token trees, how many of their candidates to verify and when to rest (:class:`TreeSizer`,
one policy for Medusa and EAGLE alike)."""

from __future__ import annotations

import logging
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

from ..core.economics import (
    PAYING_ACCEPTANCE,
    PAYING_SPEEDUP,
    CostCurve,
    can_pay,
    expected_tokens,
)
from ..core.protocol import DraftLengthPolicy
from ..core.settings import MAX_NUM_DRAFT_TOKENS

logger = logging.getLogger(__name__)

#: where drafting can hardly pay, the share of plain-decoding time that probes (with the drafter's catch-up) may cost
PROBE_BUDGET = 0.015
#: a round whose drafter came back empty counts as one rejected draft token when the drafter's work took more than
#: this share of the plain step beside it (a universal drafter's catch-up and drafting); an n-gram lookup that
#: found nothing costs less and counts as a plain step
EMPTY_DRAFT_SHARE = 0.05
#: the gain a switch between drafting and plain decoding must promise
SWITCH_MARGIN = 0.03
#: a verify length's cost (and the draft's cost per token) is a low quantile of its latest measurements: slow
#: outliers (another process, a page fault) cannot move it, and there are no fast ones
RECENT_PASSES = 5
#: the most rounds a tree drafter sits out (its heads not run) after trees that did not pay, before it looks again
MAX_REST = 32
#: how much of their weight a tree drafter's calibration and its trees' record keep from one round to the next
TREE_DECAY = 0.9
#: stands in a run of measurements for the calibrated cost (see :meth:`CostAwareDraftLength._refresh_estimates`)
PRIOR = None


@dataclass
class FixedDraftLength:
    """Always ask for ``num_draft_tokens`` tokens."""

    num_draft_tokens: int

    def next_num_draft_tokens(self, remaining: int | None = None) -> int:
        return self.num_draft_tokens

    def update(
        self,
        num_draft_tokens: int,
        num_accepted: int,
        draft_seconds: float,
        verify_seconds: float,
        catch_up_seconds: float = 0.0,
    ) -> None:
        pass


@dataclass
class HeuristicDraftLength:
    """transformers' heuristic: +2 after a round where every draft token was accepted, -1 otherwise."""

    num_draft_tokens: int = 5
    min_num_draft_tokens: int = 1
    max_num_draft_tokens: int = 16

    def next_num_draft_tokens(self, remaining: int | None = None) -> int:
        return self.num_draft_tokens

    def update(
        self,
        num_draft_tokens: int,
        num_accepted: int,
        draft_seconds: float,
        verify_seconds: float,
        catch_up_seconds: float = 0.0,
    ) -> None:
        if num_draft_tokens == 0:
            return
        if num_accepted == num_draft_tokens:
            self.num_draft_tokens = min(self.max_num_draft_tokens, self.num_draft_tokens + 2)
        else:
            self.num_draft_tokens = max(self.min_num_draft_tokens, self.num_draft_tokens - 1)


def _low_quantile(recent: Sequence[float]) -> float:
    """The timing a run of measurements stands for: the lower third of them (see :data:`RECENT_PASSES`)."""
    return sorted(recent)[len(recent) // 3]


def _theil_sen(points: list[tuple[int, float]], length: int) -> float:
    """The Theil-Sen line through ``points`` (length, seconds) at ``length``: the median of the pairwise slopes
    (never negative), then the median intercept; one outlier among three or more points barely moves it."""
    slopes = [(t2 - t1) / (n2 - n1) for i, (n1, t1) in enumerate(points) for n2, t2 in points[i + 1 :] if n2 != n1]
    slope = max(0.0, statistics.median(slopes)) if slopes else 0.0
    return statistics.median(t - slope * n for n, t in points) + slope * length


class CostAwareDraftLength:
    """Pick the k that maximises expected tokens per second from measured costs and acceptance.

    Tokens per round with k drafts: E(k) = 1 + sum_j P(first j accepted), from a per-position acceptance estimate
    (see :func:`expected_tokens`). Cost of a round: k * t_draft + t_verify(k + 1), with t_verify fitted to the verify
    passes measured so far (see :meth:`_verify_cost`) and t_draft the measured draft time per token. Each timing is
    a low quantile of its latest measurements, so a few slow passes (another process) cannot tip a decision, and a
    switch between drafting and plain steps must promise ``SWITCH_MARGIN`` more (flip-flopping costs catch-ups).
    k = 0 is a plain target step, so when drafts keep being rejected the policy falls back to (nearly) plain
    decoding; it still probes a one-token draft now and then so that it notices when drafting starts to pay again:
    after ``probe_every`` plain steps, twice as many after each probe that did not bring drafting back (up to
    ``max_probe_every``), since a probe costs a draft step plus whatever the drafter must catch up on, and none
    when fewer tokens are left to write than plain steps it waited for (it could not pay for itself). Where the
    costs say drafting could hardly pay even at a good acceptance (a verify pass over k tokens costs nearly k plain
    steps), probes come only while their expected cost fits in ``PROBE_BUDGET`` of the plain-decoding time, and
    the first round drafts a single token. Acceptance estimates are exponentially weighted, so the policy follows
    the text.

    ``prior``: the machine's measured cost curve (:mod:`specdemo.session.calibration`): its verify costs (and
    ``draft_seconds_per_token``) count as one measurement each, so the first decisions rest on this machine's costs
    rather than on nothing. They are scaled by how much slower or faster this run's passes are than the curve
    says: a machine's speed drifts with its load (a one-token pass calibrated at 85 ms took 103-117 ms in runs
    minutes later), and a stale cost for a rarely measured length would make a 2-token pass look cheaper than a
    plain step measured now. The time a drafter spends catching up on text written during plain steps is no cost per
    drafted token: the engine books it apart (``catch_up_seconds``, from ``Proposal.catch_up_seconds``), so a probe
    after a run of plain steps does not make drafting look dearer than it is.
    """

    def __init__(
        self,
        num_draft_tokens: int = 4,
        max_num_draft_tokens: int = 12,
        decay: float = 0.9,
        probe_every: int = 8,
        measure_plain_step: bool = True,
        max_probe_every: int = 64,
        prior: "CostCurve | None" = None,
        draft_seconds_per_token: float | None = None,
    ) -> None:
        self._first_num_draft_tokens = min(num_draft_tokens, max_num_draft_tokens)  # the first round's
        self.measure_plain_step = measure_plain_step
        self.max_num_draft_tokens = max_num_draft_tokens
        self.decay = decay
        self.probe_every = probe_every
        self.max_probe_every = max(probe_every, max_probe_every)
        self._probe_interval = probe_every  # plain steps before the next probe
        self._probing = False
        self._accepted = 0.0
        self._rejections = 0.0
        self._tested_at = [0.0] * max_num_draft_tokens  # per draft position: (weighted) rounds in which it was checked
        self._passed_at = [0.0] * max_num_draft_tokens  # ... and accepted
        self._draft_time_per_token: float | None = None
        self._verify_time: dict[int, float] = {}  # verify input length -> estimated seconds
        # verify input length -> its latest passes (seconds), or PRIOR for the calibrated cost
        self._verify_recent: dict[int, deque[float | None]] = {}
        self._draft_recent: deque[float | None] = deque(maxlen=RECENT_PASSES)  # latest draft seconds per token
        self._prior = prior
        self._prior_draft = draft_seconds_per_token if prior is not None else None
        # this run's passes over what the calibrated curve says they cost: how much slower the machine is now
        self._drift_recent: deque[float] = deque(maxlen=2 * RECENT_PASSES)
        self._rounds = 0
        self._rounds_since_draft = 0
        self._plain_seconds_since_draft = 0.0
        self._catch_up_per_token: float | None = None  # the drafter's catch-up per plain step it sat out
        self._plain_measured = False  # a plain step timed in this run (TreeBudget times one even with a prior)
        self.num_draft_tokens = self._first_num_draft_tokens
        if prior is not None:
            for length in prior.lengths:
                if length <= max_num_draft_tokens + 1:
                    self._verify_recent[length] = deque([PRIOR], maxlen=RECENT_PASSES)
            if draft_seconds_per_token is not None:
                self._draft_recent.append(PRIOR)
            self._refresh_estimates()

    @property
    def acceptance(self) -> float:
        """Estimated probability that one draft token is accepted, pooled over positions (prior: 1 in 2)."""
        return (self._accepted + 1.0) / (self._accepted + self._rejections + 2.0)

    def acceptance_at(self) -> list[float]:
        """Per position: estimated probability of acceptance given the earlier positions were accepted.

        Each position's own record, shrunk toward the pooled estimate where it has little evidence yet.
        """
        pooled = min(self.acceptance, 0.999)
        prior_weight = 2.0
        return [
            min((passed + prior_weight * pooled) / (tested + prior_weight), 0.999)
            for tested, passed in zip(self._tested_at, self._passed_at)
        ]

    def _verify_cost(self, length: int) -> float:
        """Seconds of a verify pass over ``length`` tokens, from a model fitted to every measured length.

        A one-token pass is a plain step and keeps its own measured value (on some hardware any longer pass costs
        a step more). A longer length between two measured ones is read off the straight segment between them, so
        a curve that stays flat up to some length and then climbs (int8 weights on a CPU) keeps its flat part;
        past the longest measured length a straight line fitted by Theil-Sen (the median of the slopes between
        measured lengths) extrapolates. A length measured once is first held to 1.5 times what the other lengths
        predict, so one slow pass cannot make verification look much dearer.
        """
        known = self._verify_time
        if length == 1:
            return known[1] if 1 in known else min(known.values())  # not measured yet: no cheaper than any verify
        points = sorted((n, t) for n, t in known.items() if n >= 2)
        if not points:
            return known[1]  # only a plain step measured so far: assume verification costs as much
        if len(points) >= 3:  # a length measured once is held to 1.5 times what the other lengths predict
            points = [
                (n, min(t, 1.5 * _theil_sen(points[:i] + points[i + 1 :], n)))
                if len(self._verify_recent.get(n, ())) == 1 else (n, t)
                for i, (n, t) in enumerate(points)
            ]
        below = [(n, t) for n, t in points if n <= length]
        above = [(n, t) for n, t in points if n >= length]
        if below and above:
            (n0, t0), (n1, t1) = below[-1], above[0]
            if n0 == n1:
                return max(1e-9, t0)
            return max(1e-9, t0 + (t1 - t0) * (length - n0) / (n1 - n0))
        return max(1e-9, _theil_sen(points, length))

    def drafting_could_pay(self, acceptance: float = PAYING_ACCEPTANCE, margin: float = PAYING_SPEEDUP) -> bool:
        """Whether drafting at a good acceptance (``acceptance`` per token) would beat plain decoding by ``margin``
        on the costs known so far. Where it would not (a verify pass over k tokens costs nearly k plain steps), a
        probe can hardly win anything back, so probes come only within :data:`PROBE_BUDGET` of the plain time."""
        if self._draft_time_per_token is None or not self._verify_time:
            return True  # nothing known yet
        plain, per_draft = self._verify_cost(1), self._draft_time_per_token
        reachable = 2 * max(self._verify_time)
        lengths = range(1, min(self.max_num_draft_tokens, reachable) + 1)
        return can_pay(lambda k: (k * per_draft + self._verify_cost(k + 1)) / plain, lengths, acceptance, margin)

    def _probe_fits_budget(self, acceptance: float) -> bool:
        """A one-token probe's expected extra cost (its draft, the drafter's catch-up on the plain steps since its
        last round, the longer verify pass, less the token it may win) within ``PROBE_BUDGET`` of the time spent
        on plain steps since the last draft."""
        behind = self._rounds_since_draft
        catch_up = behind * (self._catch_up_per_token if self._catch_up_per_token is not None
                             else self._draft_time_per_token or 0.0)
        plain = self._verify_cost(1)
        extra = (self._draft_time_per_token or 0.0) + catch_up + self._verify_cost(2) - plain * (1.0 + acceptance)
        return extra <= PROBE_BUDGET * self._plain_seconds_since_draft

    def next_num_draft_tokens(self, remaining: int | None = None) -> int:
        self._rounds += 1
        if self._rounds == 1 or self._draft_time_per_token is None or not self._verify_time:
            # a first look at acceptance; a single draft token where the prior says drafting can hardly pay
            first = self._first_num_draft_tokens
            return first if self.drafting_could_pay() else min(1, first)
        if self._rounds == 2 and self.measure_plain_step and 1 not in self._verify_time:
            return 0  # measure a plain step once: the reference every other length is compared with
        acceptance_at = self.acceptance_at()
        # explore at most twice the longest measured verify: longer ones are extrapolated from measured costs
        reachable = 2 * max(self._verify_time)
        # switching between drafting and plain steps must win by SWITCH_MARGIN: a flip back and forth on a noisy
        # acceptance estimate costs the drafter a catch-up each time
        drafting_now = self._rounds_since_draft == 0
        best_k, best_rate = 0, (1.0 - SWITCH_MARGIN * drafting_now) / self._verify_cost(1)
        for k in range(1, min(self.max_num_draft_tokens, reachable) + 1):
            cost = k * self._draft_time_per_token + self._verify_cost(k + 1)
            rate = (1.0 - SWITCH_MARGIN * (not drafting_now)) * expected_tokens(acceptance_at, k) / cost
            if rate > best_rate:
                best_k, best_rate = k, rate
        if best_k > 0:
            self._probe_interval = self.probe_every
        self._probing = (
            best_k == 0
            and self._rounds_since_draft >= self._probe_interval
            # a probe near the end of a run could not pay for itself: too few tokens left to draft if it succeeds
            and (remaining is None or remaining > self._probe_interval)
            # past the longest wait (probes held back while drafting could hardly pay) the drafter's catch-up
            # on everything written since grows without bound: such a probe must fit the budget whatever the costs
            and ((self.drafting_could_pay() and self._rounds_since_draft <= self.max_probe_every)
                 or self._probe_fits_budget(acceptance_at[0]))
        )
        if self._probing:
            best_k = 1
        self.num_draft_tokens = best_k
        return best_k

    def update(
        self,
        num_draft_tokens: int,
        num_accepted: int,
        draft_seconds: float,
        verify_seconds: float,
        catch_up_seconds: float = 0.0,
    ) -> None:
        length = num_draft_tokens + 1
        self._verify_recent.setdefault(length, deque(maxlen=RECENT_PASSES)).append(verify_seconds)
        if self._prior is not None:
            self._drift_recent.append(verify_seconds / self._calibrated_seconds(length))
        drafter_worked = draft_seconds + catch_up_seconds > EMPTY_DRAFT_SHARE * verify_seconds
        if num_draft_tokens == 0 and self.num_draft_tokens > 0 and drafter_worked:
            # the drafter worked (caught up, drafted) and came back empty (a universal drafter's text that maps to no
            # target token): a draft of one token, rejected, or the policy would keep paying for nothing
            num_draft_tokens = 1
        elif num_draft_tokens == 0:
            self._plain_measured = True
            self._rounds_since_draft += 1  # a plain step, or a lookup that found nothing and cost nothing
            self._plain_seconds_since_draft += verify_seconds
            self._refresh_estimates()
            return
        self._end_drafting_pause(catch_up_seconds)
        self._draft_recent.append(draft_seconds / num_draft_tokens)
        self._refresh_estimates()
        self._accepted = self.decay * self._accepted + num_accepted
        self._rejections = self.decay * self._rejections + (1.0 if num_accepted < num_draft_tokens else 0.0)
        for position in range(self.max_num_draft_tokens):
            self._tested_at[position] *= self.decay
            self._passed_at[position] *= self.decay
        for position in range(min(num_draft_tokens, num_accepted + 1, self.max_num_draft_tokens)):
            self._tested_at[position] += 1.0
            if position < num_accepted:
                self._passed_at[position] += 1.0

    def _calibrated_seconds(self, length: int) -> float:
        """What the calibrated curve (``prior``, required) says a verify pass over ``length`` tokens costs."""
        assert self._prior is not None
        return self._prior.seconds[0] * self._prior.cost(length)

    def _refresh_estimates(self) -> None:
        """Each verify length's cost and the draft's cost per token: a low quantile of the latest measurements,
        the calibrated cost among them while it is one of the latest. The calibrated cost counts as measured on
        the machine as it runs now: times the low quantile of this run's passes over what the curve says they
        cost (many passes of every length, so one slow pass cannot move it)."""
        drift = _low_quantile(self._drift_recent) if self._drift_recent else 1.0

        def resolved(recent: Sequence[float | None], calibrated: float) -> list[float]:
            return [calibrated * drift if seconds is PRIOR else seconds for seconds in recent]

        for length, recent in self._verify_recent.items():
            calibrated = self._calibrated_seconds(length) if self._prior is not None else 0.0
            self._verify_time[length] = _low_quantile(resolved(recent, calibrated))
        if self._draft_recent:
            self._draft_time_per_token = _low_quantile(resolved(self._draft_recent, self._prior_draft or 0.0))

    def _end_drafting_pause(self, catch_up_seconds: float) -> None:
        """The drafter had a round (drafts or a probe): book its catch-up per plain step it sat out, and restart
        the count of plain steps; a probe doubles the wait for the next one."""
        if catch_up_seconds > 0 and self._rounds_since_draft > 0:
            per_token = catch_up_seconds / self._rounds_since_draft
            previous = self._catch_up_per_token
            self._catch_up_per_token = per_token if previous is None else 0.7 * previous + 0.3 * per_token
        self._rounds_since_draft = 0
        self._plain_seconds_since_draft = 0.0
        if self._probing:  # the pace comes back only when drafting pays again (see next_num_draft_tokens)
            self._probe_interval = min(2 * self._probe_interval, self.max_probe_every)
        self._probing = False


class TreeBudget(CostAwareDraftLength):
    """A node budget for token trees: always ``max_num_draft_tokens`` nodes at most, and the verify cost model of the
    adaptive policy (measured passes fitted on top of the calibrated curve) for the drafter, which sizes each tree
    itself from its candidates' probabilities through :class:`TreeSizer`."""

    def next_num_draft_tokens(self, remaining: int | None = None) -> int:
        self._rounds += 1
        if self._rounds == 2 and self.measure_plain_step and not self._plain_measured:
            # time a plain step in this run, calibrated or not: the machine's speed drifts with its load (one-token
            # passes measured 41 to 69 ms here), and beside a stale plain step freshly measured tree passes look
            # free (measured: 14 rounds of 3-node trees at 3 % acceptance before the drafter gave up)
            return 0
        return self.max_num_draft_tokens

    def verify_cost(self, length: int) -> float:
        """Seconds of a verify pass over ``length`` tokens (a guess of 1 s per pass before any measurement)."""
        if not self._verify_time:
            return 1.0
        return self._verify_cost(length)


def lean_low(previous: float | None, seconds: float) -> float:
    """A running timing that leans low: a new measurement pulls it down at once and up by a fifth, so a slow
    outlier (another process) barely moves it."""
    return seconds if previous is None else min(seconds, 0.8 * previous + 0.2 * seconds)


class TreeSizer:
    """How much of a tree to verify, and when to rest: the one decision every tree drafter (Medusa, EAGLE) leaves
    to it.

    A drafter hands it its candidates' path probabilities, best first (every prefix a tree), and the seconds its
    drafting took; :meth:`keep` returns the count that maximises expected tokens per second under ``verify_cost``
    (seconds of a verify pass over n tokens, from :class:`TreeBudget`; without it, every candidate), none when a
    plain step is better. The probabilities are scaled by the drafter's record (observed over predicted accepted
    tokens of its recent trees, :meth:`observe`), since heads' probabilities are not calibrated. After a tree that
    does not pay the drafter rests (its heads not run) 1, 2, 4 ... up to :data:`MAX_REST` rounds, and the record
    drifts back toward trusting it, so that a later stretch of predictable text can win it back."""

    def __init__(self, verify_cost: Callable[[int], float] | None = None) -> None:
        self.verify_cost = verify_cost
        self._expected = 0.0  # predicted accepted tokens, summed over rounds (decayed)
        self._observed = 0.0  # ... and accepted
        self._last_expected = 0.0  # the tree just proposed: its predicted accepted tokens
        self._rest = 1  # rounds to sit out after the next round whose best tree does not pay
        self._resting = 0  # rounds left to sit out now

    def start(self) -> None:
        """A new sequence: no rest owed (the record of calibration is kept)."""
        self._rest, self._resting = 1, 0

    @property
    def calibration(self) -> float:
        """Observed over predicted accepted tokens of recent trees."""
        return (self._observed + 1.0) / (self._expected + 1.0)

    def best_size(self, probs: Sequence[float], draft_seconds: float, ratio: float | None = None,
                  ) -> tuple[int, float, float]:
        """(count, tokens per second, expected tokens) of the best tree made of the first ``count`` of ``probs``
        (scaled by ``ratio``; None: the calibration), the verify pass and ``draft_seconds`` of drafting counted;
        count 0 is a plain step. Needs ``verify_cost``."""
        assert self.verify_cost is not None
        ratio = self.calibration if ratio is None else ratio
        best_count, best_rate, best_expected = 0, 1.0 / self.verify_cost(1), 1.0
        expected = 1.0
        for count, prob in enumerate(probs, start=1):
            expected += ratio * prob
            rate = expected / (draft_seconds + self.verify_cost(count + 1))
            if rate > best_rate:
                best_count, best_rate, best_expected = count, rate, expected
        return best_count, best_rate, best_expected

    def keep(self, probs: Sequence[float], draft_seconds: float, ratio: float | None = None) -> int:
        """How many of the best candidates pay for their place in the verify pass (all, without a cost model)."""
        if self.verify_cost is None or not probs:
            return len(probs)
        return self.best_size(probs, draft_seconds, ratio)[0]

    def step_may_pay(self, probs: Sequence[float], frontier: Sequence[float], max_children: int, max_nodes: int,
                     spent: float, step_seconds: float | None) -> bool:
        """Whether one more drafting step could make the tree pay more than the best tree of the candidates drafted
        so far (``probs``, every node's path probability; ``spent`` seconds of drafting). The step drafts up to
        ``max_children`` children of the ``frontier`` nodes (their path probabilities), each worth at most its
        parent and in sum at most the frontier's; it costs ``step_seconds`` and a verify pass as many nodes longer
        (at ``max_nodes``, a child takes the place of the weakest kept node): without a cost model or a measured
        step, always."""
        if self.verify_cost is None or step_seconds is None:
            return True
        ranked = sorted(probs, reverse=True)[:max_nodes]
        count, rate, expected = self.best_size(ranked, spent)
        ratio = self.calibration
        best, mass = max(frontier), sum(frontier)
        for children in range(1, max_children + 1):
            displaced = max(0, count + children - max_nodes)  # over the budget a child takes a kept node's place
            if displaced > count:
                break
            gain = ratio * (min(children * best, mass) - sum(ranked[count - displaced : count]))
            nodes = count + children - displaced
            if (expected + gain) / (spent + step_seconds + self.verify_cost(nodes + 1)) > rate:
                return True
        return False

    def proposed(self, expected: float, kept: int | None) -> None:
        """The tree proposed: its predicted accepted tokens (``expected``, uncalibrated) and how many of the
        drafter's own nodes it kept (None: the drafter did not run this round, which paces nothing)."""
        self._last_expected = expected
        if kept is not None:
            self._pace(kept)

    def resting(self) -> bool:
        """Whether the drafter sits this round out (each call uses up one round of rest)."""
        if self._resting > 0:
            self._resting -= 1
            return True
        return False

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """A verified round: ``num_accepted`` of the drafter's own tokens accepted from the tree last proposed."""
        if num_draft_tokens and self._last_expected > 0:
            self._expected = TREE_DECAY * self._expected + self._last_expected
            self._observed = TREE_DECAY * self._observed + num_accepted

    def _pace(self, kept: int) -> None:
        """After a tree that pays, no rest; after one that does not, rest ``_rest`` rounds (doubling up to
        :data:`MAX_REST` while no tree pays) and let the record drift back toward trusting the drafter."""
        if self.verify_cost is None:
            return
        if kept > 0:
            self._rest = 1
            return
        self._resting = self._rest
        self._rest = min(2 * self._rest, MAX_REST)
        self._expected *= TREE_DECAY
        self._observed *= TREE_DECAY


#: how the draft length is chosen each round (``num_draft_tokens_schedule``): k every round, the cost-aware policy,
#: or transformers' +2/-1 heuristic (as its ``num_assistant_tokens_schedule``)
NUM_DRAFT_TOKENS_SCHEDULES = ("fixed", "adaptive", "heuristic")


def make_policy(
    schedule: str,
    num_draft_tokens: int | None = None,
    max_num_draft_tokens: int = 12,
    free_drafts: bool = False,
    prior: CostCurve | None = None,
) -> DraftLengthPolicy:
    """The policy of ``schedule`` (one of :data:`NUM_DRAFT_TOKENS_SCHEDULES`): "fixed" drafts ``num_draft_tokens``
    (required, 1 to :data:`~specdemo.core.settings.MAX_NUM_DRAFT_TOKENS`) every round; "adaptive" (cost-aware) and
    "heuristic" (+2/-1) draft up to ``max_num_draft_tokens``, ``num_draft_tokens`` in the first round (None: the
    schedule's own start: the adaptive policy's 4, or its longest with free drafts; the heuristic's 5).

    ``free_drafts``: drafting costs next to nothing (n-gram lookup), so the adaptive policy starts at its longest
    draft instead of ramping up to it, and takes its plain-step cost from the rounds with no draft (there are always
    some) instead of spending a round on measuring it; measured verify costs bring k down where long passes cost
    more. ``prior``: the machine's cost curve, which the adaptive policy's estimates start from (its draft step only
    for a draft-model drafter; free drafts learn their tiny cost from the first round).
    """
    if num_draft_tokens is not None and (
        not isinstance(num_draft_tokens, int) or isinstance(num_draft_tokens, bool)
        or not 1 <= num_draft_tokens <= MAX_NUM_DRAFT_TOKENS
    ):
        raise ValueError(
            f"num_draft_tokens must be a whole number from 1 to {MAX_NUM_DRAFT_TOKENS}, got {num_draft_tokens!r}"
        )
    if schedule == "fixed":
        if num_draft_tokens is None:
            raise ValueError("num_draft_tokens_schedule 'fixed' needs num_draft_tokens, the tokens drafted every round")
        return FixedDraftLength(num_draft_tokens)
    if schedule == "adaptive":
        draft_seconds = prior.draft_seconds_per_token if prior is not None and not free_drafts else None
        if num_draft_tokens is None:
            num_draft_tokens = max_num_draft_tokens if free_drafts else 4
        return CostAwareDraftLength(
            num_draft_tokens=num_draft_tokens,
            max_num_draft_tokens=max_num_draft_tokens,
            measure_plain_step=not free_drafts,
            prior=prior,
            draft_seconds_per_token=draft_seconds,
        )
    if schedule == "heuristic":
        first = HeuristicDraftLength.num_draft_tokens if num_draft_tokens is None else num_draft_tokens
        return HeuristicDraftLength(num_draft_tokens=first, max_num_draft_tokens=max_num_draft_tokens)
    raise ValueError(
        f"num_draft_tokens_schedule must be one of {', '.join(NUM_DRAFT_TOKENS_SCHEDULES)}, got {schedule!r}"
    )
