"""What a forward pass costs on the machine at hand: the measured cost curve behind "why is it (not) faster here?".

Speculative decoding pays when checking k tokens in one target pass costs about as much as producing one. That is
a property of the hardware and the number format: on a GPU, or a CPU with native bfloat16 (AVX512-BF16, AMX), a
pass over 8 tokens costs little more than a pass over one; on an AVX2-only CPU a bfloat16 pass over 4 tokens costs
about three one-token passes. :func:`calibrate` measures, for a loaded target, one pass over k = 1, 2, 4, 8, 16 new
tokens after a cached prefix (and the draft's cost per token), in about 15 s at most, and caches the curve on disk
per machine, model and format, so later starts reuse it.

From a curve, :meth:`~specdemo.core.economics.CostCurve.break_even_acceptance` gives, per draft length, the acceptance rate a drafter needs
for a round to beat plain decoding; draft lengths that cannot pay even with every draft accepted get None.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import platform
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

import torch

from ..backends import formats
from ..backends.formats import output_rows
from ..backends.loading import (
    LoadedModel,
    LoadSettings,
    ModelLoadError,
    cache_key,
    forget_model,
    load_model,
    resolve_device,
    resolve_format,
)
from ..backends.offline import cache_home
from ..backends.transformers_lm import CachedLM
from ..core.clock import now
from ..core.economics import (
    CALIBRATION_VERSION,
    CostCurve,
    Hardware,
    curve_problem,
    speculation_can_pay,
    speculative_seconds_per_token,
)
from ..core.files import write_json_atomic

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: new tokens per measured pass
PASS_LENGTHS = (1, 2, 4, 8, 16)
#: how often a curve that fails :func:`~specdemo.core.economics.curve_problem` is measured again before it is used
#: for one run only, marked unreliable
MEASURE_ATTEMPTS = 3
#: CPU instruction sets that decide what a bfloat16 or int8 pass costs
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8")


@functools.lru_cache(maxsize=1)
def _cpu_info() -> tuple[str, tuple[str, ...]]:
    """The CPU's model name and those of :data:`CPU_FLAGS` it has (Linux /proc/cpuinfo, read once; elsewhere the
    platform's processor string and no flags)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine() or "unknown CPU", ()
    name, flags = "", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not name:
            name = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    return name or platform.machine() or "unknown CPU", tuple(f for f in CPU_FLAGS if f in flags)


def detect_hardware(device: torch.device) -> Hardware:
    """The hardware a model on ``device`` runs on."""
    if device.type == "cuda":
        return Hardware(str(device), torch.cuda.get_device_name(device), torch=torch.__version__)
    if device.type != "cpu":
        return Hardware(str(device), device.type, torch=torch.__version__)
    name, flags = _cpu_info()
    return Hardware("cpu", name, flags, torch.get_num_threads(), torch.__version__, _kernel_isa())


def _kernel_isa() -> str:
    """What the CPU kernels use: torch's dispatch level, the w8a8 format's int8 GEMMs, whether int8 layers share
    their inputs' calls (:func:`~specdemo.backends.formats.share_inputs`), and oneDNN's and FBGEMM's
    limits if the environment sets them (part of the cache key: a curve measured with other kernels is stale)."""
    isa = torch.backends.cpu.get_cpu_capability()
    if formats.w8a8_kernel_available():
        isa += f", w8a8 {formats.w8a8_kernel()}"
    isa += ", inputs shared" if formats.shares_inputs() else ", inputs apart"  # w8a8 targets and int8 drafts alike
    limit = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA")
    if limit:
        isa += f", oneDNN up to {limit}"
    if fbgemm := os.environ.get("FBGEMM_ENABLE_INSTRUCTIONS"):
        isa += f", FBGEMM up to {fbgemm}"
    return isa


def _median_pass_seconds(
    lm: CachedLM, vocab_size: int, lengths: Sequence[int], repeats: int, budget_seconds: float,
    generator: torch.Generator,
) -> list[float]:
    """Median seconds of one pass over k new tokens for each k, round-robin until ``repeats`` or the budget."""
    device = lm.device

    def one_pass(k: int) -> float:
        ids = torch.randint(0, vocab_size, (k,), generator=generator)
        begin = now(device)
        lm.forward(ids, all_logits=True)
        seconds = now(device) - begin
        lm.rollback(k)
        return seconds

    timings = timed_rounds(one_pass, lengths, repeats, budget_seconds)
    return [statistics.median(timings[k]) for k in lengths]


