"""How many tokens to draft each round: fixed, HF's +2/-1 heuristic, or a cost-aware adaptive policy."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, Sequence

if TYPE_CHECKING:
    from .calibration import CostCurve

logger = logging.getLogger(__name__)


class DraftLengthPolicy(Protocol):
    def next_length(self) -> int: ...

    def update(
        self, drafted: int, accepted: int, draft_seconds: float, verify_seconds: float, catch_up_seconds: float = 0.0
    ) -> None: ...


@dataclass
class FixedDraftLength:
    """Always ask for k tokens."""

    k: int

    def next_length(self) -> int:
        return self.k

    def update(
        self, drafted: int, accepted: int, draft_seconds: float, verify_seconds: float, catch_up_seconds: float = 0.0
    ) -> None:
        pass


@dataclass
class HeuristicDraftLength:
    """transformers' heuristic: +2 after a round where every draft token was accepted, -1 otherwise."""

    k: int = 5
    k_min: int = 1
    k_max: int = 16

    def next_length(self) -> int:
        return self.k

    def update(
        self, drafted: int, accepted: int, draft_seconds: float, verify_seconds: float, catch_up_seconds: float = 0.0
    ) -> None:
        if drafted == 0:
            return
        self.k = min(self.k_max, self.k + 2) if accepted == drafted else max(self.k_min, self.k - 1)


def expected_tokens(acceptance_at: Sequence[float], k: int) -> float:
    """Expected tokens from one verify pass with k drafts: 1 + sum over j <= k of P(the first j drafts accepted).

    ``acceptance_at[j]`` is the probability that draft position j (0-based) is accepted given that every earlier
    one was; positions past the end of the list reuse its last value. With the same value alpha at every position
    this is Leviathan et al.'s E = (1 - alpha^(k+1)) / (1 - alpha); per-position values also fit drafters whose
    tokens stand or fall together (an n-gram copy is usually accepted whole or rejected at its first token).
    """
    total, survive = 1.0, 1.0
    for j in range(k):
        if not acceptance_at:
            break
        survive *= acceptance_at[min(j, len(acceptance_at) - 1)]
        total += survive
    return total


