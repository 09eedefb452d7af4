"""A pair's preparation as named steps: one fraction that only grows, the step's name and the seconds left, the
estimate refined by how the finished steps compared with their guesses."""

from __future__ import annotations

import re

import pytest

from specdemo.backends.loading import LoadSettings
from specdemo.session import preparation
from specdemo.session.preparation import Step, StepProgress, plan_steps, prepare_beside


def test_steps_report_one_growing_fraction_with_names_and_seconds_left(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter([0.0, 0.0, 10.0, 10.0, 40.0, 40.0, 50.0, 50.0])
    monkeypatch.setattr(preparation.time, "perf_counter", lambda: next(clock))
    seen: list[tuple[float, str]] = []
    steps = StepProgress(lambda fraction, message: seen.append((fraction, message)),
                         [Step("measuring", 10.0), Step("converting", 30.0), Step("warming up", 10.0)])
    steps.start("measuring", "three formats")
    steps.start("converting")  # the first step took 10 s as guessed
    steps.within(0.5, "shard 4 of 8")
    steps.start("warming up")  # the second took 30 s as guessed
    total = steps.finish()
    fractions = [fraction for fraction, _ in seen]
    assert fractions == sorted(fractions) and fractions[0] == 0.0
    assert seen[0][1] == "step 1 of 3 (about 50 s left): measuring, three formats"
    assert seen[2][1] == "step 2 of 3 (about 25 s left): converting, shard 4 of 8"
    assert seen[2][0] == pytest.approx((10 + 15) / 50)
    assert re.fullmatch(r"step 3 of 3 \(about 10 s left\): warming up", seen[3][1])
    assert total == 50.0


def test_the_estimate_follows_the_finished_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter([0.0, 0.0, 20.0, 20.0])
    monkeypatch.setattr(preparation.time, "perf_counter", lambda: next(clock))
    seen: list[str] = []
    steps = StepProgress(lambda fraction, message: seen.append(message), [Step("a", 10.0), Step("b", 10.0)])
    steps.start("a")
    steps.start("b")  # "a" took twice its guess: so will "b", says the estimate
    assert seen[-1] == "step 2 of 2 (about 20 s left): b"


def test_a_pair_already_converted_plans_no_conversion_and_nothing_beside() -> None:
    settings = LoadSettings(dtype="bfloat16", device="cpu")
    steps = plan_steps("tiny:target", settings, "tiny:draft", measuring=False, calibrating=True)
    assert [step.name for step in steps] == [preparation.LOADING_TARGET, preparation.LOADING_DRAFT,
                                             preparation.CHOOSING_PASSES, preparation.WARMING_UP,
                                             preparation.CALIBRATING]
    assert steps[0].estimate == preparation.GUESS_LOAD  # nothing to convert: a Hub id or a folder
    assert prepare_beside("tiny:draft", settings) is None and prepare_beside(None, settings) is None