def timed_rounds(one_pass: Callable[[int], T], lengths: Sequence[int], repeats: int,
                 budget_seconds: float) -> dict[int, list[T]]:
    """``one_pass(k)`` for each k, round-robin, after one untimed pass over the longest: ``repeats`` rounds, or
    fewer once two are done and ``budget_seconds`` have passed; what each returned, by k."""
    results: dict[int, list[T]] = {k: [] for k in lengths}
    one_pass(max(lengths))  # warm-up, not kept
    started = time.perf_counter()
    for round_index in range(repeats):
        for k in lengths:
            results[k].append(one_pass(k))
        if round_index >= 1 and time.perf_counter() - started > budget_seconds:
            break
    return results


def _draft_step_seconds(
    target: LoadedModel,
    draft: LoadedModel,
    draft_int8: bool | None,
    repeats: int,
    budget_seconds: float,
    generator: torch.Generator,
    prefix_tokens: int = 128,
    num_draft_tokens: int = 4,
) -> float:
    """Median seconds per drafted token. A draft sharing the target's tokenizer is timed through the draft-model
    drafter itself (its int8 copy and restricted head, as a race runs it), drafting ``num_draft_tokens`` tokens after
    a prefix it has caught up on; any other draft (uag) is timed as one step of the model."""
    from ..backends.int8 import int8_copy
    from ..backends.loading import same_tokenizer
    from ..core.settings import SamplingSettings
    from ..methods.draft_model import DraftModelDrafter

    vocab_size = output_rows(target.model)
    shared = target.tokenizer is not None and draft.tokenizer is not None
    if shared and same_tokenizer(target.tokenizer, draft.tokenizer):
        prefix = torch.randint(0, vocab_size, (prefix_tokens,), generator=generator).tolist()
        drafter = DraftModelDrafter(draft.model, SamplingSettings(), target_vocab_size=vocab_size, int8=draft_int8)
        drafter.start(prefix)
        drafter.propose(prefix, num_draft_tokens)  # catching up on the prefix is no draft step
        per_token: list[float] = []
        started = time.perf_counter()
        while len(per_token) < repeats and (len(per_token) < 2 or time.perf_counter() - started < budget_seconds):
            begin = now(draft.device)
            drafter.propose(prefix, num_draft_tokens)  # the same context: the drafts are rolled back and made again
            per_token.append((now(draft.device) - begin) / num_draft_tokens)
        return statistics.median(per_token)
    model = draft.model
    if draft_int8 or (draft_int8 is None and draft.device.type == "cpu"):
        model = int8_copy(draft.model) or draft.model
    draft_lm = CachedLM(model)
    draft_lm.reset()
    draft_vocab = int(draft.model.get_output_embeddings().weight.shape[0])
    draft_lm.forward(torch.randint(0, draft_vocab, (prefix_tokens,), generator=generator), all_logits=False)
    (seconds,) = _median_pass_seconds(draft_lm, draft_vocab, (1,), repeats, budget_seconds, generator)
    draft_lm.reset()
    return seconds


def measure(
    target: LoadedModel,
    draft: LoadedModel | None = None,
    lengths: Sequence[int] = PASS_LENGTHS,
    prefix_tokens: int = 128,
    repeats: int = 5,
    budget_seconds: float = 8.0,
    draft_int8: bool | None = None,
) -> CostCurve:
    """Measure a cost curve now (see :func:`calibrate` for the cached version).

    The prefix is random token ids from a seeded generator of its own (the global RNG is not touched). The draft is
    timed as the drafter runs it (see :func:`_draft_step_seconds`): its int8 copy on a CPU unless ``draft_int8`` is
    False.
    """
    started = time.perf_counter()
    generator = torch.Generator().manual_seed(0)
    vocab_size = output_rows(target.model)
    lm = CachedLM(target.model)
    lm.reset()
    lm.forward(torch.randint(0, vocab_size, (prefix_tokens,), generator=generator), all_logits=False)
    problem = None
    for attempt in range(1, MEASURE_ATTEMPTS + 1):  # a noisy minute is measured again
        seconds = _median_pass_seconds(lm, vocab_size, lengths, repeats, budget_seconds, generator)
        problem = curve_problem(list(lengths), seconds)
        if problem is None:
            break
        logger.warning("Cost curve of %s, attempt %d of %d: %s", target.source, attempt, MEASURE_ATTEMPTS, problem)
    lm.reset()
    draft_seconds = None
    if draft is not None:
        draft_seconds = _draft_step_seconds(target, draft, draft_int8, repeats, budget_seconds / 4, generator)
    bandwidth = memory_bandwidth(target.device)
    return CostCurve(
        hardware=detect_hardware(target.device),
        target=target.source,
        dtype=target.format,
        prefix_tokens=prefix_tokens,
        lengths=list(lengths),
        seconds=seconds,
        draft_seconds_per_token=draft_seconds,
        draft=draft.source if draft is not None else None,
        measured_seconds=time.perf_counter() - started,
        measured_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        problem=problem,
        weight_bytes=formats.weight_bytes_per_pass(target.model),
        bandwidth_bytes_per_s=bandwidth,
    )


