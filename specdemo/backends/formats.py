"""The CPU target formats with int8 weights, both batch-invariant: ``int8`` and ``w8a8``.

``int8``: int8 weights, bfloat16 activations, float32 accumulation. ``w8a8``: int8 weights and int8 activations with
one scale per token, int32 accumulation, float32 everywhere else (see :class:`W8A8Linear`).

On a CPU a one-token pass is bound by reading the weights. Stored as int8 (one scale per output channel), they
halve the bytes of bfloat16; PyTorch's ``aten._weight_int8pack_mm`` kernel (the one torch.compile lowers weight-only
int8 to on CPUs) multiplies bfloat16 activations by them with float32 accumulation, and it is vectorised on AVX2 as
well as AVX-512, so it needs no native bfloat16 arithmetic.

Exactness needs more than a fast matmul: a verify pass over k tokens must give each token the logits a one-token
pass would. Every piece of this format is chosen so that a token's row never depends on the other rows of its pass:

- the matmul has no activation scale at all (weight-only quantisation; a per-tensor activation scale, as in
  ``torch.ao.quantization.quantize_dynamic``, would mix the rows);
- attention computes every query alone for passes over at most 65 tokens (:data:`ROW_WISE_MAX_QUERIES`): each
  query attends to exactly the keys a one-token pass at its position would see, padded to the same length, in a
  call of the same shape (see :func:`row_wise_attention`);
- norms, rotary embeddings and activations are per-row already.

Prefills longer than :data:`ROW_WISE_MAX_QUERIES` use the stock attention; both sides of a race prefill the same
prompt in the same call, so they agree there too.

``w8a8`` is the same design with a different matmul: int8 by int8 with int32 sums, in FBGEMM (PyTorch's
``quantized`` ops, as the draft's dynamic quantisation uses) or oneDNN (AMX tiles where the CPU has them; see
:func:`w8a8_kernel`). Integer sums are exact in any order, and the kernels are called with unit scales so that they
return just those sums; the only thing that could mix rows is then the activation scale, and :class:`W8A8Linear`
gives each token its own. On CPUs without AVX-512 its cost grows far more slowly with the rows of a pass than the
weight-only kernel's, which turns float32 multiply-adds over four rows at a time into the bottleneck; with AMX, a
pass over 8 tokens costs little more than one.
"""

from __future__ import annotations

import logging
import os
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.pytorch_utils import Conv1D

from ..core.settings import MAX_NUM_DRAFT_TOKENS

logger = logging.getLogger(__name__)

#: the format's name, as --dtype and the app's dtype menu spell it
INT8 = "int8"
#: the activation dtype of the int8 format
INT8_ACTIVATIONS = torch.bfloat16
#: the name of the format with int8 weights and int8 activations (a scale per token)
W8A8 = "w8a8"
#: the activation dtype of the w8a8 format between its matmuls
W8A8_ACTIVATIONS = torch.float32
#: a token's activations are scaled by their largest magnitude and rounded to this many steps each side of zero:
#: 7-bit values, so that AVX2's int8 multiply (pairs of unsigned 8-bit by signed 8-bit products summed into 16 bits)
#: cannot saturate, the reason FBGEMM's ``reduce_range`` exists; the same grid on every CPU
W8A8_STEPS = 63
#: the zero point of the activation grid in FBGEMM's unsigned 8-bit activations
W8A8_ZERO_POINT = 64
#: the int8 GEMMs a w8a8 layer multiplies with: FBGEMM's (PyTorch's ``quantized`` ops), oneDNN's
#: (``onednn::qlinear_pointwise``, which uses AMX tiles where the CPU has them), or FBGEMM's for one-row calls and
#: oneDNN's for the rest. Each returns the exact integer sums (unit scales), so all three give the same bits
FBGEMM, ONEDNN, FBGEMM_ONEDNN = "fbgemm", "onednn", "fbgemm+onednn"
W8A8_KERNELS = (FBGEMM, ONEDNN, FBGEMM_ONEDNN)
#: the environment variable that names the w8a8 kernels (to measure one against another); unset: :func:`w8a8_kernel`
W8A8_KERNEL_ENV = "SPECDEMO_W8A8_KERNEL"
#: the attention implementation registered with transformers for int8 targets
ROW_WISE_ATTENTION = "specdemo_row_wise"
#: passes over at most this many new tokens compute every query alone: every verify pass (the longest draft,
#: :data:`~specdemo.core.settings.MAX_NUM_DRAFT_TOKENS`, plus the last token) and Medusa tree; longer ones
#: (prefills) use the stock kernel
ROW_WISE_MAX_QUERIES = MAX_NUM_DRAFT_TOKENS + 1
#: a query's keys are padded (masked) to a multiple of this many, in one-token passes and verify passes alike, so
#: that the queries of a verify pass fall into at most two calls
KEY_BUCKET = 64


