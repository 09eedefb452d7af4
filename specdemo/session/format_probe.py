"""``--dtype auto`` on a CPU measured on a few layers of the real weights, not on three whole models.

The first layers of the target (:data:`PROBE_LAYERS` of them, with the embedding, final norm and head) are read
once in bfloat16 and turned into each candidate format in turn. Every measured pass is split by two hooks into
its decoder layers and the rest (embedding, final norm, head, and what runs around them): the whole model's pass
is then the rest plus the layers' time scaled to all of them, which every layer of a decoder costs alike. Each
candidate's curve is that estimate at every pass length, with the whole model's weight bytes; :func:`~specdemo.
session.calibration.pick_format` ranks them as it ranks whole-model curves. Only the winner is converted and
loaded in full; the race's own calibration then measures its whole curve.

On the offline 1.5B target, 4 of 28 layers with the head are a fifth of the weights: three candidates take
seconds, where loading and measuring the whole target in each took minutes.
"""

from __future__ import annotations

import copy
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..backends import formats
from ..backends.gguf_embedding import GgufRowsEmbedding
from ..backends.int8_store import int8_layers_into, int8_values
from ..backends.loading import LoadSettings, ModelLoadError, load_first_layers, resolve_device
from ..backends.memory import return_free_memory
from ..backends.transformers_lm import CachedLM
from ..core.economics import CostCurve, curve_problem
from .calibration import AUTO_FORMATS, PASS_LENGTHS, detect_hardware, memory_bandwidth, timed_rounds

logger = logging.getLogger(__name__)

#: decoder layers of the real weights each format is measured on
PROBE_LAYERS = 4
#: timed passes of each length, and the most seconds a format's passes may take after the second round
PROBE_REPEATS, PROBE_BUDGET_SECONDS = 3, 2.0
#: cached tokens before the timed passes (as the whole-model calibration)
PROBE_PREFIX = 128


@dataclass(frozen=True)
class PassSplit:
    """One timed pass: its seconds in all, and of those, the seconds of its decoder layers."""

    seconds: float
    layer_seconds: float

    def scaled(self, layers: int, total_layers: int) -> float:
        """The pass of the whole model: the rest as measured, the layers' time for all of them."""
        return self.seconds + (total_layers / layers - 1.0) * self.layer_seconds


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's stack of decoder layers (the module list as long as ``config.num_hidden_layers``)."""
    count = int(model.config.num_hidden_layers)
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) == count and count > 0:
            return module
    raise ModelLoadError("cannot find the model's decoder layers to measure")


class _LayerClock:
    """Hooks on the first and last decoder layer: when the layers of the current pass began and ended."""

    def __init__(self, layers: nn.ModuleList) -> None:
        self.start = self.end = 0.0
        self.handles = [layers[0].register_forward_pre_hook(self._begin),
                        layers[-1].register_forward_hook(self._finish)]

    def _begin(self, *args: object) -> None:
        self.start = time.perf_counter()

    def _finish(self, *args: object) -> None:
        self.end = time.perf_counter()

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def measure_split(model: nn.Module, lengths: Sequence[int] = PASS_LENGTHS, repeats: int = PROBE_REPEATS,
                  budget_seconds: float = PROBE_BUDGET_SECONDS) -> dict[int, list[PassSplit]]:
    """Timed passes over k new tokens after a cached prefix, for each k round-robin, each split into its decoder
    layers and the rest."""
    generator = torch.Generator().manual_seed(0)
    vocab_size = formats.output_rows(model)
    lm = CachedLM(model)
    lm.reset()
    lm.forward(torch.randint(0, vocab_size, (PROBE_PREFIX,), generator=generator), all_logits=False)
    clock = _LayerClock(decoder_layers(model))

    def one_pass(k: int) -> PassSplit:
        ids = torch.randint(0, vocab_size, (k,), generator=generator)
        begin = time.perf_counter()
        lm.forward(ids, all_logits=True)
        seconds = time.perf_counter() - begin
        lm.rollback(k)
        return PassSplit(seconds, clock.end - clock.start)

    try:
        return timed_rounds(one_pass, lengths, repeats, budget_seconds)
    finally:
        clock.close()
        lm.reset()


