"""The cost curve: measured on tiny models, cached per machine and model, and read on recorded curves of both CPU
classes (native bfloat16, and AVX2 only, where a bfloat16 pass over k tokens costs nearly k one-token passes)."""

from __future__ import annotations

import json

import pytest
import torch

from specdemo import calibration
from specdemo.calibration import CostCurve, Hardware, calibrate, detect_hardware
from specdemo.models import LoadedModel, LoadSettings
from tiny import llama

pytestmark = pytest.mark.usefixtures("one_torch_thread")

#: a CPU with native bfloat16 (this project's AMD EPYC with AVX512-BF16, offline target in bfloat16)
NATIVE = Hardware("cpu", "AMD EPYC", ("avx2", "avx512f", "avx512_bf16"), 2, "2.13.0")
#: an AVX2-only CPU: the offline target's bfloat16 curve recorded in the engine issue (177 ms, then 1.75x, 2.87x,
#: 5.04x, 9.7x) and its int8-weight curve there (68 ms, 1.06x, 1.17x, 1.61x, 3.1x)
AVX2 = Hardware("cpu", "AMD EPYC (AVX2 only)", ("avx2",), 2, "2.13.0")


def curve(hardware: Hardware, first: float, relative: list[float], draft: float | None = None) -> CostCurve:
    return CostCurve(
        hardware, "offline:qwen2.5-coder-1.5b", "bfloat16", 200, [1, 2, 4, 8, 16], [first * r for r in relative],
        draft_seconds_per_token=draft, draft="offline:qwen2.5-coder-0.5b" if draft else None,
    )


AVX2_BF16 = curve(AVX2, 0.177, [1.0, 1.75, 2.87, 5.04, 9.7], draft=0.030)
AVX2_INT8 = curve(AVX2, 0.068, [1.0, 1.06, 1.17, 1.61, 3.1], draft=0.030)
NATIVE_BF16 = curve(NATIVE, 0.125, [1.0, 1.02, 1.05, 1.15, 1.4], draft=0.030)


def test_cost_interpolates_between_measured_lengths() -> None:
    assert NATIVE_BF16.cost(1) == 1.0 and NATIVE_BF16.relative[0] == 1.0
    assert NATIVE_BF16.cost(4) == pytest.approx(1.05)
    assert 1.05 < NATIVE_BF16.cost(6) < 1.15
    assert NATIVE_BF16.cost(32) == pytest.approx(2.8)  # past the longest: linear in tokens
    assert AVX2_BF16.draft_cost == pytest.approx(0.030 / 0.177)
    assert AVX2_BF16.round_cost(3) == pytest.approx(3 * 0.030 / 0.177 + 2.87)


def test_break_even_acceptance_solves_the_expected_tokens_equation() -> None:
    for k in (1, 2, 3, 5, 8):
        alpha = NATIVE_BF16.break_even_acceptance(k)
        assert alpha is not None and 0 < alpha < 1
        expected = (1 - alpha ** (k + 1)) / (1 - alpha)
        assert expected == pytest.approx(NATIVE_BF16.round_cost(k), rel=1e-6)
    free = curve(NATIVE, 0.1, [1.0, 1.0, 1.0, 1.0, 1.0])  # verification free, drafting free: always pays
    assert free.break_even_acceptance(4) == 0.0
    linear = curve(AVX2, 0.1, [1.0, 2.0, 4.0, 8.0, 16.0])  # k tokens cost k passes: nothing can pay
    assert all(linear.break_even_acceptance(k) is None for k in range(1, 16))


def test_the_two_cpu_classes() -> None:
    """On native bfloat16 long drafts pay at modest acceptance; on AVX2 in bfloat16 every draft length needs about
    nine drafts in ten accepted, and int8 weights bring short drafts back within reach (the engine issue's curves,
    with a 30 ms draft step)."""
    assert NATIVE.native_bfloat16 is True and AVX2.native_bfloat16 is False
    assert NATIVE_BF16.break_even_acceptance(8) < 0.75 and NATIVE_BF16.break_even_acceptance(2) < 0.4
    assert all(AVX2_BF16.break_even_acceptance(k) > 0.88 for k in range(1, 17))
    assert AVX2_INT8.break_even_acceptance(1) < 0.55 and AVX2_INT8.break_even_acceptance(4) < 0.8
    assert "cannot pay" not in AVX2_INT8.summary() and "avx2" in AVX2_INT8.summary()
    hopeless = curve(AVX2, 0.1, [1.0, 2.0, 4.0, 8.0, 16.0], draft=0.05)
    assert "cannot pay" in hopeless.summary()


def test_dict_round_trip_keeps_everything() -> None:
    data = json.loads(json.dumps(AVX2_BF16.as_dict()))
    assert data["hardware"]["flags"] == ["avx2"] and data["break_even_acceptance"]["8"] == pytest.approx(0.935, abs=1e-3)
    assert data["relative"][2] == pytest.approx(2.87)
    assert CostCurve.from_dict(data) == AVX2_BF16


def test_detect_hardware_on_this_cpu() -> None:
    hardware = detect_hardware(torch.device("cpu"))
    assert hardware.device == "cpu" and hardware.name and hardware.threads >= 1
    assert set(hardware.flags) <= set(calibration.CPU_FLAGS)
    assert hardware.describe().startswith(hardware.name)


def loaded(model, source: str) -> LoadedModel:
    return LoadedModel(source, model, None, torch.device("cpu"), torch.float32, LoadSettings(dtype="float32"))


def test_calibrate_measures_once_then_reads_the_cache(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    target, draft = loaded(llama(1), "tiny:target"), loaded(llama(2, layers=1), "tiny:draft")
    measured = []
    real_measure = calibration.measure

    def counting_measure(*args, **kwargs):
        measured.append(1)
        return real_measure(*args, prefix_tokens=16, repeats=2, budget_seconds=2.0)

    monkeypatch.setattr(calibration, "measure", counting_measure)
    first = calibrate(target, draft, folder=tmp_path)
    assert len(measured) == 1 and not first.from_cache
    assert first.lengths == [1, 2, 4, 8, 16] and all(s > 0 for s in first.seconds)
    assert first.draft_seconds_per_token > 0 and first.dtype == "float32" and first.target == "tiny:target"
    again = calibrate(target, draft, folder=tmp_path)
    assert len(measured) == 1 and again.from_cache and again.seconds == first.seconds
    assert calibrate(target, None, folder=tmp_path).draft_seconds_per_token is None  # another key: measured
    assert len(measured) == 2
    for path in tmp_path.iterdir():
        path.write_text("{damaged")
    calibrate(target, draft, folder=tmp_path)  # a damaged file is measured again
    assert len(measured) == 3
    assert calibrate(target, draft, refresh=True, folder=tmp_path) is not None and len(measured) == 4


def test_measuring_leaves_the_global_rng_alone() -> None:
    target = loaded(llama(1), "tiny:target")
    torch.manual_seed(123)
    state = torch.get_rng_state()
    calibration.measure(target, prefix_tokens=8, repeats=1, budget_seconds=1.0)
    assert torch.equal(state, torch.get_rng_state())