def int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float32 matrix as int8 with one float32 scale per row, symmetric (a row's largest magnitude is 127
    steps): ``(int8 values, scales)``; ``values * scales[:, None]`` stands for ``weight``."""
    scale = (weight.abs().amax(dim=1) / 127.0).clamp(min=torch.finfo(torch.float32).tiny)
    return torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


class Int8WeightLinear(nn.Module):
    """A linear layer with int8 weights (symmetric, one scale per output channel) and bfloat16 activations."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        qweight, scale = int8_rows(linear.weight.detach().to(INT8_ACTIVATIONS).float())
        self._hold(qweight, scale, None if linear.bias is None else linear.bias.detach())

    @classmethod
    def from_int8(cls, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> "Int8WeightLinear":
        """The layer for int8 values and float32 row scales already made by :func:`int8_rows` (a stored model)."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._hold(qweight, scale, bias)
        return layer

    def _hold(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale.to(INT8_ACTIVATIONS))
        self.register_buffer("bias", None if bias is None else bias.to(INT8_ACTIVATIONS))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = hidden.reshape(-1, self.in_features).to(INT8_ACTIVATIONS).contiguous()
        out = torch.ops.aten._weight_int8pack_mm(rows, self.qweight, self.scale)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*hidden.shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The weights as bfloat16 (what the int8 values and scales stand for)."""
        return self.qweight.to(INT8_ACTIVATIONS) * self.scale[:, None]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weights"


class W8A8Linear(nn.Module):
    """A linear layer with int8 weights (symmetric, one scale per output channel) and int8 activations with one
    scale per token (its largest magnitude), multiplied with int32 sums by FBGEMM or oneDNN; float32 in and out.

    A token's row is divided by its own scale and rounded on a fixed 7-bit grid (:data:`W8A8_STEPS`); the kernel
    returns the exact integer sums of those steps times the int8 weights (unit scales: no kernel rounds anything
    but the final int32 to float32, so every kernel and every call shape gives the same bits), which are then
    multiplied by the weight step and the token's scale, element by element; the bias is added last. Nothing in a
    row depends on the other rows of the pass. With ``two_parts`` a row goes in as two 7-bit rows of the same call,
    its rounded values and what rounding left (scaled up by ``2 * W8A8_STEPS``), for about 14 bits of activation
    at the cost of twice the rows: the layers whose inputs have outlier channels (an MLP's down projection, the LM
    head) need it. ``kernel`` is one of :data:`W8A8_KERNELS` (None: :func:`w8a8_kernel`)."""

    def __init__(self, linear: nn.Linear, two_parts: bool = False, kernel: str | None = None) -> None:
        super().__init__()
        qweight, scale = int8_rows(linear.weight.detach().float())
        self._hold(qweight, scale, None if linear.bias is None else linear.bias.detach(), two_parts, kernel)

    @classmethod
    def from_int8(cls, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, two_parts: bool = False,
                  kernel: str | None = None) -> "W8A8Linear":
        """The layer for int8 values and float32 row scales already made by :func:`int8_rows` (a stored model)."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._hold(qweight, scale, bias, two_parts, kernel)
        return layer

    def _hold(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, two_parts: bool,
              kernel: str | None) -> None:
        self.out_features, self.in_features = qweight.shape
        self.two_parts = two_parts
        self.kernel = kernel or w8a8_kernel()
        if self.kernel not in W8A8_KERNELS:
            raise ValueError(f"unknown w8a8 kernel {self.kernel!r}: use one of {', '.join(W8A8_KERNELS)}")
        #: one activation step times one weight step, per output channel
        self.register_buffer("weight_step", scale / W8A8_STEPS)
        self.register_buffer("weight_scale", scale)
        # a two-part layer never takes one row, so it needs no one-row kernel
        uses_fbgemm = self.kernel == FBGEMM or (self.kernel == FBGEMM_ONEDNN and not two_parts)
        uses_onednn = self.kernel != FBGEMM
        self.fbgemm_packed = _fbgemm_pack(qweight) if uses_fbgemm else None
        self.onednn_packed = torch.ops.onednn.qlinear_prepack(qweight, [1, self.in_features]) if uses_onednn else None
        #: the int8 weights, kept where no FBGEMM packing can give them back (oneDNN's cannot be unpacked)
        self.register_buffer("qweight", None if uses_fbgemm else qweight)
        self._unit_scales = torch.ones(self.out_features)
        self._zero_points = torch.zeros(self.out_features, dtype=torch.long)
        self.register_buffer("bias", None if bias is None else bias.to(W8A8_ACTIVATIONS))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = hidden.reshape(-1, self.in_features).to(W8A8_ACTIVATIONS)
        token_scale = rows.abs().amax(dim=1, keepdim=True).clamp(min=torch.finfo(W8A8_ACTIVATIONS).tiny)
        scaled = rows / token_scale * W8A8_STEPS  # in [-63, 63]
        steps = torch.round(scaled)
        if self.two_parts:
            steps = torch.cat([steps, torch.round((scaled - steps) * (2 * W8A8_STEPS))])  # the rest, in [-63, 63]
        out = self._integer_sums(steps)  # a fresh tensor: scaled in place (plain products and sums, the same in
        if self.two_parts:               # every lane of every kernel, so no row depends on its place in the call)
            count = rows.shape[0]
            out = out[count:].div_(2 * W8A8_STEPS).add_(out[:count])
        out.mul_(self.weight_step).mul_(token_scale)
        if self.bias is not None:
            out.add_(self.bias)
        return out.reshape(*hidden.shape[:-1], self.out_features)

    def _integer_sums(self, steps: torch.Tensor) -> torch.Tensor:
        """The exact integer products of activation rows on the 7-bit grid (whole numbers in [-63, 63], as
        float32) and the int8 weights, as float32: FBGEMM's kernel for one row if the layer has it, else oneDNN's.

        oneDNN picks its kernel by the call's shape; with scales inside the call its kernels round differently
        (a 1536 x 256 layer's one-row results differed from its GEMM's in the last bits). With unit scales every
        kernel returns the integer sums, rounded once to float32 (``tests/test_formats.py`` checks both kernels
        against int64 products)."""
        if self.onednn_packed is None or (self.fbgemm_packed is not None and steps.shape[0] == 1):
            return torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
                steps, 1.0, W8A8_ZERO_POINT, self.fbgemm_packed
            )
        activations = (steps + W8A8_ZERO_POINT).to(torch.uint8)
        return torch.ops.onednn.qlinear_pointwise(
            activations, 1.0, W8A8_ZERO_POINT, self.onednn_packed, self._unit_scales, self._zero_points, None,
            1.0, 0, torch.float32, "none", [], "",
        )

    def dequantized(self) -> torch.Tensor:
        """The weights as bfloat16 (what the int8 values and scales stand for, as the int8 format gives them: a
        float32 copy of a 150k-row head would cost Medusa more to read than a whole w8a8 target pass)."""
        if self.qweight is not None:
            qweight = self.qweight
        else:
            packed, _ = self.fbgemm_packed.unpack()
            qweight = packed.int_repr()
        return (qweight.float() * self.weight_scale[:, None]).to(INT8_ACTIVATIONS)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, int8 weights and activations, "
                f"{self.kernel}")


def _fbgemm_pack(qweight: torch.Tensor) -> torch.ScriptObject:
    """int8 weights packed for FBGEMM with unit scales (the layer applies the real ones)."""
    count = qweight.shape[0]
    with warnings.catch_warnings():  # quantised tensors are deprecated, the FBGEMM ops that take them are not
        warnings.simplefilter("ignore")
        quantized = torch._make_per_channel_quantized_tensor(
            qweight, torch.ones(count, dtype=torch.double), torch.zeros(count, dtype=torch.long), 0
        )
        with _fbgemm_engine():
            return torch.ops.quantized.linear_prepack(quantized, None)


class _fbgemm_engine:
    """Pack weights for FBGEMM whatever the process's quantised engine is (``x86`` may pick oneDNN, whose AVX2 path
    saturates on 8-bit activations); the engine is set back afterwards."""

    def __enter__(self) -> None:
        self.previous = torch.backends.quantized.engine
        torch.backends.quantized.engine = "fbgemm"

    def __exit__(self, *exc: object) -> None:
        torch.backends.quantized.engine = self.previous


#: the layers each int8-weight format replaces linear layers with, and its activation dtype
_FORMAT_LAYERS: dict[str, tuple[type[nn.Module], torch.dtype]] = {
    INT8: (Int8WeightLinear, INT8_ACTIVATIONS),
    W8A8: (W8A8Linear, W8A8_ACTIVATIONS),
}
#: the names of the int8-weight formats
INT8_FORMATS = tuple(_FORMAT_LAYERS)
_INT8_LAYERS = tuple(layer for layer, _ in _FORMAT_LAYERS.values())


def activation_dtype(fmt: str) -> torch.dtype:
    """The activation dtype of the int8-weight format ``fmt``."""
    return _FORMAT_LAYERS[fmt][1]


def int8_kernel_available() -> bool:
    """Whether this torch build has the CPU weight-only int8 kernel."""
    return hasattr(torch.ops.aten, "_weight_int8pack_mm")


def w8a8_kernel_available() -> bool:
    """Whether this torch build has FBGEMM's int8 GEMM (x86 CPUs; not on ARM builds)."""
    return "fbgemm" in torch.backends.quantized.supported_engines and hasattr(
        torch.ops.quantized, "linear_with_input_q_dq_qweight_dq_output_fp32"
    )


