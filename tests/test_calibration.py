"""The cost curve: measured on tiny models, cached per machine and model, and read on recorded curves of both CPU
classes (native bfloat16, and AVX2 only, where a bfloat16 pass over k tokens costs nearly k one-token passes)."""

from __future__ import annotations

import json
import statistics
from dataclasses import replace

import pytest
import torch
from tiny import llama

from specdemo.backends import formats
from specdemo.backends.loading import LoadedModel, LoadSettings
from specdemo.core import economics
from specdemo.core.economics import CostCurve, Hardware
from specdemo.session import calibration
from specdemo.session.calibration import calibrate, detect_hardware

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


def test_a_pass_is_shown_beside_its_floor_the_weights_bytes_over_the_bandwidth() -> None:
    model = llama(3)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert formats.weight_bytes_per_pass(model) == 4 * linear  # float32, no biases; the embedding table not counted
    int8 = formats.weight_bytes_per_pass(formats.to_int8_format(llama(3), formats.W8A8))
    assert linear <= int8 < 1.2 * linear  # one byte a weight, and its scales
    curve = replace(AVX2_BF16, weight_bytes=3_000_000_000, bandwidth_bytes_per_s=20e9)
    assert curve.floor_seconds == pytest.approx(0.15)
    assert "3.00 GB of weights" in curve.describe_floor() and "20.0 GB/s" in curve.describe_floor()
    assert AVX2_BF16.floor_seconds is None and AVX2_BF16.describe_floor() is None and "floor" not in AVX2_BF16.summary()
    assert CostCurve.from_dict(json.loads(json.dumps(curve.as_dict()))) == curve
    choice = calibration.FormatChoice("bfloat16", "test", {"bfloat16": curve})
    assert f"(floor 150 ms: {curve.seconds[0] / 0.15:.1f}x)" in choice.summary()


def test_detect_hardware_on_this_cpu() -> None:
    hardware = detect_hardware(torch.device("cpu"))
    assert hardware.device == "cpu" and hardware.name and hardware.threads >= 1
    assert set(hardware.flags) <= set(calibration.CPU_FLAGS)
    assert hardware.describe().startswith(hardware.name)
    assert hardware.kernels.split(",")[0] == torch.backends.cpu.get_cpu_capability()  # torch's own kernels
    if formats.w8a8_kernel_available():  # and the w8a8 GEMMs: a curve measured with others is stale
        assert f"w8a8 {formats.w8a8_kernel()}, inputs shared" in hardware.kernels


def loaded(model, source: str) -> LoadedModel:
    return LoadedModel(source, model, None, torch.device("cpu"), torch.float32, LoadSettings(dtype="float32"))


