"""Metric definitions."""

import pytest

from specdemo.core import economics
from specdemo.core.economics import (
    expected_speedup,
    expected_tokens,
    expected_tokens_per_pass,
)
from specdemo.core.events import Counters
from specdemo.core.metrics import compare, decode_rate, run_metrics, verify_cost_by_size


def test_leviathan_formula():
    assert expected_tokens_per_pass(0.0, 4) == pytest.approx(1.0)
    assert expected_tokens_per_pass(1.0, 4) == pytest.approx(5.0)
    assert expected_tokens_per_pass(0.8, 4) == pytest.approx((1 - 0.8**5) / 0.2)
    assert expected_speedup(0.8, 4, 0.1) == pytest.approx(((1 - 0.8**5) / 0.2) / 1.4)


def _counters(rounds):
    counters = Counters(prefill_seconds=0.1, target_passes=1, new_tokens=1)
    for drafted, accepted in rounds:
        produced = accepted + 1
        counters.observe(drafted, accepted)
        counters.new_tokens += produced
    return counters


def test_run_metrics_definitions():
    counters = _counters([(4, 4), (4, 1), (4, 0), (0, 0)])
    counters.draft_seconds, counters.verify_seconds = 0.4, 0.8
    metrics = run_metrics(counters)
    assert metrics.acceptance_rate == pytest.approx(5 / 12)
    assert metrics.alpha == pytest.approx(5 / (5 + 2))  # two rounds ended in a rejection
    assert metrics.mean_accepted_length == pytest.approx((5 + 2 + 1 + 1) / 4)
    assert metrics.acceptance_by_position == pytest.approx([2 / 3, 1 / 3, 1 / 3, 1 / 3])
    assert metrics.target_passes == 5
    assert metrics.tokens_per_s == pytest.approx(counters.new_tokens / 1.3)
    # position j checked only when every earlier one was accepted: 2 of 3, 1 of 2, 1 of 1, 1 of 1
    assert metrics.conditional_acceptance == pytest.approx([2 / 3, 1 / 2, 1.0, 1.0])
    # with one draft length for every round, the per-position E is the mean accepted length itself
    assert metrics.expected_tokens_per_round == pytest.approx(metrics.mean_accepted_length)
    alpha = 5 / 7
    per_round = [expected_tokens_per_pass(alpha, k) for k in (4, 4, 4, 0)]
    assert metrics.expected_tokens_per_round_iid == pytest.approx(sum(per_round) / 4)


def test_verify_cost_by_size_reads_each_pass_by_its_tokens():
    counters = Counters()
    for drafted, seconds in [(3, 0.12), (0, 0.1), (3, 0.14), (1, 0.11)]:  # passes over 4, 1, 4 and 2 tokens
        counters.observe(drafted, 0, verify_seconds=seconds)
    assert counters.verify_seconds == pytest.approx(0.47)
    costs = verify_cost_by_size(counters, plain_step=0.1)
    assert list(costs) == [1, 2, 4]  # sizes in order
    assert costs[1] == pytest.approx((1.0, 1)) and costs[2] == pytest.approx((1.1, 1))
    assert costs[4] == pytest.approx((1.3, 2))  # the mean of its passes
    assert verify_cost_by_size(counters, plain_step=None) == {}
    # added up over runs, and kept by a snapshot
    total = Counters.total([counters, counters.snapshot()])
    assert verify_cost_by_size(total, 0.1)[4] == pytest.approx((1.3, 4))
    counters.observe(0, 0, verify_seconds=0.1)
    assert len(total.verify_seconds_by_round) == 8


def test_expected_tokens_reduces_to_leviathan():
    for alpha in (0.0, 0.3, 0.8, 0.99):
        for k in (0, 1, 4, 9):
            assert expected_tokens([alpha] * 3, k) == pytest.approx(expected_tokens_per_pass(alpha, k))
    # all-or-nothing drafts (an n-gram copy): a low first position, then near-certain ones
    assert expected_tokens([0.5, 0.95, 0.95], 3) == pytest.approx(1 + 0.5 + 0.5 * 0.95 + 0.5 * 0.95**2)