#: the buffer a bandwidth measurement copies: larger than any CPU's last-level cache a 2-core share sees
BANDWIDTH_BUFFER_BYTES = 512 * 1024 * 1024


@functools.lru_cache(maxsize=4)
def memory_bandwidth(device: torch.device, size: int = BANDWIDTH_BUFFER_BYTES, repeats: int = 5) -> float | None:
    """Bytes per second a copy of a ``size``-byte buffer moves (read and written, so twice its size), the best of
    ``repeats`` after one untimed copy; None when the buffers do not fit. Measured once per process and device
    (about 2 s for the default buffer on a 2-core CPU)."""
    try:
        source = torch.ones(size, dtype=torch.uint8, device=device)
        target = torch.empty_like(source)
    except (RuntimeError, MemoryError) as error:  # too little memory left for two buffers
        logger.warning("Memory bandwidth not measured: %s", error)
        return None
    target.copy_(source)
    best = float("inf")
    for _ in range(repeats):
        started = now(device)
        target.copy_(source)
        best = min(best, now(device) - started)
    del source, target
    return 2 * size / best if best > 0 else None


def _hardware_key(hardware: Hardware) -> list[Any]:
    """What identifies a machine in a cache key (with the host name beside it)."""
    return [hardware.device, hardware.name, list(hardware.flags), hardware.threads, hardware.torch, hardware.kernels]


def cache_path(
    target: LoadedModel, draft: LoadedModel | None, folder: Path | None = None, draft_int8: bool | None = None
) -> Path:
    """Where the curve for this machine, target, format and draft is cached."""
    hardware = detect_hardware(target.device)
    key = json.dumps(
        {
            "version": CALIBRATION_VERSION,
            "hardware": _hardware_key(hardware),
            "target": target.source,
            "dtype": target.format,
            "quantization": target.settings.quantization if target.settings else None,
            "draft": None if draft is None else [draft.source, str(draft.dtype), draft_int8],
            "node": platform.node(),
        },
        sort_keys=True,
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:20]
    return (folder or cache_home() / "calibration") / f"{digest}.json"


def calibrate(
    target: LoadedModel,
    draft: LoadedModel | None = None,
    refresh: bool = False,
    folder: Path | None = None,
    draft_int8: bool | None = None,
) -> CostCurve:
    """The cost curve of ``target`` (and ``draft``, int8 as in :func:`measure`) on this machine: read from the
    cache, else measured (about 15 s at most) and cached. A damaged or implausible cache file is measured again; a
    curve that stays implausible (see :func:`measure`) serves this run, marked, and is not cached."""
    path = cache_path(target, draft, folder, draft_int8)
    if not refresh and path.is_file():
        try:
            curve = CostCurve.from_dict(json.loads(path.read_text()))
            problem = curve.problem or curve_problem(curve.lengths, curve.seconds)
            if curve.version == CALIBRATION_VERSION and problem is None:
                curve.from_cache, curve.cache_file = True, str(path)
                return curve
            if problem is not None:
                logger.warning("Measuring again: the cached calibration %s is implausible (%s)", path, problem)
        except (OSError, ValueError, TypeError, KeyError) as error:
            logger.warning("Ignoring the cached calibration %s: %s", path, error)
    logger.info("Calibrating %s (%s) on this machine", target.source, target.format)
    curve = measure(target, draft, draft_int8=draft_int8)
    if curve.reliable:
        _cache_json(path, curve.as_dict())
        curve.cache_file = str(path)
    else:
        logger.warning("Using the cost curve of %s for this run only, not cached: %s", target.source, curve.problem)
    return curve


def refresh_if_stale(
    curve: CostCurve | None, plain_step_seconds: float | None, choice: FormatChoice | None = None
) -> str | None:
    """When a run's plain steps contradict a cached curve by far (:meth:`CostCurve.contradicted_by`), drop the
    curve's cache file (and that of the format choice made from such figures), so the next start measures again;
    the reason, or None when the figures agree (or there is nothing to check)."""
    if curve is None or not plain_step_seconds or not curve.from_cache:
        return None
    reason = curve.contradicted_by(plain_step_seconds)
    if reason is None:
        return None
    for cached in (curve.cache_file, choice.cache_file if choice is not None else None):
        if cached:
            Path(cached).unlink(missing_ok=True)
    logger.warning("The cached cost curve of %s is stale (%s): measured again at the next start", curve.target, reason)
    return reason


