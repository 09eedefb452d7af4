"""Figures of a run: acceptance, accepted length, tokens/s, speedup, and the speedup the method allows.

Definitions (README, "Reading the figures"):
- acceptance rate = accepted draft tokens / drafted tokens;
- per-token acceptance alpha = accepted / (accepted + rounds with a rejection): the probability that one draft
  token is accepted if every position behaved alike, the alpha of Leviathan et al.;
- acceptance by position: how often a token drafted at position j was accepted; conditional acceptance at j: the
  same among rounds where every earlier position was accepted (so position j was actually checked);
- mean accepted length = tokens produced per verification pass, bonus/corrected token included (vLLM's
  definition), so plain decoding has 1.0;
- expected tokens per pass E(k) = 1 + sum over j <= k of the product of the conditional acceptances up to j
  (:func:`specdemo.core.economics.expected_tokens`). With one alpha for every position this is Leviathan et al.'s
  (1 - alpha^(k+1)) / (1 - alpha); per position it also fits drafters whose tokens stand or fall together (n-gram
  copies);
- expected decode speedup = E / (gamma * c + 1) (Leviathan et al.), E averaged over the run's rounds (each with its
  own draft length k), gamma the mean draft length, c the draft cost per token relative to one plain decoding step
  measured in the same run, and a verify pass counted as one plain step (the method's premise; the measured
  verify cost v is reported beside it);
- expected speedup = the same applied end to end: both sides also pay their measured prompt pass, which the
  measured speedup includes, so the two are comparable. measured / expected says how close a run came to what the
  method allows for its acceptance and draft cost;
- verify cost by pass size = the mean seconds of the run's target passes over n tokens (the last token and n - 1
  drafts), for each n that occurred, over the plain side's seconds per step: the cost curve as the run met it
  (context length, tree masks, hidden states and the machine's state of the moment included), beside the
  calibrated curve the drafter started from;
- decode speedup = the measured speedup after the target's prompt pass: tokens after the first per second of
  everything that followed that pass (the draft's own reading of the prompt included), speculative over plain.
  Both sides pay the same prompt pass, so where it is a large share of a run (long prompts, or prompt passes that
  are compute-bound, as int8 GEMMs without VNNI are) the end-to-end speedup is held down by it; this says what
  speculation did to the part it changes. The end-to-end speedup stays the headline figure.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from .economics import expected_tokens, expected_tokens_per_pass

if TYPE_CHECKING:
    from .events import Counters


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
    expected_tokens_per_round: float | None  # E(k) from the conditional acceptance, averaged over the rounds
    expected_tokens_per_round_iid: float | None  # Leviathan's E(alpha, k), averaged over the rounds
    acceptance_by_position: list[float]
    conditional_acceptance: list[float]
    prefill_seconds: float
    draft_seconds: float
    verify_seconds: float

    @property
    def seconds_per_round(self) -> float | None:
        """Seconds of verification per round: for plain decoding, the seconds of one step (None without rounds)."""
        return self.verify_seconds / self.rounds if self.rounds else None

    def as_dict(self) -> dict:
        return asdict(self)


def run_metrics(counters: Counters) -> RunMetrics:
    seconds = counters.seconds
    rounds = counters.rounds
    drafted, accepted = counters.drafted, counters.accepted
    alpha = None
    if drafted:
        alpha = accepted / (accepted + counters.rejection_rounds) if accepted + counters.rejection_rounds else 0.0
    conditional = [a / t if t else 0.0 for a, t in zip(counters.accepted_at, counters.tested_at)]
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
            sum(expected_tokens(conditional, k) for k in counters.draft_lengths) / len(counters.draft_lengths)
            if drafted and counters.draft_lengths
            else None
        ),
        expected_tokens_per_round_iid=(
            sum(expected_tokens_per_pass(alpha, k) for k in counters.draft_lengths) / len(counters.draft_lengths)
            if alpha is not None and counters.draft_lengths
            else None
        ),
        acceptance_by_position=[a / d if d else 0.0 for a, d in zip(counters.accepted_at, counters.drafted_at)],
        conditional_acceptance=conditional,
        prefill_seconds=counters.prefill_seconds,
        draft_seconds=counters.draft_seconds,
        verify_seconds=counters.verify_seconds,
    )


@dataclass(frozen=True)
class Comparison:
    """A speculative run against the plain run of the same prompt and settings, measured together."""

    speedup: float | None
    draft_cost: float | None  # c: draft seconds per drafted token / plain seconds per step
    verify_cost: float | None  # v: seconds per verify pass / plain seconds per step (reported, not assumed)
    expected_decode_speedup: float | None  # E / (gamma c + 1), E from the conditional acceptance
    expected_decode_speedup_iid: float | None  # the same with Leviathan's single alpha
    expected_speedup: float | None  # E / (gamma c + 1) end to end: each side's prompt pass included
    fraction_of_expected: float | None  # speedup / expected_speedup
    decode_speedup: float | None = None  # measured, after the target's prompt pass (see decode_speedup())
    prefill_share: float | None = None  # the plain side's prompt pass / its whole time

    def as_dict(self) -> dict:
        return asdict(self)


def verify_cost_by_size(counters: Counters, plain_step: float | None) -> dict[int, tuple[float, int]]:
    """Per number of tokens in a verify pass (the last token and the draft): (mean seconds of those passes over
    ``plain_step``, the seconds of one plain decoding step, and how many passes there were); empty without a plain
    step or timed rounds."""
    if not plain_step or plain_step <= 0:
        return {}
    seconds: dict[int, list[float]] = {}
    for drafted, pass_seconds in zip(counters.draft_lengths, counters.verify_seconds_by_round):
        seconds.setdefault(drafted + 1, []).append(pass_seconds)
    return {size: (sum(times) / len(times) / plain_step, len(times)) for size, times in sorted(seconds.items())}


def decode_rate(new_tokens: int, seconds: float, prefill_seconds: float, runs: int = 1) -> float | None:
    """Tokens per second after the prompt's pass, over ``runs`` runs whose totals are given: each run's first token
    comes from its prompt pass, so it is left out (None when nothing followed the prompt passes)."""
    decode_seconds = seconds - prefill_seconds
    return (new_tokens - runs) / decode_seconds if new_tokens > runs and decode_seconds > 0 else None


def decode_speedup(spec_rate: float | None, plain_rate: float | None) -> float | None:
    """Speculative over plain decode rates (:func:`decode_rate`)."""
    return spec_rate / plain_rate if spec_rate and plain_rate else None


def compare(spec: RunMetrics, plain: RunMetrics) -> Comparison:
    speedup = spec.tokens_per_s / plain.tokens_per_s if plain.tokens_per_s > 0 and spec.tokens_per_s > 0 else None
    decode = decode_speedup(
        decode_rate(spec.new_tokens, spec.seconds, spec.prefill_seconds),
        decode_rate(plain.new_tokens, plain.seconds, plain.prefill_seconds),
    )
    prefill_share = plain.prefill_seconds / plain.seconds if plain.seconds > 0 else None
    plain_step = plain.seconds_per_round
    if not plain_step or not spec.rounds:
        return Comparison(speedup, None, None, None, None, None, None, decode, prefill_share)
    verify_cost = spec.seconds_per_round / plain_step
    draft_cost = (spec.draft_seconds / spec.drafted) / plain_step if spec.drafted else 0.0
    gamma = spec.mean_draft_length or 0.0
    round_cost = gamma * draft_cost + 1.0
    tokens_per_round = spec.expected_tokens_per_round or 1.0
    # None only when nothing was drafted: E(alpha, 0) = 1
    tokens_per_round_iid = spec.expected_tokens_per_round_iid or 1.0
    expected_decode = tokens_per_round / round_cost
    expected_decode_iid = tokens_per_round_iid / round_cost
    # end to end: the first token comes from the prompt pass on both sides, the rest from decoding
    expected_seconds = spec.prefill_seconds + (spec.new_tokens - 1) / tokens_per_round * round_cost * plain_step
    expected = None
    if expected_seconds > 0 and plain.tokens_per_s > 0:
        expected = (spec.new_tokens / expected_seconds) / plain.tokens_per_s
    fraction = speedup / expected if speedup is not None and expected else None
    return Comparison(
        speedup, draft_cost, verify_cost, expected_decode, expected_decode_iid, expected, fraction, decode, prefill_share
    )