def onednn_kernel_available() -> bool:
    """Whether this torch build has oneDNN's int8 linear ops (x86 builds with oneDNN)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_pointwise")


def _has_amx() -> bool:
    check = getattr(torch.cpu, "_is_amx_tile_supported", None)
    try:
        return bool(check()) if check is not None else False
    except RuntimeError:  # pragma: no cover - a CPU torch that cannot tell
        return False


def w8a8_kernel() -> str:
    """The int8 GEMMs w8a8 layers multiply with here (one of :data:`W8A8_KERNELS`): :data:`W8A8_KERNEL_ENV` if set;
    else, where the CPU has AMX tiles, FBGEMM's for one-row calls and oneDNN's for the rest, elsewhere FBGEMM's.

    Measured on the 2-core AMX Xeon, one 1536 x 8960 layer read from memory: FBGEMM 0.56 ms for one row, 1.52 and
    1.83 times that for 8 and 16; oneDNN 0.60 ms, 1.01 and 1.04 times. Without AMX oneDNN was no flatter (AVX-512
    VNNI) or four to eight times slower (AVX2). Where both are used, the layers that take one row hold both
    packings (about 0.7 of the weights twice)."""
    named = os.environ.get(W8A8_KERNEL_ENV, "").strip().lower()
    if named:
        if named not in W8A8_KERNELS:
            raise ValueError(f"{W8A8_KERNEL_ENV}={named!r}: use one of {', '.join(W8A8_KERNELS)}")
        if named != FBGEMM and not onednn_kernel_available():
            raise ValueError(f"{W8A8_KERNEL_ENV}={named}: this torch build has no oneDNN int8 linear ops")
        return named
    return FBGEMM_ONEDNN if _has_amx() and onednn_kernel_available() else FBGEMM


def to_int8_format(model: PreTrainedModel, fmt: str = INT8, kernel: str | None = None) -> PreTrainedModel:
    """Turn a CPU model into ``fmt`` (:data:`INT8` or :data:`W8A8`) in place: every linear layer (LM head included)
    int8, everything else in the format's activation dtype, attention row-wise for short passes; w8a8 layers
    multiply with ``kernel`` (None: :func:`w8a8_kernel`). Returns the model."""
    layer = _FORMAT_LAYERS[fmt][0]
    head = model.get_output_embeddings()
    tied = head_is_tied(model)
    hidden_size = getattr(model.config, "hidden_size", None)
    if layer is W8A8Linear:
        kernel = kernel or w8a8_kernel()
        share_inputs(model, lambda linear: W8A8Linear(linear, two_parts=narrows(linear, hidden_size), kernel=kernel))
        replace_linear_layers(model, lambda linear, child: W8A8Linear(
            linear, two_parts=child is head or narrows(linear, hidden_size), kernel=kernel))
    else:
        replace_linear_layers(model, lambda linear, _: layer(linear))
    return finish_int8_format(model, fmt, tied)


def head_is_tied(model: nn.Module) -> bool:
    """Whether the LM head's weight is the input embedding's (read from the registered parameters: an embedding
    kept in GGUF blocks dequantises its whole table to answer ``.weight``)."""
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    weight = getattr(head, "_parameters", {}).get("weight") if head is not None else None
    return weight is not None and weight is getattr(embedding, "_parameters", {}).get("weight")


def finish_int8_format(model: PreTrainedModel, fmt: str, tied: bool) -> PreTrainedModel:
    """What turning a model into ``fmt`` does once its linear layers are int8: everything else in the format's
    activation dtype, the head untied from the embedding (it is an int8 copy), attention row-wise."""
    model.to(activation_dtype(fmt))
    if tied:  # the embedding keeps its table; the head is an int8 copy, so they are no longer tied
        model.config.tie_word_embeddings = False
    model.set_attn_implementation(ROW_WISE_ATTENTION)
    return model


#: sibling linear layers that read the same input in every transformers decoder layer that has them: an
#: attention's query, key and value projections, an MLP's gate and up projections
SHARED_INPUT_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
#: set to 0 to keep every int8 linear layer (w8a8 targets and heads, int8 drafts) apart (to measure what sharing
#: inputs saves)
SHARE_INPUTS_ENV = "SPECDEMO_W8A8_SHARE_INPUTS"


class SharedInputLinear(nn.Module):
    """One of several linear layers that read the same input, computed as one layer over their stacked weights.

    The first member called with an input runs the whole group's layer once (for w8a8: the input divided by its
    token scale and rounded once, one kernel call) and keeps the other members' columns for their calls with the
    same tensor; a member called with another tensor (or twice with the same one) runs the group's layer again,
    so the result never depends on the order of the calls. In w8a8 each output channel's integer sums, weight
    step, token scale and bias are those the member's own layer would use, so its output is bit-equal to that
    layer's (``tests/test_formats.py``); so is a draft's dynamically quantised copy (one activation scale per call,
    computed from the same input)."""

    def __init__(self, group: "_SharedInput", index: int) -> None:
        super().__init__()
        self._group = (group,)  # a tuple: the group's layer is registered once, on the first member
        if index == 0:
            self.layer = group.layer
        self.index = index
        self.in_features = group.in_features
        self.out_features = group.bounds[index + 1] - group.bounds[index]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._group[0].part(self.index, hidden)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, one part of a shared int8 layer"


class _SharedInput:
    """A group's layer and what its last call left for the members not yet called (one tuple, replaced whole)."""

    def __init__(self, layer: nn.Module, in_features: int, sizes: list[int]) -> None:
        self.layer = layer
        self.in_features = in_features
        self.bounds = [0]
        for size in sizes:
            self.bounds.append(self.bounds[-1] + size)
        self._last: tuple[torch.Tensor, torch.Tensor, frozenset[int]] | None = None  # input, output, parts taken

    def part(self, index: int, hidden: torch.Tensor) -> torch.Tensor:
        last = self._last
        if last is None or last[0] is not hidden or index in last[2]:
            output, taken = self.layer(hidden), frozenset((index,))
        else:
            output, taken = last[1], last[2] | {index}
        # every member served: hold nothing between passes; the result never depends on what another call left
        self._last = None if len(taken) == len(self.bounds) - 1 else (hidden, output, taken)
        return output[..., self.bounds[index] : self.bounds[index + 1]].contiguous()


