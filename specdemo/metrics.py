"""Figures of a run: acceptance, accepted length, tokens/s, speedup, and the speedup the method allows.

Definitions (README, "Reading the figures"):
- acceptance rate = accepted draft tokens / drafted tokens;
- per-token acceptance alpha = accepted / (accepted + rounds with a rejection): the estimate of the probability
  that one draft token is accepted, the alpha of Leviathan et al.;
- mean accepted length = tokens produced per verification pass, bonus/corrected token included (vLLM's
  definition), so plain decoding has 1.0;
- expected speedup = E / (gamma * c + v) with E = (1 - alpha^(gamma+1)) / (1 - alpha) averaged over the run's
  rounds (each with its own draft length), gamma the mean draft length, c the draft cost per token and v the
  verify pass cost, both relative to one plain decoding step measured in the same run. With v = 1 this is Leviathan et al.'s formula; measuring v keeps it honest where a
  k-token pass costs more than a one-token pass (float32 on a CPU).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .engine import Counters


@dataclass(frozen=True)
class RunMetrics:
    new_tokens: int
    seconds: float
    tokens_per_s: float
    target_passes: int
    rounds: int
    drafted: int
    accepted: int
    acceptance_rate: float | None
    alpha: float | None
    mean_accepted_length: float | None
    mean_draft_length: float | None
    expected_tokens_per_round: float | None  # E(alpha, k) averaged over the rounds' draft lengths
    acceptance_by_position: list[float]
    prefill_seconds: float
    draft_seconds: float
    verify_seconds: float

    def as_dict(self) -> dict:
        return asdict(self)


def run_metrics(counters: Counters) -> RunMetrics:
    seconds = counters.seconds
    rounds = counters.rounds
    drafted, accepted = counters.drafted, counters.accepted
    alpha = None
    if drafted:
        alpha = accepted / (accepted + counters.rejection_rounds) if accepted + counters.rejection_rounds else 0.0
    return RunMetrics(
        new_tokens=counters.new_tokens,
        seconds=seconds,
        tokens_per_s=counters.new_tokens / seconds if seconds > 0 else 0.0,
        target_passes=counters.target_passes,
        rounds=rounds,
        drafted=drafted,
        accepted=accepted,
        acceptance_rate=accepted / drafted if drafted else None,
        alpha=alpha,
        mean_accepted_length=sum(counters.accepted_lengths) / rounds if rounds else None,
        mean_draft_length=drafted / rounds if rounds else None,
        expected_tokens_per_round=(
            sum(expected_tokens_per_pass(alpha, k) for k in counters.draft_lengths) / len(counters.draft_lengths)
            if alpha is not None and counters.draft_lengths
            else None
        ),
        acceptance_by_position=[a / d if d else 0.0 for a, d in zip(counters.accepted_at, counters.drafted_at)],
        prefill_seconds=counters.prefill_seconds,
        draft_seconds=counters.draft_seconds,
        verify_seconds=counters.verify_seconds,
    )


def expected_tokens_per_pass(alpha: float, gamma: float) -> float:
    """E = (1 - alpha^(gamma+1)) / (1 - alpha): expected tokens per verification with gamma drafts."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1.0)) / (1.0 - alpha)


def expected_speedup(alpha: float, gamma: float, draft_cost: float, verify_cost: float = 1.0) -> float:
    """Leviathan et al.'s expected walltime improvement, E / (gamma * c + v)."""
    return expected_tokens_per_pass(alpha, gamma) / (gamma * draft_cost + verify_cost)


@dataclass(frozen=True)
class Comparison:
    """A speculative run against the plain run of the same prompt and settings, measured together."""

    speedup: float | None
    draft_cost: float | None  # c: draft seconds per drafted token / plain seconds per step
    verify_cost: float | None  # v: seconds per verify pass / plain seconds per step
    expected_speedup: float | None
    fraction_of_expected: float | None

    def as_dict(self) -> dict:
        return asdict(self)


def compare(spec: RunMetrics, plain: RunMetrics) -> Comparison:
    speedup = spec.tokens_per_s / plain.tokens_per_s if plain.tokens_per_s > 0 and spec.tokens_per_s > 0 else None
    plain_step = plain.verify_seconds / plain.rounds if plain.rounds else None
    if not plain_step or not spec.rounds:
        return Comparison(speedup, None, None, None, None)
    verify_cost = (spec.verify_seconds / spec.rounds) / plain_step
    draft_cost = (spec.draft_seconds / spec.drafted) / plain_step if spec.drafted else 0.0
    gamma = spec.mean_draft_length or 0.0
    alpha = spec.alpha if spec.alpha is not None else 0.0
    tokens_per_round = spec.expected_tokens_per_round or expected_tokens_per_pass(alpha, gamma)
    expected = tokens_per_round / (gamma * draft_cost + verify_cost)
    fraction = speedup / expected if speedup is not None and expected > 0 else None
    return Comparison(speedup, draft_cost, verify_cost, expected, fraction)