class CostAwareDraftLength:
    """Pick the k that maximises expected tokens per second from measured costs and acceptance.

    Tokens per round with k drafts: E(k) = 1 + sum_j P(first j accepted), from a per-position acceptance estimate
    (see :func:`expected_tokens`). Cost of a round: k * t_draft + t_verify(k + 1), with t_verify fitted to the verify
    passes measured so far (see :meth:`_verify_cost`) and t_draft the
    measured draft time per token. k = 0 is a plain target step, so when drafts keep being rejected the policy falls
    back to (nearly) plain decoding; it still probes a one-token draft now and then so that it notices when drafting
    starts to pay again: after ``probe_every`` plain steps, and twice as many after each probe that was rejected (up
    to ``max_probe_every``), since a probe costs a draft step plus whatever the drafter must catch up on. Acceptance
    estimates are exponentially weighted, so the policy follows the text.

    ``prior``: the machine's measured cost curve (:mod:`specdemo.calibration`): its verify costs (and
    ``draft_seconds_per_token``) count as one measurement each, so the first decisions rest on this machine's costs
    rather than on nothing. The time a drafter spends catching up on text written during plain steps is no cost per
    drafted token: the engine books it apart (``catch_up_seconds``, from ``Proposal.catch_up_seconds``), so a probe
    after a run of plain steps does not make drafting look dearer than it is.
    """

    def __init__(
        self,
        k_start: int = 4,
        k_max: int = 12,
        decay: float = 0.9,
        probe_every: int = 8,
        measure_plain_step: bool = True,
        max_probe_every: int = 64,
        prior: "CostCurve | None" = None,
        draft_seconds_per_token: float | None = None,
    ) -> None:
        self.k_start = min(k_start, k_max)
        self.measure_plain_step = measure_plain_step
        self.k_max = k_max
        self.decay = decay
        self.probe_every = probe_every
        self.max_probe_every = max(probe_every, max_probe_every)
        self._probe_interval = probe_every  # plain steps before the next probe
        self._probing = False
        self._accepted = 0.0
        self._rejections = 0.0
        self._tested_at = [0.0] * k_max  # per draft position: (weighted) rounds in which it was checked
        self._passed_at = [0.0] * k_max  # ... and accepted
        self._draft_time_per_token: float | None = None
        self._verify_time: dict[int, float] = {}  # verify input length -> EMA seconds
        self._verify_samples: dict[int, float] = {}  # verify input length -> weight of its measurements (capped)
        self._rounds = 0
        self._rounds_since_draft = 0
        self.k = self.k_start
        if prior is not None:
            for length, seconds in zip(prior.lengths, prior.seconds):
                if length <= k_max + 1:
                    self._verify_time[length] = seconds
                    self._verify_samples[length] = 1.0
            self._draft_time_per_token = draft_seconds_per_token

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
        a step more). Longer passes follow a straight line fitted by weighted least squares, so one noisy
        measurement cannot make a length look much dearer or cheaper than its neighbours.
        """
        known = self._verify_time
        if length == 1:
            return known[1] if 1 in known else min(known.values())  # not measured yet: no cheaper than any verify
        points = [(n, t, self._verify_samples[n]) for n, t in known.items() if n >= 2]
        if not points:
            return known[1]  # only a plain step measured so far: assume verification costs as much
        weight = sum(w for _, _, w in points)
        mean_n = sum(n * w for n, _, w in points) / weight
        mean_t = sum(t * w for _, t, w in points) / weight
        spread = sum(w * (n - mean_n) ** 2 for n, _, w in points)
        slope = sum(w * (n - mean_n) * (t - mean_t) for n, t, w in points) / spread if spread > 0 else 0.0
        slope = max(0.0, slope)
        return max(1e-9, mean_t + slope * (length - mean_n))

    def next_length(self) -> int:
        self._rounds += 1
        if self._rounds == 1 or self._draft_time_per_token is None or not self._verify_time:
            return self.k_start
        if self._rounds == 2 and self.measure_plain_step and 1 not in self._verify_time:
            return 0  # measure a plain step once: the reference every other length is compared with
        acceptance_at = self.acceptance_at()
        # explore at most twice the longest measured verify: longer ones are extrapolated from measured costs
        reachable = 2 * max(self._verify_time)
        best_k, best_rate = 0, 1.0 / self._verify_cost(1)
        for k in range(1, min(self.k_max, reachable) + 1):
            cost = k * self._draft_time_per_token + self._verify_cost(k + 1)
            rate = expected_tokens(acceptance_at, k) / cost
            if rate > best_rate:
                best_k, best_rate = k, rate
        self._probing = best_k == 0 and self._rounds_since_draft >= self._probe_interval
        if self._probing:
            best_k = 1
        self.k = best_k
        return best_k

    def update(
        self, drafted: int, accepted: int, draft_seconds: float, verify_seconds: float, catch_up_seconds: float = 0.0
    ) -> None:
        length = drafted + 1
        previous = self._verify_time.get(length)
        self._verify_time[length] = verify_seconds if previous is None else 0.7 * previous + 0.3 * verify_seconds
        self._verify_samples[length] = min(self._verify_samples.get(length, 0.0) + 1.0, 5.0)
        if drafted == 0:
            self._rounds_since_draft += 1
            return
        self._rounds_since_draft = 0
        if accepted > 0:
            self._probe_interval = self.probe_every
        elif self._probing:
            self._probe_interval = min(2 * self._probe_interval, self.max_probe_every)
        self._probing = False
        per_token = draft_seconds / drafted
        previous_draft = self._draft_time_per_token
        self._draft_time_per_token = per_token if previous_draft is None else 0.7 * previous_draft + 0.3 * per_token
        self._accepted = self.decay * self._accepted + accepted
        self._rejections = self.decay * self._rejections + (1.0 if accepted < drafted else 0.0)
        for position in range(self.k_max):
            self._tested_at[position] *= self.decay
            self._passed_at[position] *= self.decay
        for position in range(min(drafted, accepted + 1, self.k_max)):
            self._tested_at[position] += 1.0
            if position < accepted:
                self._passed_at[position] += 1.0


class TreeBudget(CostAwareDraftLength):
    """A node budget for token trees: always ``k_max`` nodes at most, and the verify cost model of the adaptive
    policy (measured passes fitted on top of the calibrated curve) for the drafter, which sizes each tree itself
    from its candidates' probabilities (see :class:`specdemo.medusa.MedusaDrafter`)."""

    def next_length(self) -> int:
        self._rounds += 1
        return self.k_max

    def verify_cost(self, length: int) -> float:
        """Seconds of a verify pass over ``length`` tokens (a guess of 1 s per pass before any measurement)."""
        if not self._verify_time:
            return 1.0
        return self._verify_cost(length)


def make_policy(
    spec: int | str, k_max: int = 12, free_drafts: bool = False, prior: "CostCurve | None" = None
) -> DraftLengthPolicy:
    """``spec``: an int k >= 1 (fixed), "adaptive" (cost-aware) or "heuristic" (+2/-1).

    ``free_drafts``: drafting costs next to nothing (n-gram lookup), so the adaptive policy starts at its longest
    draft instead of ramping up to it, and takes its plain-step cost from the rounds with no draft (there are always
    some) instead of spending a round on measuring it; measured verify costs bring k down where long passes cost
    more. ``prior``: the machine's cost curve, which the adaptive policy's estimates start from (its draft step only
    for a draft-model drafter; free drafts learn their tiny cost from the first round).
    """
    if isinstance(spec, str):
        name = spec.strip().lower()
        if name == "adaptive":
            draft_seconds = prior.draft_seconds_per_token if prior is not None and not free_drafts else None
            return CostAwareDraftLength(
                k_start=k_max if free_drafts else 4,
                k_max=k_max,
                measure_plain_step=not free_drafts,
                prior=prior,
                draft_seconds_per_token=draft_seconds,
            )
        if name == "heuristic":
            return HeuristicDraftLength(k_max=k_max)
        if name.isdigit():
            spec = int(name)
        else:
            raise ValueError(f"draft length must be a number >= 1, 'adaptive' or 'heuristic', got {spec!r}")
    if spec < 1 or spec > 64:
        raise ValueError(f"draft length must be between 1 and 64, got {spec}")
    return FixedDraftLength(int(spec))
