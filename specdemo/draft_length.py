"""How many tokens to draft each round: fixed, HF's +2/-1 heuristic, or a cost-aware adaptive policy."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

logger = logging.getLogger(__name__)


class DraftLengthPolicy(Protocol):
    def next_length(self) -> int: ...

    def update(self, drafted: int, accepted: int, draft_seconds: float, verify_seconds: float) -> None: ...


@dataclass
class FixedDraftLength:
    """Always ask for k tokens."""

    k: int

    def next_length(self) -> int:
        return self.k

    def update(self, drafted: int, accepted: int, draft_seconds: float, verify_seconds: float) -> None:
        pass


@dataclass
class HeuristicDraftLength:
    """transformers' heuristic: +2 after a round where every draft token was accepted, -1 otherwise."""

    k: int = 5
    k_min: int = 1
    k_max: int = 16

    def next_length(self) -> int:
        return self.k

    def update(self, drafted: int, accepted: int, draft_seconds: float, verify_seconds: float) -> None:
        if drafted == 0:
            return
        self.k = min(self.k_max, self.k + 2) if accepted == drafted else max(self.k_min, self.k - 1)


class CostAwareDraftLength:
    """Pick the k that maximises expected tokens per second from measured costs and acceptance.

    Tokens per round with per-token acceptance a and k drafts: E(k) = (1 - a^(k+1)) / (1 - a) (Leviathan et al.).
    Cost of a round: k * t_draft + t_verify(k + 1), with t_verify measured per input length (interpolated where not
    yet measured) and t_draft the measured draft time per token. k = 0 is a plain target step, so when drafts keep
    being rejected the policy falls back to (nearly) plain decoding; it still probes a short draft now and then so
    that it notices when drafting starts to pay again. Acceptance is an exponentially weighted estimate.
    """

    def __init__(self, k_start: int = 4, k_max: int = 12, decay: float = 0.9, probe_every: int = 8) -> None:
        self.k_start = k_start
        self.k_max = k_max
        self.decay = decay
        self.probe_every = probe_every
        self._accepted = 0.0
        self._rejections = 0.0
        self._draft_time_per_token: float | None = None
        self._verify_time: dict[int, float] = {}  # verify input length -> EMA seconds
        self._rounds = 0
        self._rounds_since_draft = 0
        self.k = k_start

    @property
    def acceptance(self) -> float:
        """Estimated probability that one draft token is accepted (with a weak prior of 1 in 2)."""
        return (self._accepted + 1.0) / (self._accepted + self._rejections + 2.0)

    def _verify_cost(self, length: int) -> float:
        known = self._verify_time
        if length in known:
            return known[length]
        lengths = sorted(known)
        below = [n for n in lengths if n < length]
        above = [n for n in lengths if n > length]
        if below and above:
            lo, hi = below[-1], above[0]
            weight = (length - lo) / (hi - lo)
            return known[lo] * (1 - weight) + known[hi] * weight
        if len(lengths) >= 2 and below:
            lo, hi = lengths[-2], lengths[-1]
            slope = max(0.0, (known[hi] - known[lo]) / (hi - lo))
            return known[hi] + slope * (length - hi)
        nearest = below[-1] if below else above[0]
        return known[nearest]

    def next_length(self) -> int:
        self._rounds += 1
        if self._rounds == 1 or self._draft_time_per_token is None or not self._verify_time:
            return self.k_start
        if self._rounds == 2 and 1 not in self._verify_time:
            return 0  # measure a plain step once: the reference every other length is compared with
        alpha = min(self.acceptance, 0.999)
        reachable = max(self._verify_time) + 1  # explore at most two tokens beyond the longest measured verify
        best_k, best_rate = 0, 1.0 / self._verify_cost(1)
        for k in range(1, min(self.k_max, reachable) + 1):
            expected_tokens = (1.0 - alpha ** (k + 1)) / (1.0 - alpha)
            cost = k * self._draft_time_per_token + self._verify_cost(k + 1)
            if expected_tokens / cost > best_rate:
                best_k, best_rate = k, expected_tokens / cost
        if best_k == 0 and self._rounds_since_draft >= self.probe_every:
            best_k = 1
        self.k = best_k
        return best_k

    def update(self, drafted: int, accepted: int, draft_seconds: float, verify_seconds: float) -> None:
        length = drafted + 1
        previous = self._verify_time.get(length)
        self._verify_time[length] = verify_seconds if previous is None else 0.7 * previous + 0.3 * verify_seconds
        if drafted == 0:
            self._rounds_since_draft += 1
            return
        self._rounds_since_draft = 0
        per_token = draft_seconds / drafted
        previous_draft = self._draft_time_per_token
        self._draft_time_per_token = per_token if previous_draft is None else 0.7 * previous_draft + 0.3 * per_token
        self._accepted = self.decay * self._accepted + accepted
        self._rejections = self.decay * self._rejections + (1.0 if accepted < drafted else 0.0)


def make_policy(spec: int | str, k_max: int = 12) -> DraftLengthPolicy:
    """``spec``: an int k >= 1 (fixed), "adaptive" (cost-aware) or "heuristic" (+2/-1)."""
    if isinstance(spec, str):
        name = spec.strip().lower()
        if name == "adaptive":
            return CostAwareDraftLength(k_max=k_max)
        if name == "heuristic":
            return HeuristicDraftLength(k_max=k_max)
        if name.isdigit():
            spec = int(name)
        else:
            raise ValueError(f"draft length must be a number >= 1, 'adaptive' or 'heuristic', got {spec!r}")
    if spec < 1 or spec > 64:
        raise ValueError(f"draft length must be between 1 and 64, got {spec}")
    return FixedDraftLength(int(spec))
