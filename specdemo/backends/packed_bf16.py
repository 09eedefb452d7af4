"""bfloat16 linear layers with their weights packed once for oneDNN, on CPUs with native bfloat16 arithmetic.

A bfloat16 ``nn.Linear`` on a CPU goes to oneDNN's matmul (AMX tiles where the CPU has them), which takes the
weight in its plain layout and rearranges it into the blocks its kernel reads on every call. Packing each weight
into that layout once, with ``torch.ops.mkldnn._reorder_linear_weight``, and multiplying with
``torch.ops.mkldnn._linear_pointwise`` (the two ops ``torch.compile``'s freezing pass puts in place of bfloat16
linear layers on CPUs) skips the rearranging. Measured on the 2-core AMX Xeon, one 1536 x 8960 layer: 0.87 ms
for one row against 1.20 unpacked, 1.32 against 2.18 for 64 rows, 2.18 against 3.11 for 128. The kernel is the
same, and so mostly are the bits: the stock call chooses how to block its sums by the row count at every call, the
packed one once, so at some row counts they round differently (there, 1536 x 8960 at 33, 39, 48, 63-65, 100 and
127 rows of 1-128 tried; 256 x 1536 at 36, 38 and 200). Neither is batch-invariant (a row's bits can change with
the rows beside it, in both alike), which is why the exact formats are float32, int8 and w8a8, not bfloat16.

Used where many bfloat16 passes run over one model that nothing else reads the weights of: the training pool's
answers and requests (:mod:`specdemo.training.pool`). The LM head stays a plain ``nn.Linear``: its weight is tied
to the embedding table and read by the heads' trainers.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)


class PackedBF16Linear(nn.Module):
    """A bfloat16 linear layer whose weight is held in oneDNN's blocked layout (no plain copy is kept)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().to(torch.bfloat16)
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        self.bias = None if linear.bias is None else linear.bias.detach().to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [None], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def packed_bf16_available() -> bool:
    """Whether this torch build and CPU multiply bfloat16 natively in oneDNN (AVX-512 bfloat16 or AMX), where
    packing pays; elsewhere oneDNN emulates bfloat16 and the stock path is left alone."""
    try:
        return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
                and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
                and bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()))
    except (AttributeError, RuntimeError):  # pragma: no cover - a torch build without these checks
        return False


def pack_bf16_linears(model: nn.Module) -> int:
    """Replace, in place, every bfloat16 CPU ``nn.Linear`` inside the decoder of ``model`` (not the LM head) by a
    :class:`PackedBF16Linear`; how many were packed (0 where :func:`packed_bf16_available` is False)."""
    if not packed_bf16_available():
        return 0
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    packed = 0
    for parent in list(decoder.modules()):
        for name, child in list(parent.named_children()):
            if (isinstance(child, nn.Linear) and child.weight.dtype == torch.bfloat16
                    and child.weight.device.type == "cpu"):
                setattr(parent, name, PackedBF16Linear(child))
                packed += 1
    logger.info("packed %d bfloat16 linear layers for oneDNN", packed)
    return packed
