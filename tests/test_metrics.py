"""Metric definitions."""

import pytest

from specdemo.engine import Counters
from specdemo.metrics import compare, expected_speedup, expected_tokens_per_pass, run_metrics


def test_leviathan_formula():
    assert expected_tokens_per_pass(0.0, 4) == pytest.approx(1.0)
    assert expected_tokens_per_pass(1.0, 4) == pytest.approx(5.0)
    assert expected_tokens_per_pass(0.8, 4) == pytest.approx((1 - 0.8**5) / 0.2)
    assert expected_speedup(0.8, 4, 0.1) == pytest.approx(((1 - 0.8**5) / 0.2) / 1.4)


def _counters(rounds):
    counters = Counters(prefill_seconds=0.1, target_passes=1, new_tokens=1)
    for drafted, accepted in rounds:
        produced = accepted + 1
        counters.record_round(drafted, accepted, produced)
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
    alpha = 5 / 7
    per_round = [expected_tokens_per_pass(alpha, k) for k in (4, 4, 4, 0)]
    assert metrics.expected_tokens_per_round == pytest.approx(sum(per_round) / 4)


def test_compare_against_plain():
    plain = _counters([(0, 0)] * 9)
    plain.verify_seconds = 0.9  # 0.1 s per plain step
    spec = _counters([(4, 4), (4, 4)])
    spec.draft_seconds, spec.verify_seconds = 0.08, 0.2  # c = 0.01 / 0.1, v = 0.1 / 0.1
    comparison = compare(run_metrics(spec), run_metrics(plain))
    assert comparison.draft_cost == pytest.approx(0.1)
    assert comparison.verify_cost == pytest.approx(1.0)
    assert comparison.expected_speedup == pytest.approx(5.0 / 1.4)
    assert comparison.speedup == pytest.approx(run_metrics(spec).tokens_per_s / run_metrics(plain).tokens_per_s)