def shares_inputs() -> bool:
    """Whether int8 layers that read the same input share its call (unless :data:`SHARE_INPUTS_ENV` is 0)."""
    return os.environ.get(SHARE_INPUTS_ENV, "1").strip() != "0"


def _stacked(members: list[nn.Linear]) -> nn.Linear:
    """One linear layer whose output channels are those of ``members``, in order."""
    first = members[0]
    stacked = nn.Linear(first.in_features, sum(m.out_features for m in members), bias=first.bias is not None,
                        device="meta")
    stacked.weight = nn.Parameter(torch.cat([m.weight.detach() for m in members]), requires_grad=False)
    if first.bias is not None:
        stacked.bias = nn.Parameter(torch.cat([m.bias.detach() for m in members]), requires_grad=False)
    return stacked


def share_inputs(model: nn.Module, make: Callable[[Any], nn.Module],
                 stack: Callable[[list[nn.Linear]], Any] = _stacked) -> int:
    """Make each :data:`SHARED_INPUT_GROUPS` group of linear layers under one module one int8 layer (``make`` of
    ``stack`` of the members, by default their stacked weights: each output channel keeps its own weight scale, so
    the int8 weights are those each layer would get alone), its members :class:`SharedInputLinear`; returns how
    many groups were joined (none with :data:`SHARE_INPUTS_ENV` set to 0)."""
    if not shares_inputs():
        return 0
    joined = 0
    for parent in list(model.modules()):
        for names in SHARED_INPUT_GROUPS:
            members = [getattr(parent, name, None) for name in names]
            if not all(type(m) is nn.Linear for m in members):
                continue
            first = members[0]
            if any(m.in_features != first.in_features or (m.bias is None) != (first.bias is None) for m in members):
                continue
            group = _SharedInput(make(stack(members)), first.in_features, [m.out_features for m in members])
            for index, name in enumerate(names):
                setattr(parent, name, SharedInputLinear(group, index))
            joined += 1
    return joined


