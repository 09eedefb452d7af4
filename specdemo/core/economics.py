"""The economics of speculative decoding, in one place: what a round is expected to write, what a pass costs on a
machine (its measured cost curve), the acceptance that breaks even, and whether speculation can pay at all.

Data and arithmetic only (no torch): :mod:`specdemo.session.calibration` measures the curves, the draft-length
policies (:mod:`specdemo.methods.draft_length`) decide with them, :mod:`specdemo.core.metrics` reports with them.

The one formula: with ``acceptance_at[j]`` the probability that draft position j is accepted given that every
earlier one was, a round of k drafts writes E(k) = 1 + sum over j <= k of the product of the first j of them
(the target's own token always comes on top). With one alpha at every position this is Leviathan et al.'s
(1 - alpha^(k+1)) / (1 - alpha).
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Sequence

logger = logging.getLogger(__name__)

#: bump when the measurement (or what it measures: a format's kernels) changes, so old cached curves are measured
#: again; 2: the int8 format's attention shares calls between the queries of a pass; 3: the memory bandwidth and the
#: weights' bytes (the floor of a pass) measured beside the passes
CALIBRATION_VERSION = 3

#: "speculation can pay": a drafter right 80 % of the time beats plain decoding by 10 % at some draft length (the
#: format choice asks it of a free drafter on a calibrated curve, the adaptive policy of the costs it measured)
PAYING_ACCEPTANCE = 0.8
PAYING_SPEEDUP = 1.1


def expected_tokens(acceptance_at: Sequence[float], num_draft_tokens: int) -> float:
    """Expected tokens from one verify pass with ``num_draft_tokens`` drafts: 1 + sum over j <= k of P(the first j
    drafts accepted).

    ``acceptance_at[j]`` is the probability that draft position j (0-based) is accepted given that every earlier
    one was; positions past the end of the list reuse its last value. With the same value alpha at every position
    this is Leviathan et al.'s E = (1 - alpha^(k+1)) / (1 - alpha); per-position values also fit drafters whose
    tokens stand or fall together (an n-gram copy is usually accepted whole or rejected at its first token).
    """
    total, survive = 1.0, 1.0
    for j in range(num_draft_tokens):
        if not acceptance_at:
            break
        survive *= acceptance_at[min(j, len(acceptance_at) - 1)]
        total += survive
    return total


def expected_tokens_per_pass(alpha: float, num_draft_tokens: int) -> float:
    """:func:`expected_tokens` with the same acceptance ``alpha`` at every position: (1 - alpha^(k+1)) / (1 - alpha)."""
    return expected_tokens([alpha], num_draft_tokens)


def expected_speedup(alpha: float, num_draft_tokens: int, draft_cost: float, verify_cost: float = 1.0) -> float:
    """Leviathan et al.'s expected walltime improvement, E / (k * c + v): draft cost c and verify cost v in plain
    steps."""
    return expected_tokens_per_pass(alpha, num_draft_tokens) / (num_draft_tokens * draft_cost + verify_cost)


def break_even_acceptance(num_draft_tokens: int, round_cost: float) -> float | None:
    """The acceptance rate alpha at which a round of ``num_draft_tokens`` drafts costing ``round_cost`` plain steps
    writes tokens as fast as plain decoding (expected tokens per round equal to its cost); 0 when a round costs no
    more than a plain step, None when no alpha can pay (even k + 1 tokens per round do not cover the cost)."""
    if round_cost <= 1.0 + 1e-9:  # a round costs no more than a plain step: any acceptance pays
        return 0.0
    if num_draft_tokens + 1 <= round_cost:
        return None
    low, high = 0.0, 1.0
    for _ in range(60):
        alpha = (low + high) / 2
        expected = expected_tokens_per_pass(alpha, num_draft_tokens)
        low, high = (alpha, high) if expected < round_cost else (low, alpha)
    return (low + high) / 2


def best_speedup(round_cost: Callable[[int], float], lengths: Iterable[int], acceptance: float) -> float:
    """The speedup over plain decoding at the best of the draft ``lengths``, every draft accepted with probability
    ``acceptance``: expected tokens per round over ``round_cost(k)`` (a round in plain steps); 0 for no length."""
    return max((expected_tokens([acceptance], k) / round_cost(k) for k in lengths), default=0.0)


def can_pay(
    round_cost: Callable[[int], float],
    lengths: Iterable[int],
    acceptance: float = PAYING_ACCEPTANCE,
    margin: float = PAYING_SPEEDUP,
) -> bool:
    """Whether some draft length among ``lengths`` beats plain decoding by ``margin`` at ``acceptance``."""
    return best_speedup(round_cost, lengths, acceptance) >= margin


@dataclass(frozen=True)
class Hardware:
    """The machine a curve was measured on: the CPU's model and relevant instruction sets, or the GPU's name."""

    device: str
    name: str
    flags: tuple[str, ...] = ()
    threads: int = 1
    torch: str = ""
    #: the instruction set torch's own kernels dispatch to (``ATEN_CPU_CAPABILITY`` can lower it), and oneDNN's
    #: limit when ``ONEDNN_MAX_CPU_ISA`` sets one: how a machine of another class is imitated on this one
    kernels: str = ""

    @property
    def native_bfloat16(self) -> bool | None:
        """Whether bfloat16 arithmetic is native here (a GPU, or a CPU with AVX512-BF16 or AMX); None: unknown."""
        if self.device != "cpu":
            return True
        if not self.flags:
            return None
        return bool({"avx512_bf16", "amx_bf16"} & set(self.flags))

    def describe(self) -> str:
        if self.device != "cpu":
            return f"{self.name} ({self.device})"
        flags = ", ".join(self.flags) if self.flags else "instruction sets unknown"
        kernels = f"; kernels {self.kernels}" if self.kernels else ""
        return f"{self.name}, {self.threads} threads ({flags}{kernels})"


#: a pass over more tokens may come out cheaper than a pass over fewer by at most this share (timer noise); beyond
#: it the machine was busy while it was measured
MONOTONE_TOLERANCE = 0.2
#: the plain steps of a run may cost from half to twice a cached curve's one-token pass; beyond, the curve is stale
STALE_RATIO = 2.0


def curve_problem(lengths: Sequence[int], seconds: Sequence[float], tolerance: float = MONOTONE_TOLERANCE) -> str | None:
    """Why a measured curve cannot be trusted (a pass over more tokens cheaper than one over fewer, beyond
    ``tolerance``), or None."""
    for index in range(1, len(seconds)):
        dearest = max(range(index), key=lambda i: seconds[i])
        if seconds[index] < seconds[dearest] * (1.0 - tolerance):
            return (f"a pass over {lengths[index]} tokens measured {seconds[index] / seconds[dearest]:.2f} of one over "
                    f"{lengths[dearest]}: the machine was busy while it was measured")
    if any(not s > 0 for s in seconds):
        return "a pass measured no time"
    return None


@dataclass
class CostCurve:
    """Seconds of one target pass over k new tokens after ``prefix_tokens`` cached ones (medians).

    ``problem`` says why the curve cannot be trusted (measured on a busy machine; such a curve serves one run and is
    never cached); ``cache_file`` is where it was read from or written to (None: nowhere)."""

    hardware: Hardware
    target: str
    dtype: str
    prefix_tokens: int
    lengths: list[int]
    seconds: list[float]
    #: seconds of one draft-model step (one token) as the drafter runs it; None: no draft model measured
    draft_seconds_per_token: float | None = None
    draft: str | None = None
    measured_seconds: float = 0.0  # how long the calibration took
    measured_at: str = ""
    version: int = CALIBRATION_VERSION
    problem: str | None = None
    #: bytes of weights a pass reads (the target in this format; None: not known)
    weight_bytes: int | None = None
    #: bytes a copy of a buffer larger than the caches moved per second, read and written (None: not measured)
    bandwidth_bytes_per_s: float | None = None
    #: set when the curve is an estimate from the first layers of the real weights ("4 of 28"): see
    #: :mod:`specdemo.session.format_probe`; None: measured on the whole model
    measured_layers: str | None = None
    from_cache: bool = field(default=False, compare=False)
    cache_file: str | None = field(default=None, compare=False)

    @property
    def reliable(self) -> bool:
        return self.problem is None

    def contradicted_by(self, plain_step_seconds: float) -> str | None:
        """Why a run's plain steps (seconds each, median or mean) say this curve is stale: a one-token pass measured
        at half or twice the curve's. None when they agree."""
        ratio = plain_step_seconds / self.seconds[0] if self.seconds[0] > 0 else float("inf")
        if 1.0 / STALE_RATIO <= ratio <= STALE_RATIO:
            return None
        return (f"plain steps took {plain_step_seconds * 1000:.0f} ms, the cost curve says {self.seconds[0] * 1000:.0f} "
                f"ms ({ratio:.2f}x)")

    def cost(self, num_tokens: float) -> float:
        """A pass over ``num_tokens`` new tokens in one-token passes (log-log interpolation between the measured
        lengths, linear extrapolation past the longest)."""
        base = self.seconds[0]
        if num_tokens <= self.lengths[0]:
            return 1.0
        for (k0, s0), (k1, s1) in zip(zip(self.lengths, self.seconds), zip(self.lengths[1:], self.seconds[1:])):
            if num_tokens <= k1:
                share = (math.log(num_tokens) - math.log(k0)) / (math.log(k1) - math.log(k0))
                return math.exp(math.log(s0) + share * (math.log(s1) - math.log(s0))) / base
        k_last, s_last = self.lengths[-1], self.seconds[-1]
        return s_last * num_tokens / k_last / base

    @property
    def floor_seconds(self) -> float | None:
        """The least a one-token pass can take: its weights' bytes read at the measured memory bandwidth."""
        if not self.weight_bytes or not self.bandwidth_bytes_per_s:
            return None
        return self.weight_bytes / self.bandwidth_bytes_per_s

    def describe_floor(self) -> str | None:
        """A one-token pass beside its floor, in one line (None when either is unknown)."""
        floor = self.floor_seconds
        if floor is None:
            return None
        return (f"a one-token pass reads {self.weight_bytes / 1e9:.2f} GB of weights; at the measured memory bandwidth "
                f"({self.bandwidth_bytes_per_s / 1e9:.1f} GB/s, a copy) that takes at least {floor * 1000:.0f} ms: "
                f"measured {self.seconds[0] * 1000:.0f} ms, {self.seconds[0] / floor:.1f}x the floor")

    @property
    def relative(self) -> list[float]:
        """Each measured pass in one-token passes (1.0 first)."""
        return [s / self.seconds[0] for s in self.seconds]

    @property
    def draft_cost(self) -> float:
        """One draft step in one-token target passes (0 for a drafter that costs nothing, like n-gram lookup)."""
        if self.draft_seconds_per_token is None:
            return 0.0
        return self.draft_seconds_per_token / self.seconds[0]

    def round_cost(self, num_draft_tokens: int, draft_cost: float | None = None) -> float:
        """A round of ``num_draft_tokens`` drafts, in one-token passes: the drafting plus the verify pass over the
        last token and the drafts."""
        per_draft = self.draft_cost if draft_cost is None else draft_cost
        return num_draft_tokens * per_draft + self.cost(num_draft_tokens + 1)

    def break_even_acceptance(self, num_draft_tokens: int, draft_cost: float | None = None) -> float | None:
        """The acceptance rate at which a round of ``num_draft_tokens`` drafts writes tokens as fast as plain
        decoding on this curve (see :func:`break_even_acceptance`)."""
        return break_even_acceptance(num_draft_tokens, self.round_cost(num_draft_tokens, draft_cost))

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["hardware"]["flags"] = list(self.hardware.flags)
        data.pop("from_cache")
        data.pop("cache_file")
        data["relative"] = self.relative
        data["floor_seconds"] = self.floor_seconds
        data["draft_cost"] = self.draft_cost
        data["break_even_acceptance"] = {
            str(k): self.break_even_acceptance(k) for k in range(1, self.lengths[-1] + 1)
        }
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CostCurve":
        hardware = dict(data["hardware"])
        hardware["flags"] = tuple(hardware.get("flags", ()))
        names = {f for f in cls.__dataclass_fields__ if f not in ("hardware", "from_cache", "cache_file")}
        return cls(hardware=Hardware(**hardware), **{k: v for k, v in data.items() if k in names})

    def summary(self) -> str:
        """One line per fact, for the bench header and logs."""
        passes = ", ".join(f"k={k}: {r:.2f}" for k, r in zip(self.lengths, self.relative))
        paying = [k for k in range(1, self.lengths[-1] + 1) if self.break_even_acceptance(k) is not None]
        lines = [
            f"machine: {self.hardware.describe()}",
            *([f"UNRELIABLE cost curve, for this run only (not cached): {self.problem}"] if self.problem else []),
            f"target pass ({self.target}, {self.dtype}): {self.seconds[0] * 1000:.0f} ms for one token; "
            f"a pass over k tokens costs, in one-token passes: {passes}",
        ]
        floor = self.describe_floor()
        if floor is not None:
            lines.append(f"floor: {floor}")
        if self.draft_seconds_per_token is not None:
            lines.append(f"draft step ({self.draft}): {self.draft_seconds_per_token * 1000:.1f} ms "
                         f"= {self.draft_cost:.2f} target passes")
        if paying:
            where = f"k = 1..{max(paying)}" if paying == list(range(1, max(paying) + 1)) else f"k in {paying}"
            needed = ", ".join(f"k={k}: {self.break_even_acceptance(k):.0%}" for k in (1, 2, 4, 8) if k in paying)
            lines.append(f"speculation can pay for {where}; acceptance needed to break even: {needed}")
        else:
            lines.append("speculation cannot pay here with this draft: a verify pass costs more than it can write")
        return "\n".join(lines)


def free_drafter_speedup(curve: CostCurve, acceptance: float = PAYING_ACCEPTANCE) -> float:
    """A free drafter's (n-gram lookup's) speedup over plain decoding at ``acceptance``, at its best draft length
    on ``curve`` (verify passes no longer than the longest measured)."""
    return best_speedup(lambda k: curve.round_cost(k, 0.0), range(1, curve.lengths[-1]), acceptance)


def speculation_can_pay(
    curve: CostCurve, acceptance: float = PAYING_ACCEPTANCE, margin: float = PAYING_SPEEDUP
) -> bool:
    """Whether some draft length lets a free drafter (n-gram lookup) at ``acceptance`` beat plain decoding by
    ``margin`` on this curve."""
    return free_drafter_speedup(curve, acceptance) >= margin


def speculative_seconds_per_token(curve: CostCurve, acceptance: float = PAYING_ACCEPTANCE) -> float:
    """Seconds per token a free drafter right ``acceptance`` of the time reaches on this curve at its best draft
    length (plain decoding when no length beats it)."""
    return curve.seconds[0] / max(free_drafter_speedup(curve, acceptance), 1.0)