def _estimated_curve(source: str, fmt: str, model: nn.Module, total_layers: int, started: float) -> CostCurve:
    """The whole model's curve in ``fmt`` from the cut model's split passes."""
    layers = decoder_layers(model)
    count = len(layers)
    splits = measure_split(model)
    lengths = list(splits)
    seconds = [statistics.median(split.scaled(count, total_layers) for split in splits[k]) for k in lengths]
    layer_bytes = formats.weight_bytes_per_pass(layers)
    weight_bytes = formats.weight_bytes_per_pass(model) + round((total_layers / count - 1.0) * layer_bytes)
    device = resolve_device("cpu")
    return CostCurve(
        hardware=detect_hardware(device), target=source, dtype=fmt, prefix_tokens=PROBE_PREFIX, lengths=lengths,
        seconds=seconds, measured_seconds=time.perf_counter() - started,
        measured_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"), problem=curve_problem(lengths, seconds),
        weight_bytes=weight_bytes, bandwidth_bytes_per_s=memory_bandwidth(device),
    )


def in_format(model: nn.Module, fmt: str, int8: dict[str, torch.Tensor] | None = None) -> nn.Module:
    """A copy of the bfloat16 ``model`` in ``fmt``, as a whole load in that format would give it (``int8``: the
    int8 values of its linear layers, :func:`~specdemo.backends.int8_store.int8_values`, made once for both
    int8-weight formats)."""
    copied = copy.deepcopy(model)
    if fmt in formats.INT8_FORMATS:
        tied = formats.head_is_tied(copied)
        int8_layers_into(copied, dict(int8 if int8 is not None else int8_values(copied)), fmt)
        formats.finish_int8_format(copied, fmt, tied)
    else:
        copied.to(getattr(torch, fmt))
    embedding = copied.get_input_embeddings()
    if isinstance(embedding, GgufRowsEmbedding):  # rows in the format's activation dtype, as a whole load gives
        embedding.out_dtype = formats.activation_dtype(fmt) if fmt in formats.INT8_FORMATS else getattr(torch, fmt)
    return copied


def quick_curves(source: str, settings: LoadSettings, candidates: Sequence[str] = AUTO_FORMATS,
                 layers: int = PROBE_LAYERS, before_timing: Callable[[], None] | None = None) -> dict[str, CostCurve]:
    """Each candidate format's estimated whole-model curve for ``source`` on this machine, measured on its first
    ``layers`` decoder layers (see the module's text). A format this torch cannot run is left out.
    ``before_timing`` is called once the layers are read and before anything is timed (to wait for whatever else
    was running on the cores)."""
    from ..backends.loading import resolve_format

    started = time.perf_counter()
    model, total_layers = load_first_layers(source, settings, layers)
    logger.info("Read %d of %d layers of %s in %.1f s", layers, total_layers, source, time.perf_counter() - started)
    if before_timing is not None:
        before_timing()
    curves: dict[str, CostCurve] = {}
    int8: dict[str, torch.Tensor] | None = None
    for fmt in candidates:
        started = time.perf_counter()
        try:
            resolve_format(fmt, resolve_device(settings.device))
        except ModelLoadError as error:  # e.g. a torch without the int8 kernel
            logger.info("Format %s unavailable for %s: %s", fmt, source, error)
            continue
        if fmt in formats.INT8_FORMATS and int8 is None:
            int8 = int8_values(model)
        candidate = in_format(model, fmt, int8)
        curves[fmt] = _estimated_curve(source, fmt, candidate, total_layers, started)
        curves[fmt].measured_layers = f"{len(decoder_layers(candidate))} of {total_layers}"
        logger.info("Measured %s on them in %.1f s", fmt, curves[fmt].measured_seconds)
        del candidate
        return_free_memory()
    if not curves:
        raise ModelLoadError(f"cannot load '{source}' in any of {', '.join(candidates)}")
    return curves