def replace_linear_layers(module: nn.Module, make: Callable[[nn.Linear, nn.Module], nn.Module]) -> None:
    """Replace every linear layer under ``module`` (GPT-2's ``Conv1D`` too) in place, a layer at a time, by
    ``make(linear, layer)``: ``linear`` the layer as an ``nn.Linear``, ``layer`` the original module."""
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, (nn.Linear, Conv1D)):
                setattr(parent, name, make(_as_linear(child), child))


def narrows(linear: nn.Linear, hidden_size: int | None) -> bool:
    """Whether ``linear`` maps a wider space back to the model's width: an MLP's down projection, whose input
    (an activation times a gate) has the outlier channels that 7-bit activations lose (measured on
    Qwen2.5-Coder-1.5B: two thirds of w8a8's divergence from float32 came from those layers, a fifth from the head)."""
    return linear.in_features > (hidden_size or linear.out_features)


def _as_linear(layer: nn.Linear | Conv1D) -> nn.Linear:
    """``layer`` as an ``nn.Linear`` (GPT-2's ``Conv1D`` is a linear layer with its weight stored transposed)."""
    if isinstance(layer, nn.Linear):
        return layer
    linear = nn.Linear(layer.nx, layer.nf, device="meta")
    linear.weight = nn.Parameter(layer.weight.detach().t().contiguous(), requires_grad=False)
    linear.bias = nn.Parameter(layer.bias.detach(), requires_grad=False)
    return linear