def _cache_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` to ``path`` whole or not at all; a read-only home only costs the cache (logged)."""
    try:
        write_json_atomic(path, data, indent=1)
    except OSError as error:
        logger.warning("Could not cache %s: %s", path, error)


# ----------------------------------------------------------------------------------------------------------------
# --dtype auto on a CPU: the format chosen by measurement

#: the formats ``auto`` chooses among on a CPU (float32 is left out: its one-token pass costs two to three times a
#: bfloat16 one on both classes of CPU measured, so it is never the fastest)
AUTO_FORMATS = ("w8a8", "int8", "bfloat16")
#: one-token passes within this share of the fastest count as a tie (timings of bandwidth-bound passes move by
#: 10 % and more between loads on a shared machine); the tie goes to the format where speculation writes fastest
PLAIN_TIE = 0.05


@dataclass
class FormatChoice:
    """The format a target runs in, and why: ``curves`` holds the measured candidates when ``auto`` chose."""

    format: str
    reason: str
    curves: dict[str, CostCurve] = field(default_factory=dict)
    cache_file: str | None = None  # where the choice was read from or written to (None: not cached)

    @property
    def reliable(self) -> bool:
        """Every candidate's curve was measured on a quiet machine."""
        return all(curve.reliable for curve in self.curves.values())

    def summary(self) -> str:
        lines = [f"format: {self.format} ({self.reason})"]
        for name, curve in self.curves.items():
            pays = "speculation can pay" if speculation_can_pay(curve) else "speculation cannot pay"
            floor = curve.floor_seconds
            beside = f" (floor {floor * 1000:.0f} ms: {curve.seconds[0] / floor:.1f}x)" if floor else ""
            estimate = f" (estimated from {curve.measured_layers} layers)" if curve.measured_layers else ""
            lines.append(f"  {name}: {curve.seconds[0] * 1000:.0f} ms per one-token pass{estimate}{beside}, a pass "
                         f"over 4 tokens {curve.cost(4):.2f}x; {pays}")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "reason": self.reason,
            "candidates": {name: curve.as_dict() for name, curve in self.curves.items()},
        }


def pick_format(curves: dict[str, CostCurve]) -> FormatChoice:
    """Among measured formats, the one with the fastest plain decoding among those where speculation can pay (the
    fastest of all when it pays in none). Formats within :data:`PLAIN_TIE` of the fastest plain decoding tie, and
    the tie goes to the one where a free drafter right 80 % of the time writes fastest."""
    paying = [name for name, curve in curves.items() if speculation_can_pay(curve)]
    pool = paying or list(curves)
    fastest = min(curves[name].seconds[0] for name in pool)
    tied = [name for name in pool if curves[name].seconds[0] <= fastest * (1 + PLAIN_TIE)]
    best = min(tied, key=lambda name: (speculative_seconds_per_token(curves[name]) if paying else 0.0,
                                       curves[name].seconds[0]))
    others = [name for name in curves if name != best]
    if len(curves) == 1:
        reason = "auto: the only format measured"
    elif paying and len(tied) > 1:
        reason = (f"auto: plain decoding within {PLAIN_TIE:.0%} of the fastest where speculation can pay "
                  f"({', '.join(f'{name} {curves[name].seconds[0] * 1000:.0f} ms' for name in tied)}), and "
                  f"speculation fastest: {speculative_seconds_per_token(curves[best]) * 1000:.0f} ms a token at 80 % "
                  f"acceptance against " + ", ".join(
                      f"{name} {speculative_seconds_per_token(curves[name]) * 1000:.0f} ms"
                      for name in tied if name != best))
    elif paying:
        reason = (f"auto: fastest plain decoding where speculation can pay, "
                  f"{curves[best].seconds[0] * 1000:.0f} ms a token against "
                  + ", ".join(f"{name} {curves[name].seconds[0] * 1000:.0f} ms" for name in others))
    else:
        reason = "auto: speculation cannot pay in any format here; the fastest plain decoding"
    return FormatChoice(best, reason, dict(curves))


def _choice_path(source: str, settings: LoadSettings, folder: Path | None) -> Path:
    """Where ``auto``'s choice for ``source`` on this machine is cached."""
    key = json.dumps(
        {
            "version": CALIBRATION_VERSION,
            "hardware": _hardware_key(detect_hardware(resolve_device(settings.device))),
            "target": cache_key(source, settings)[0],
            "quantization": settings.quantization,
            "formats": list(AUTO_FORMATS),
            "node": platform.node(),
        },
        sort_keys=True,
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:20]
    return (folder or cache_home() / "calibration") / f"format-{digest}.json"


def cached_format_choice(source: str, settings: LoadSettings, folder: Path | None = None) -> FormatChoice | None:
    """``auto``'s earlier choice for ``source`` on this machine, if one is cached (reads one small file)."""
    try:
        path = _choice_path(source, settings, folder)
    except ModelLoadError:
        return None
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        curves = {name: CostCurve.from_dict(curve) for name, curve in data["candidates"].items()}
        choice = FormatChoice(str(data["format"]), str(data["reason"]), curves, str(path))
        problems = [curve_problem(curve.lengths, curve.seconds) for curve in curves.values()]
        if not choice.reliable or any(problems):
            logger.warning("Choosing again: the cached format choice %s rests on implausible figures", path)
            return None
        return choice
    except (OSError, ValueError, TypeError, KeyError) as error:
        logger.warning("Ignoring the cached format choice %s: %s", path, error)
        return None


def _auto_on_cpu(settings: LoadSettings) -> bool:
    asked = (settings.dtype or "auto").strip().lower()
    return asked == "auto" and resolve_device(settings.device).type == "cpu" and not settings.quantization


def measures_formats(source: str, settings: LoadSettings, folder: Path | None = None) -> bool:
    """Whether :func:`choose_format` will load and measure the candidates (``auto`` on a CPU with no choice
    cached), so that a caller can free memory first."""
    return _auto_on_cpu(settings) and cached_format_choice(source, settings, folder) is None


def choose_format(
    source: str,
    settings: LoadSettings,
    refresh: bool = False,
    folder: Path | None = None,
    load: Callable[..., LoadedModel] = load_model,
    measure_candidates: Callable[[str, LoadSettings], dict[str, CostCurve]] | None = None,
) -> FormatChoice:
    """The format ``source`` runs in with ``settings``. Anything but ``auto`` on a CPU is taken as asked. ``auto``
    on a CPU reads the choice cached for this machine, else measures each of :data:`AUTO_FORMATS` and picks with
    :func:`pick_format`; the caller loads the chosen one. ``measure_candidates(source, settings)`` gives the
    candidates' curves (the app and the bench pass :func:`specdemo.session.format_probe.quick_curves`: a few layers
    of the real weights, seconds); without it each candidate is loaded whole, calibrated and freed before the next
    loads (about 15 s a format, plus its load). A choice resting on an unreliable curve serves this run and is not
    cached."""
    if not _auto_on_cpu(settings):
        device = resolve_device(settings.device)
        asked = (settings.dtype or "auto").strip().lower()
        fmt = resolve_format(settings.dtype, device)
        return FormatChoice(fmt, "as asked" if asked != "auto" else f"auto on {device.type}")
    if not refresh and (cached := cached_format_choice(source, settings, folder)) is not None:
        return cached
    curves = measure_candidates(source, settings) if measure_candidates is not None else _whole_curves(
        source, settings, refresh, folder, load)
    choice = pick_format(curves)
    if any(curve.measured_layers for curve in curves.values()):
        layers = next(curve.measured_layers for curve in curves.values() if curve.measured_layers)
        choice.reason += f"; measured here on {layers} layers of the real weights"
    if choice.reliable:
        path = _choice_path(source, settings, folder)
        _cache_json(path, choice.as_dict())
        choice.cache_file = str(path)
    else:
        choice.reason += "; measured on a busy machine, so for this run only (not cached)"
    logger.info("%s", choice.summary())
    return choice


def _whole_curves(source: str, settings: LoadSettings, refresh: bool, folder: Path | None,
                  load: Callable[..., LoadedModel]) -> dict[str, CostCurve]:
    """Each of :data:`AUTO_FORMATS`' curves measured on the whole target, one candidate in memory at a time."""
    curves: dict[str, CostCurve] = {}
    for fmt in AUTO_FORMATS:
        candidate = replace(settings, dtype=fmt)
        try:
            target = load(source, candidate, progress=False)
        except ModelLoadError as error:  # e.g. a torch without the int8 kernel
            logger.info("Format %s unavailable for %s: %s", fmt, source, error)
            continue
        curves[fmt] = calibrate(target, None, refresh=refresh, folder=folder)
        del target
        forget_model(source, candidate)  # one candidate in memory at a time
    if not curves:
        raise ModelLoadError(f"cannot load '{source}' in any of {', '.join(AUTO_FORMATS)}")
    return curves