def test_calibrate_measures_once_then_reads_the_cache(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    target, draft = loaded(llama(1), "tiny:target"), loaded(llama(2, layers=1), "tiny:draft")
    measured = []
    real_measure = calibration.measure
    monkeypatch.setattr(calibration, "curve_problem", lambda *args: None)  # a tiny model's timings are noise

    def counting_measure(*args, **kwargs):
        measured.append(1)
        return real_measure(*args, prefix_tokens=16, repeats=2, budget_seconds=2.0)

    monkeypatch.setattr(calibration, "measure", counting_measure)
    first = calibrate(target, draft, folder=tmp_path)
    assert len(measured) == 1 and not first.from_cache
    assert first.lengths == [1, 2, 4, 8, 16] and all(s > 0 for s in first.seconds)
    assert first.draft_seconds_per_token > 0 and first.dtype == "float32" and first.target == "tiny:target"
    assert first.weight_bytes == formats.weight_bytes_per_pass(target.model) and first.bandwidth_bytes_per_s > 1e8
    assert "x the floor" in first.summary() and first.floor_seconds < first.seconds[0] * 100
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


# ----------------------------------------------------------------------------------------------------------------
# the adaptive draft length on recorded curves: the CPU class we do not have is tested here


def simulate(policy, cost_curve: CostCurve, alpha: float, tokens: int = 3000, seed: int = 0) -> float:
    """Tokens per second of a run on a machine with this cost curve: drafts accepted independently with probability
    ``alpha``, timings with ±15 % noise and one pass in fifty three times too slow. A drafter that sat out plain
    steps first catches up on what was written meanwhile, in one pass of its own (booked apart, as the engine
    does)."""
    import random

    rng = random.Random(seed)
    base, draft_step = cost_curve.seconds[0], cost_curve.draft_seconds_per_token or 0.0

    def noisy(seconds: float) -> float:
        return seconds * rng.uniform(0.85, 1.15) * (3.0 if rng.random() < 0.02 else 1.0)

    written, elapsed, behind = 0, 0.0, 0
    while written < tokens:
        k = policy.next_num_draft_tokens()
        catch_up = noisy(draft_step * cost_curve.cost(behind)) if k and behind > 2 else 0.0
        draft_seconds = noisy(k * draft_step) if k else 0.0
        verify_seconds = noisy(base * cost_curve.cost(k + 1))
        accepted = 0
        while accepted < k and rng.random() < alpha:
            accepted += 1
        policy.update(k, accepted, draft_seconds, verify_seconds, catch_up)
        elapsed += draft_seconds + catch_up + verify_seconds
        written += accepted + 1
        behind = behind + accepted + 1 if k == 0 else 0
    return written / elapsed


class PlainOnly:
    def next_num_draft_tokens(self) -> int:
        return 0

    def update(self, *timings: float) -> None:
        pass


def best_fixed(cost_curve: CostCurve, alpha: float, seed: int = 0) -> float:
    from specdemo.methods.draft_length import FixedDraftLength

    return max(simulate(FixedDraftLength(k), cost_curve, alpha, seed=seed) for k in range(1, 13))


@pytest.mark.parametrize(
    "cost_curve",
    [
        NATIVE_BF16,
        AVX2_INT8,
        # the int8 format's curves: flat up to four tokens, then climbing (its kernel turns compute-bound)
        curve(NATIVE, 0.066, [1.0, 0.98, 1.19, 2.31, 4.02], draft=0.0175),
        curve(AVX2, 0.075, [1.0, 1.03, 1.83, 3.68, 7.15], draft=0.0154),
    ],
    ids=["native-bf16", "avx2-int8", "native-int8-format", "avx2-kernels-int8-format"],
)
@pytest.mark.parametrize("alpha", [0.5, 0.6, 0.8, 0.9])
def test_where_verification_is_cheap_the_adaptive_policy_keeps_up_with_the_best_fixed_length(
    cost_curve: CostCurve, alpha: float
) -> None:
    """Within 8 % of the best of plain decoding and every fixed draft length starting from the calibrated curve,
    within 7 % starting from nothing, judged on the median of three seeded runs (none of them more than 10 % off).

    (Starting from nothing was held to 5 % while the verify cost was one straight line; reading it piecewise between
    measured lengths lifted the int8 format's curves at 90 % acceptance from 0.89-0.91 to 0.99 of the best fixed
    length, and left the legacy int8 curve at 50 % acceptance with no calibration at 0.94. The app and the bench
    always start from the calibrated curve.)"""
    from specdemo.methods.draft_length import make_policy

    for prior, tolerance in ((cost_curve, 0.92), (None, 0.93)):
        ratios = []
        for seed in range(3):
            best = max(best_fixed(cost_curve, alpha, seed), simulate(PlainOnly(), cost_curve, alpha, seed=seed))
            ratios.append(simulate(make_policy("adaptive", prior=prior), cost_curve, alpha, seed=seed) / best)
        assert statistics.median(ratios) >= tolerance and min(ratios) >= 0.9, (prior is not None, ratios)


@pytest.mark.parametrize(
    "cost_curve", [AVX2_BF16, curve(AVX2, 0.1, [1.0, 2.0, 4.0, 8.0, 16.0], draft=0.03)], ids=["avx2-bf16", "linear"]
)
def test_where_verification_is_dear_plain_decoding_costs_at_most_two_percent_more(cost_curve: CostCurve) -> None:
    """Drafts are right half the time and no draft length pays: the policy should decode plainly, its probes (with
    the drafter's catch-up) costing at most 2 % of the run."""
    from specdemo.methods.draft_length import make_policy

    for seed in range(3):
        plain = simulate(PlainOnly(), cost_curve, 0.5, seed=seed)
        adaptive = simulate(make_policy("adaptive", prior=cost_curve), cost_curve, 0.5, seed=seed)
        assert adaptive >= 0.98 * plain, (seed, adaptive, plain)


def test_the_policy_knows_where_drafting_can_pay_and_shrugs_off_slow_outliers() -> None:
    from specdemo.methods.draft_length import CostAwareDraftLength

    assert not CostAwareDraftLength(prior=AVX2_BF16, draft_seconds_per_token=0.03).drafting_could_pay()
    for cheap in (NATIVE_BF16, AVX2_INT8):
        assert CostAwareDraftLength(prior=cheap, draft_seconds_per_token=0.03).drafting_could_pay()
    # where it cannot pay, the first look at acceptance is a single draft token
    assert CostAwareDraftLength(prior=AVX2_BF16, draft_seconds_per_token=0.03).next_num_draft_tokens() == 1
    assert CostAwareDraftLength(prior=NATIVE_BF16, draft_seconds_per_token=0.03).next_num_draft_tokens() == 4
    # three slow plain steps in a row (another process) do not make drafting look worth it on a dear curve
    policy = CostAwareDraftLength(prior=AVX2_BF16, draft_seconds_per_token=0.03)
    policy.update(policy.next_num_draft_tokens(), 0, 0.03, 0.31)
    for seconds in (0.18, 0.17, 0.55, 0.6, 0.58, 0.18):
        assert policy.next_num_draft_tokens() == 0
        policy.update(0, 0, 0.0, seconds)
    assert policy._verify_cost(1) < 0.2


def test_calibrated_costs_count_at_the_speed_the_machine_runs_now() -> None:
    """A curve calibrated while the machine was quieter (a one-token pass 85 ms, a 2-token pass 1.08 of it); in
    this run every pass takes 30 % longer. The 2-token cost, never measured in this run, counts at this run's speed,
    so a 2-token pass does not look cheaper than a plain step (it did: 92 ms calibrated against plain steps measured
    at 110 ms, and uag drafted where it lost); one slow pass does not move the machine's speed."""
    from specdemo.methods.draft_length import CostAwareDraftLength

    calibrated = curve(AVX2, 0.085, [1.0, 1.08, 1.2, 1.88, 3.45], draft=0.030)
    slower = 1.3
    policy = CostAwareDraftLength(prior=calibrated, draft_seconds_per_token=0.030)
    assert policy._verify_cost(2) == pytest.approx(0.085 * 1.08)
    policy.update(policy.next_num_draft_tokens(), 0, 4 * 0.030 * slower, 0.085 * calibrated.cost(5) * slower)
    for seconds in (0.085 * slower, 0.085 * slower, 3 * 0.085 * slower, 0.085 * slower):
        policy.update(0, 0, 0.0, seconds)
    assert policy._verify_cost(1) == pytest.approx(0.085 * slower)
    assert policy._verify_cost(2) == pytest.approx(0.085 * 1.08 * slower)
    assert policy._verify_cost(2) > policy._verify_cost(1)
    assert policy._draft_time_per_token == pytest.approx(0.030 * slower)


def test_the_drafter_books_its_catch_up_apart() -> None:
    """After plain steps the draft model catches up in a pass of its own, timed apart from drafting."""
    from specdemo.core.settings import SamplingSettings
    from specdemo.methods.draft_model import DraftModelDrafter

    drafter = DraftModelDrafter(llama(3), SamplingSettings(), target_vocab_size=96, int8=False)
    prompt = list(range(10, 30))
    drafter.start(prompt)
    first = drafter.propose(prompt, 3)
    assert first.catch_up_seconds > 0  # the prompt itself
    context = prompt + first.tokens[:2] + [5]  # two drafts accepted and a correction: nothing to catch up on
    assert drafter.propose(context, 3).catch_up_seconds == 0.0
    context = context + [7, 8, 9, 11, 12]  # five plain steps without the drafter
    behind = drafter.propose(context, 3)
    assert behind.catch_up_seconds > 0 and len(behind.tokens) == 3


# --dtype auto on a CPU: the format with the fastest plain decoding among those where speculation can pay

#: the offline target in the int8 format (int8 weights, bfloat16 activations) and in bfloat16 on this project's
#: native-bfloat16 CPU (the bench's calibration, 128 cached tokens)
NATIVE_INT8 = curve(NATIVE, 0.066, [1.0, 0.98, 1.19, 2.31, 4.02])
NATIVE_BF16_MEASURED = curve(NATIVE, 0.150, [1.0, 1.02, 1.06, 1.2, 1.5])
#: the same target on this CPU with every kernel held to AVX2 (ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2,
#: MKL_ENABLE_INSTRUCTIONS=AVX2): the AVX2-only class imitated; its bfloat16 curve has the shape recorded on a real
#: AVX2-only machine above (1.58x, 2.81x, 5.71x, 11.1x)
AVX2_KERNELS = Hardware("cpu", "AMD EPYC", ("avx2", "avx512f", "avx512_bf16"), 2, "2.13.0", "AVX2, oneDNN up to AVX2")
AVX2_KERNELS_INT8 = curve(AVX2_KERNELS, 0.075, [1.0, 1.03, 1.83, 3.68, 7.15])
AVX2_KERNELS_BF16 = curve(AVX2_KERNELS, 0.087, [1.0, 1.58, 2.81, 5.71, 11.06])
#: a CPU whose bfloat16 passes are faster than int8 ones (AMX tiles): bfloat16 must win there
AMX = Hardware("cpu", "Intel Xeon (AMX)", ("avx2", "avx512f", "avx512_bf16", "amx_bf16"), 2, "2.13.0")
AMX_BF16 = curve(AMX, 0.040, [1.0, 1.01, 1.03, 1.06, 1.12])
AMX_INT8 = curve(AMX, 0.055, [1.0, 1.0, 1.1, 1.9, 3.5])
#: the w8a8 format (int8 activations, FBGEMM) on this project's CPU, natively and with FBGEMM held to AVX2 too
#: (FBGEMM_ENABLE_INSTRUCTIONS=AVX2), in a busy hour (its bandwidth-bound pass measured 45 to 69 ms across loads)
NATIVE_W8A8 = curve(NATIVE, 0.058, [1.0, 1.02, 1.03, 1.23, 1.73])
AVX2_KERNELS_W8A8 = curve(AVX2_KERNELS, 0.044, [1.0, 1.09, 1.53, 2.45, 4.29])
#: the same FBGEMM kernel on the real AVX2-only machine (the issue's dynamic quantisation, per-tensor scales)
AVX2_W8A8 = curve(AVX2, 0.068, [1.0, 1.06, 1.17, 1.61, 3.1])


def test_speculation_can_pay_per_cpu_class() -> None:
    assert economics.speculation_can_pay(NATIVE_BF16) and economics.speculation_can_pay(NATIVE_INT8)
    assert economics.speculation_can_pay(AVX2_INT8)
    assert not economics.speculation_can_pay(AVX2_BF16)  # a pass over k tokens costs nearly k plain steps


@pytest.mark.parametrize(
    "curves,expected",
    [
        ({"int8": NATIVE_INT8, "bfloat16": NATIVE_BF16_MEASURED}, "int8"),
        ({"int8": AVX2_INT8, "bfloat16": AVX2_BF16}, "int8"),
        ({"int8": AVX2_KERNELS_INT8, "bfloat16": AVX2_KERNELS_BF16}, "int8"),
        ({"int8": AMX_INT8, "bfloat16": AMX_BF16}, "bfloat16"),
        ({"w8a8": NATIVE_W8A8, "int8": NATIVE_INT8, "bfloat16": NATIVE_BF16_MEASURED}, "w8a8"),
        ({"w8a8": AVX2_KERNELS_W8A8, "int8": AVX2_KERNELS_INT8, "bfloat16": AVX2_KERNELS_BF16}, "w8a8"),
        ({"w8a8": AVX2_W8A8, "bfloat16": AVX2_BF16}, "w8a8"),
        ({"w8a8": curve(AMX, 0.050, [1.0, 1.0, 1.05, 1.3, 1.8]), "int8": AMX_INT8, "bfloat16": AMX_BF16}, "bfloat16"),
        # plain decoding within 5 %: the format whose verify passes cost less wins the tie, whichever is faster
        ({"w8a8": curve(NATIVE, 0.068, [1.0, 1.0, 1.02, 1.2, 1.64]), "int8": NATIVE_INT8}, "w8a8"),
        ({"w8a8": curve(NATIVE, 0.064, [1.0, 1.0, 1.02, 1.2, 1.64]), "int8": NATIVE_INT8}, "w8a8"),
        # outside the tie the faster plain decoding wins, though its verify passes cost more
        ({"w8a8": curve(NATIVE, 0.072, [1.0, 1.0, 1.02, 1.2, 1.64]), "int8": NATIVE_INT8}, "int8"),
        # faster plain decoding, but speculation cannot pay in it: the slower format where it can
        ({"int8": curve(AVX2, 0.100, [1.0, 1.9, 3.8, 7.6, 15.0]), "bfloat16": NATIVE_BF16}, "bfloat16"),
        # it pays nowhere: the fastest plain decoding
        ({"int8": curve(AVX2, 0.100, [1.0, 1.9, 3.8, 7.6, 15.0]), "bfloat16": AVX2_BF16}, "int8"),
    ],
    ids=["native", "avx2-only", "avx2-kernels", "amx", "native-w8a8", "avx2-kernels-w8a8", "avx2-only-w8a8",
         "amx-w8a8", "tie-slower", "tie-faster", "no-tie", "only-bf16-pays", "none-pays"],
)
def test_auto_picks_the_fastest_format_where_speculation_can_pay(curves, expected) -> None:
    choice = calibration.pick_format(curves)
    assert choice.format == expected and choice.reason.startswith("auto")
    assert set(choice.as_dict()["candidates"]) == set(curves)
    assert choice.summary().startswith(f"format: {expected}")


def test_choose_format_measures_each_candidate_once_per_machine(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    from specdemo.backends.formats import to_int8_format

    loads, forgotten, events = [], [], []

    def fake_load(source, settings, progress=True, on_progress=None):
        loads.append(settings.dtype)
        events.append(("load", settings.dtype))
        if settings.dtype in ("int8", "w8a8"):
            model = to_int8_format(llama(1), settings.dtype)
        else:
            model = llama(1).to(torch.bfloat16)
        return LoadedModel(source, model, None, torch.device("cpu"), torch.bfloat16, settings)

    recorded = {"int8": NATIVE_INT8, "bfloat16": NATIVE_BF16_MEASURED, "w8a8": curve(NATIVE, 0.090, [1.0] * 5)}
    monkeypatch.setattr(calibration, "measure", lambda target, draft, **kwargs: recorded[target.format])
    def forget(source, settings):
        forgotten.append(settings.dtype)
        events.append(("forget", settings.dtype))

    monkeypatch.setattr(calibration, "forget_model", forget)
    auto = LoadSettings(dtype="auto", device="cpu")
    choice = calibration.choose_format("tiny:target", auto, folder=tmp_path, load=fake_load)
    assert choice.format == "int8" and sorted(loads) == ["bfloat16", "int8", "w8a8"]
    # one candidate in memory at a time: each is freed before the next loads (the caller loads the chosen one)
    assert events == [(kind, fmt) for fmt in calibration.AUTO_FORMATS for kind in ("load", "forget")]
    assert "66 ms" in choice.reason and "bfloat16 150 ms" in choice.reason and "w8a8 90 ms" in choice.reason
    again = calibration.choose_format("tiny:target", auto, folder=tmp_path, load=fake_load)
    assert again.format == "int8" and len(loads) == 3  # the choice is cached per machine: nothing loaded again
    assert calibration.cached_format_choice("tiny:target", auto, folder=tmp_path).format == "int8"
    asked = calibration.choose_format("tiny:target", LoadSettings(dtype="float32"), folder=tmp_path, load=fake_load)
    assert asked.format == "float32" and asked.reason == "as asked" and len(loads) == 3
    calibration.choose_format("tiny:target", auto, refresh=True, folder=tmp_path, load=fake_load)
    assert len(loads) == 6
    for path in tmp_path.glob("format-*.json"):
        path.write_text("{damaged")
    assert calibration.cached_format_choice("tiny:target", auto, folder=tmp_path) is None


# ----------------------------------------------------------------------------------------------------------------
# a noisy minute does not make a curve


BUSY = [1.172, 0.62, 0.70, 0.80, 1.00]  # measured with another program on the cores: 2 tokens at 0.53 of 1


def test_a_curve_where_more_tokens_cost_less_is_implausible() -> None:
    assert economics.curve_problem([1, 2, 4, 8, 16], [0.1, 0.1, 0.105, 0.12, 0.16]) is None
    assert economics.curve_problem([1, 2, 4, 8, 16], [0.1, 0.085, 0.1, 0.12, 0.16]) is None  # within 20 %
    problem = economics.curve_problem([1, 2, 4, 8, 16], BUSY)
    assert problem.startswith("a pass over 2 tokens measured 0.53 of one over 1")
    assert economics.curve_problem([1, 2, 4], [0.1, 0.2, 0.15]).startswith("a pass over 4 tokens measured 0.75 of one over 2")


def test_a_noisy_measurement_is_repeated_and_one_that_stays_noisy_serves_one_run_uncached(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = loaded(llama(1), "tiny:target")
    answers = [BUSY, BUSY, [0.1, 0.1, 0.11, 0.12, 0.16]]
    monkeypatch.setattr(calibration, "_median_pass_seconds", lambda *args, **kwargs: list(answers.pop(0)))
    settled = calibrate(target, None, folder=tmp_path)
    assert settled.reliable and not answers and settled.seconds[0] == 0.1  # measured three times
    assert len(list(tmp_path.glob("*.json"))) == 1
    monkeypatch.setattr(calibration, "_median_pass_seconds", lambda *args, **kwargs: list(BUSY))
    noisy = calibrate(target, None, refresh=True, folder=tmp_path / "other")
    assert not noisy.reliable and "2 tokens measured 0.53" in noisy.problem
    assert not (tmp_path / "other").exists() and noisy.cache_file is None  # not cached
    assert "UNRELIABLE cost curve, for this run only (not cached)" in noisy.summary()
    # an implausible curve in the cache (an older version wrote one) is measured again
    path = next(tmp_path.glob("*.json"))
    data = json.loads(path.read_text())
    data["seconds"] = BUSY
    path.write_text(json.dumps(data))
    monkeypatch.setattr(calibration, "_median_pass_seconds", lambda *args, **kwargs: [0.2, 0.2, 0.21, 0.22, 0.3])
    again = calibrate(target, None, folder=tmp_path)
    assert not again.from_cache and again.seconds[0] == 0.2


def test_a_format_choice_made_on_a_busy_machine_is_not_cached(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fake_load(source, settings, progress=True, on_progress=None):
        return LoadedModel(source, llama(1), None, torch.device("cpu"), torch.float32, settings)

    busy = curve(NATIVE, 1.172, [r / 1.172 for r in BUSY])
    busy.problem = economics.curve_problem(busy.lengths, busy.seconds)
    recorded = {"int8": NATIVE_INT8, "bfloat16": NATIVE_BF16_MEASURED, "w8a8": busy}
    monkeypatch.setattr(calibration, "calibrate", lambda target, draft, **kwargs: recorded[target.settings.dtype])
    monkeypatch.setattr(calibration, "forget_model", lambda source, settings: None)
    auto = LoadSettings(dtype="auto", device="cpu")
    choice = calibration.choose_format("tiny:target", auto, folder=tmp_path, load=fake_load)
    assert not choice.reliable and "for this run only (not cached)" in choice.reason
    assert calibration.cached_format_choice("tiny:target", auto, folder=tmp_path) is None
    recorded["w8a8"] = curve(NATIVE, 0.090, [1.0] * 5)
    choice = calibration.choose_format("tiny:target", auto, folder=tmp_path, load=fake_load)
    assert choice.reliable and choice.cache_file is not None
    assert calibration.cached_format_choice("tiny:target", auto, folder=tmp_path).format == choice.format


def test_a_cached_curve_that_todays_plain_steps_contradict_is_measured_again(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = loaded(llama(1), "tiny:target")
    monkeypatch.setattr(calibration, "_median_pass_seconds", lambda *args, **kwargs: [0.1, 0.1, 0.11, 0.12, 0.16])
    calibrate(target, None, folder=tmp_path)
    cached = calibrate(target, None, folder=tmp_path)
    assert cached.from_cache
    assert calibration.refresh_if_stale(cached, 0.15) is None and cached.contradicted_by(0.06) is None
    choice_file = tmp_path / "format-x.json"
    choice_file.write_text("{}")
    choice = calibration.FormatChoice("bfloat16", "auto", {}, str(choice_file))
    reason = calibration.refresh_if_stale(cached, 0.25, choice)
    assert reason == "plain steps took 250 ms, the cost curve says 100 ms (2.50x)"
    assert not list(tmp_path.glob("*.json"))  # the curve and the choice made from it are gone
    assert calibration.refresh_if_stale(calibrate(target, None, folder=tmp_path), 0.04) is None  # just measured
    assert "0.40x" in (calibrate(target, None, folder=tmp_path).contradicted_by(0.04) or "")


def test_a_pair_switch_frees_the_old_pair_before_the_new_target_loads(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """Peak memory of a switch: the old pair is freed before any format candidate of the new target loads, and the
    candidates load one at a time."""
    import tiny_app

    from specdemo.session.racer import Racer
    from specdemo.session.request import RaceRequest

    monkeypatch.setenv("SPECDEMO_CACHE", str(tmp_path))
    events = []
    quick = [0.1, 0.1, 0.11, 0.12, 0.16]
    monkeypatch.setattr(calibration, "_median_pass_seconds", lambda lm, vocab, lengths, *a, **k: quick[: len(lengths)])
    monkeypatch.setattr(calibration, "forget_model", lambda source, settings: events.append(("forget", source)))

    def loader(source, settings, progress=True, on_progress=None):
        events.append(("load", source))
        return tiny_app.loader(source, settings, progress, on_progress)

    def forget_models(keep):
        events.append(("free all but", tuple(sorted(k[0] for k in keep))))

    racer = Racer(tiny_app.config(calibrate=True, dtype="auto", loader=loader, forget_models=forget_models))
    racer.prepare(RaceRequest("hello world", "tiny", mode="ngram", max_new_tokens=4, dtype="auto"))
    events.clear()
    racer.prepare(RaceRequest("hello world", "tiny-slow", mode="ngram", max_new_tokens=4, dtype="auto"))
    assert events[0] == ("free all but", ("tiny:draft",))  # the old target goes first; the shared draft stays
    candidates = [e for e in events if e[1] == "tiny:slow"][: 2 * len(calibration.AUTO_FORMATS)]
    assert candidates == [(kind, "tiny:slow") for _ in calibration.AUTO_FORMATS for kind in ("load", "forget")]
    # the old draft becomes the target: the whole old pair is freed before the candidates load (the draft's copy
    # in its own format too)
    events.clear()
    racer.prepare(RaceRequest("hello world", target="tiny:draft", draft="tiny:other", mode="uag", max_new_tokens=4,
                              dtype="auto"))
    assert events[:2] == [("free all but", ()), ("load", "tiny:draft")]
    # a target whose format choice is cached loads no candidates, so nothing is freed early (and not reloaded)
    events.clear()
    prepared = racer.prepare(RaceRequest("hello world", "tiny-slow", mode="ngram", max_new_tokens=4, dtype="auto"))
    assert ("forget", "tiny:slow") not in events and events.count(("load", "tiny:slow")) == 1
    assert prepared.format_choice is not None and prepared.format_choice.cache_file  # the cached choice, used