def int8_format_of(model: nn.Module) -> str | None:
    """The int8-weight format ``model`` is in (:data:`INT8` or :data:`W8A8`, told by its LM head), else None."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    return next((fmt for fmt, (layer, _) in _FORMAT_LAYERS.items() if isinstance(head, layer)), None)


def is_int8_format(model: nn.Module) -> bool:
    """Whether ``model`` is in one of the int8-weight formats."""
    return int8_format_of(model) is not None


def weight_bytes_per_pass(model: nn.Module) -> int:
    """The bytes of weights one forward pass reads: every linear layer's in the format it runs in (int8 weights
    one byte each, with their per-channel scales; a shared-input group's stacked layer once; the LM head too, tied
    or not), and not the embedding table, of which a pass reads one row per token."""
    total = 0
    for module in model.modules():
        if isinstance(module, W8A8Linear):
            total += module.in_features * module.out_features + 2 * 4 * module.out_features
        elif isinstance(module, Int8WeightLinear):
            total += module.qweight.numel() + module.scale.numel() * module.scale.element_size()
        elif isinstance(module, nn.Linear):
            total += module.weight.numel() * module.weight.element_size()
        else:
            continue
        bias = getattr(module, "bias", None)
        if isinstance(bias, torch.Tensor):
            total += bias.numel() * bias.element_size()
    return total


def output_rows(model: nn.Module) -> int:
    """The number of rows (vocabulary entries) the model's LM head scores."""
    head = model.get_output_embeddings()
    if isinstance(head, _INT8_LAYERS):
        return head.out_features
    return int(head.weight.shape[0])