def test_compare_against_plain():
    plain = _counters([(0, 0)] * 9)
    plain.verify_seconds = 0.9  # 0.1 s per plain step
    spec = _counters([(4, 4), (4, 4)])
    spec.draft_seconds, spec.verify_seconds = 0.08, 0.2  # c = 0.01 / 0.1, v = 0.1 / 0.1
    comparison = compare(run_metrics(spec), run_metrics(plain))
    assert comparison.draft_cost == pytest.approx(0.1)
    assert comparison.verify_cost == pytest.approx(1.0)
    assert comparison.expected_decode_speedup == pytest.approx(5.0 / 1.4)
    assert comparison.expected_decode_speedup_iid == pytest.approx(5.0 / 1.4)
    # end to end: 0.1 s prompt pass + 10 decoded tokens at 5 per round, each round 1.4 plain steps of 0.1 s
    spec_rate = 11 / (0.1 + 10 / 5 * 1.4 * 0.1)
    assert comparison.expected_speedup == pytest.approx(spec_rate / (10 / 1.0))
    assert comparison.fraction_of_expected == pytest.approx(comparison.speedup / comparison.expected_speedup)
    assert comparison.speedup == pytest.approx(run_metrics(spec).tokens_per_s / run_metrics(plain).tokens_per_s)
    # after the prompt pass (0.1 s on each side): 9 tokens in 0.9 s against 10 in 0.28 s
    assert comparison.decode_speedup == pytest.approx((10 / 0.28) / (9 / 0.9))
    assert comparison.prefill_share == pytest.approx(0.1 / 1.0)


def test_a_long_prompt_pass_holds_the_end_to_end_speedup_down_but_not_the_decode_speedup():
    plain = _counters([(0, 0)] * 9)
    spec = _counters([(4, 4), (4, 4)])
    plain.verify_seconds, spec.verify_seconds = 0.9, 0.3  # decoding 3x faster
    short = compare(run_metrics(spec), run_metrics(plain))
    plain.prefill_seconds = spec.prefill_seconds = 2.0  # the same long prompt on both sides
    long = compare(run_metrics(spec), run_metrics(plain))
    assert short.decode_speedup == pytest.approx(long.decode_speedup) == pytest.approx((10 / 0.3) / (9 / 0.9))
    assert long.speedup < short.speedup < short.decode_speedup
    assert long.prefill_share == pytest.approx(2.0 / 2.9)


def test_decode_rate_leaves_each_runs_first_token_out():
    assert decode_rate(11, 1.1, 0.1) == pytest.approx(10.0)
    assert decode_rate(22, 2.2, 0.2, runs=2) == pytest.approx(10.0)
    assert decode_rate(1, 0.5, 0.1) is None  # only the prompt pass's token
    assert decode_rate(5, 0.1, 0.1) is None  # no time after the prompt pass


def test_counters_total_adds_runs():
    a, b = _counters([(4, 4), (2, 0)]), _counters([(3, 1)])
    a.verify_seconds, b.verify_seconds = 0.5, 0.25
    total = Counters.total([a, b])
    assert (total.rounds, total.drafted, total.accepted, total.rejection_rounds) == (3, 9, 5, 2)
    assert total.verify_seconds == pytest.approx(0.75)
    assert total.drafted_at == [3, 3, 2, 1] and total.accepted_at == [2, 1, 1, 1] and total.tested_at == [3, 2, 1, 1]
    assert total.draft_lengths == [4, 2, 3]


# ----------------------------------------------------------------------------------------------------------------
# the economics: one expected-tokens formula, one break-even, one "can speculation pay"


def test_break_even_acceptance_solves_the_one_expected_tokens_formula():
    for k, cost in [(1, 1.3), (4, 2.0), (8, 3.5)]:
        alpha = economics.break_even_acceptance(k, cost)
        assert alpha is not None and 0.0 < alpha < 1.0
        assert expected_tokens([alpha], k) == pytest.approx(cost, rel=1e-9)
    assert economics.break_even_acceptance(4, 1.0) == 0.0  # a round no dearer than a plain step: any alpha pays
    assert economics.break_even_acceptance(4, 5.0) is None  # even 5 tokens a round do not cover 5 plain steps


def test_can_pay_is_the_best_speedup_against_the_margin():
    flat = lambda k: 1.0 + 0.01 * k  # noqa: E731 - a verify pass that costs next to nothing more per token
    steep = lambda k: float(k + 1)  # noqa: E731 - a pass over k + 1 tokens costs k + 1 plain steps
    assert economics.best_speedup(flat, range(1, 9), 0.8) == pytest.approx(
        max(expected_tokens([0.8], k) / flat(k) for k in range(1, 9)))
    assert economics.can_pay(flat, range(1, 9)) and not economics.can_pay(steep, range(1, 9))
    assert economics.best_speedup(flat, range(1, 1), 0.8) == 0.0 and not economics.can_pay(flat, [])
    assert (economics.PAYING_ACCEPTANCE, economics.PAYING_SPEEDUP) == (0.8, 1.1)