#: bfloat16 copies of int8 LM heads, for Medusa heads that score with the target's head (freed with the model)
_DEQUANTIZED_HEADS: "weakref.WeakKeyDictionary[nn.Module, torch.Tensor]" = weakref.WeakKeyDictionary()


def output_weight(model: nn.Module) -> torch.Tensor:
    """The LM head's weight matrix; for the int8-weight formats a bfloat16 copy, made once per model."""
    head = model.get_output_embeddings()
    if not isinstance(head, _INT8_LAYERS):
        return head.weight.detach()
    weight = _DEQUANTIZED_HEADS.get(model)
    if weight is None:
        with torch.inference_mode():
            weight = head.dequantized()
        _DEQUANTIZED_HEADS[model] = weight
    return weight


def _visible_keys(mask: torch.Tensor | None, q_length: int, kv_length: int) -> torch.Tensor:
    """Which keys each query of a pass may see, as a [q_length, kv_length] boolean grid."""
    if mask is None:  # causal: query i sees the cached keys and the new ones up to itself
        return torch.arange(kv_length) < torch.arange(kv_length - q_length + 1, kv_length + 1)[:, None]
    grid = mask[0, 0, :, :kv_length]
    return grid if grid.dtype == torch.bool else grid > torch.finfo(grid.dtype).min / 2


def _attend_padded(
    module: nn.Module,
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    counts: torch.Tensor,
    scaling: float | None,
) -> torch.Tensor:
    """One SDPA call for ``r`` queries [r, heads, head_dim], each over the first ``counts[i]`` of its keys
    [r or 1, kv_heads, padded, head_dim]; the rest are masked. Returns [r, heads, head_dim].

    Each query is its own batch entry with the query heads of a key/value head as its rows, the layout
    transformers uses for one-token passes, so the kernel computes every entry alone, the same way in every call.
    """
    rows, heads, head_dim = query.shape
    kv_heads, padded = keys.shape[1], keys.shape[2]
    grouped = query.reshape(rows, kv_heads, heads // kv_heads, head_dim)
    mask = (torch.arange(padded) < counts[:, None]).view(rows, 1, 1, padded)
    out = torch.nn.functional.scaled_dot_product_attention(
        grouped, keys.expand(rows, -1, -1, -1), values.expand(rows, -1, -1, -1), attn_mask=mask, scale=scaling
    )
    return out.reshape(rows, heads, head_dim)


def _padded_length(count: int) -> int:
    return -(-count // KEY_BUCKET) * KEY_BUCKET


def _pad_keys(states: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` keys (or values) [1, kv_heads, n, head_dim], zero-padded when there are fewer."""
    if states.shape[2] >= length:
        return states[:, :, :length]
    return torch.nn.functional.pad(states, (0, 0, 0, length - states.shape[2]))


@dataclass(frozen=True)
class _KeyGroup:
    """Queries of a pass whose keys pad to the same length, read in one call: their rows, that padded length, and
    for tree rows the keys each reads after the ``shared`` leading keys they all see (indices into those keys after
    the shared ones, with one past the end for a masked zero key), None when each row reads a prefix of the keys."""

    rows: torch.Tensor
    length: int
    tail: torch.Tensor | None
    shared: int


@dataclass(frozen=True)
class _KeyPlan:
    """How each query of a pass reads its keys: the same in every layer, so made once per pass. It depends on the
    mask's values alone (a copy is kept), so a pass whose mask equals the last one's reuses it."""

    mask: torch.Tensor | None
    q_length: int
    kv_length: int
    counts: torch.Tensor
    groups: tuple[_KeyGroup, ...]

    def fits(self, mask: torch.Tensor | None, q_length: int, kv_length: int) -> bool:
        if self.q_length != q_length or self.kv_length != kv_length or (mask is None) != (self.mask is None):
            return False
        return mask is None or (mask.shape == self.mask.shape and mask.dtype == self.mask.dtype
                                and mask.device == self.mask.device and torch.equal(mask, self.mask))


def _key_plan(mask: torch.Tensor | None, q_length: int, kv_length: int) -> _KeyPlan:
    visible = _visible_keys(mask, q_length, kv_length)
    counts = visible.sum(-1)
    leading = visible.to(torch.int32).cumprod(-1).sum(-1)  # per query, how many keys it sees before a masked one
    lengths = [_padded_length(int(count)) for count in counts]
    groups = []
    for length in sorted(set(lengths)):
        same = [row for row, row_length in enumerate(lengths) if row_length == length]
        prefix = [row for row in same if leading[row] == counts[row]]
        if prefix:  # queries that read a prefix of the keys (a chain, a tree's first path) share them
            groups.append(_KeyGroup(torch.tensor(prefix), length, None, 0))
        if len(prefix) == len(same):
            continue
        # the other tree nodes: each reads the keys all of them see, then its own (ancestors, itself) in order
        rows = torch.tensor([row for row in same if leading[row] != counts[row]])
        shared = int(leading[rows].min())
        index = torch.arange(shared, kv_length)
        ranked = torch.where(visible[rows, shared:], index, index + kv_length).sort(-1).values[:, : length - shared]
        tail = torch.full((len(rows), length - shared), kv_length)
        tail[:, : ranked.shape[1]] = ranked
        groups.append(_KeyGroup(rows, length, tail.clamp(max=kv_length) - shared, shared))
    return _KeyPlan(None if mask is None else mask.clone(), q_length, kv_length, counts, tuple(groups))


#: the last pass's plan: the layers of one pass share their mask, so all but the first reuse it
_last_plan: _KeyPlan | None = None


def _gather_keys(states: torch.Tensor, group: _KeyGroup) -> torch.Tensor:
    """A tree group's keys (or values) [r, kv_heads, length, head_dim]: the shared ones, then each row's own."""
    _, kv_heads, _, head_dim = states.shape
    gathered = states.new_empty(len(group.rows), kv_heads, group.length, head_dim)
    gathered[:, :, : group.shared] = states[0, :, : group.shared]
    own = torch.cat([states[0, :, group.shared :], states.new_zeros(kv_heads, 1, head_dim)], dim=1)
    gathered[:, :, group.shared :] = own[:, group.tail].transpose(0, 1)
    return gathered


def row_wise_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Scaled dot-product attention in which every query is computed alone, over exactly the keys it may see.

    A query's result is then the same function of the same tensors whether its pass holds 1 or 16 tokens: the
    batch invariance exact speculative decoding needs (the stock kernels split and order their sums by the number
    of queries). Each query sees its keys as a one-token pass at its position would (the same keys in the same
    order, gathered for tree masks), padded with masked zeros to a multiple of :data:`KEY_BUCKET`, so that a
    one-token pass and the rows of a verify pass make calls of the same shape; queries whose padded lengths agree
    share one call. Which keys each query reads is worked out once per pass, not per layer. Long passes (prefills)
    and batches of several sequences go to the stock SDPA path.
    """
    global _last_plan
    batch, _, q_length, _ = query.shape
    if q_length > ROW_WISE_MAX_QUERIES or batch != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    kv_length = key.shape[2]
    plan = _last_plan
    if plan is None or not plan.fits(attention_mask, q_length, kv_length):
        plan = _last_plan = _key_plan(attention_mask, q_length, kv_length)
    queries = query[0].transpose(0, 1)  # [q_length, heads, head_dim]
    out = torch.empty_like(queries)
    for group in plan.groups:
        if group.tail is None:
            row_keys, row_values = _pad_keys(key, group.length), _pad_keys(value, group.length)
        else:
            row_keys, row_values = _gather_keys(key, group), _gather_keys(value, group)
        out[group.rows] = _attend_padded(module, queries[group.rows], row_keys, row_values,
                                         plan.counts[group.rows], scaling)
    return out.unsqueeze(0), None


AttentionInterface.register(ROW_WISE_ATTENTION, row_wise_attention)
AttentionMaskInterface.register(ROW_WISE_ATTENTION, sdpa_mask)  # the masks SDPA gets; rows read them above
