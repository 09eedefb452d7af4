"""A model in an int8-weight format (``int8`` or ``w8a8``) built straight from its stored int8 weights.

A GGUF converted into the ``int8`` storage (:mod:`specdemo.backends.gguf_convert`) holds every linear layer as the
int8 values and float32 row scales :func:`~specdemo.backends.formats.int8_rows` gives its bfloat16 weights, and
everything else in bfloat16. Loading builds the model's skeleton on the meta device, makes each linear layer (or
shared-input group) the format's layer from those values, and assigns the rest: no float copy of a weight is ever
made, and the layers are bit-identical to those :func:`~specdemo.backends.formats.to_int8_format` makes from the
same model loaded in bfloat16 (``tests/test_gguf_convert.py``).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, GenerationConfig, PreTrainedModel

from . import formats
from .gguf_convert import GGUF_BLOCKS, GGUF_TYPE, INDEX_NAME, QWEIGHT, SCALE, empty_model
from .gguf_embedding import GgufRowsEmbedding

logger = logging.getLogger(__name__)


@dataclass
class StoredLinear:
    """One linear layer's stored int8 values, float32 row scales and bias (a shared-input group's stacked)."""

    qweight: torch.Tensor
    scale: torch.Tensor
    bias: torch.Tensor | None

    @property
    def in_features(self) -> int:
        return int(self.qweight.shape[1])

    @property
    def out_features(self) -> int:
        return int(self.qweight.shape[0])


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a stored folder's shards, by name."""
    from safetensors.torch import load_file

    index = json.loads((folder / INDEX_NAME).read_text(encoding="utf-8"))
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors.update({name: _aligned(tensor) for name, tensor in load_file(str(folder / shard)).items()})
    return tensors


#: the alignment torch gives its own allocations; the int8 kernels read their weights with aligned vector loads
#: (a tensor at an odd offset of a safetensors buffer crashed ``_weight_int8pack_mm``)
ALIGNMENT = 64


def _aligned(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, copied into torch's own memory when it does not start on an :data:`ALIGNMENT` boundary."""
    return tensor if tensor.data_ptr() % ALIGNMENT == 0 else tensor.clone()


def load_int8_folder(folder: Path, fmt: str, kernel: str | None = None) -> PreTrainedModel:
    """The model stored in ``folder`` (``int8`` storage), in the int8-weight format ``fmt``."""
    config = AutoConfig.from_pretrained(str(folder))
    model = empty_model(config)
    tensors = read_tensors(folder)
    names = {id(module): name for name, module in model.named_modules()}
    int8_layers_into(model, tensors, fmt, kernel)
    _embedding_from_blocks(model, names, tensors, formats.activation_dtype(fmt))
    _assign(model, tensors)
    model.generation_config = GenerationConfig.from_pretrained(str(folder))
    model.eval()
    return formats.finish_int8_format(model, fmt, bool(getattr(config, "tie_word_embeddings", False)))


def int8_layers_into(model: nn.Module, tensors: dict[str, torch.Tensor], fmt: str, kernel: str | None = None) -> None:
    """Replace ``model``'s linear layers (in w8a8 its shared-input groups first, as :func:`~specdemo.backends.
    formats.to_int8_format` does) by ``fmt``'s layers made from the int8 values, row scales and biases in
    ``tensors`` (``<layer>.qweight``, ``<layer>.scale``, ``<layer>.bias``; taken out of the dict)."""
    head = model.get_output_embeddings()
    names = {id(module): name for name, module in model.named_modules()}
    make = _layer_maker(fmt, kernel or (formats.w8a8_kernel() if fmt == formats.W8A8 else None),
                        getattr(model.config, "hidden_size", None))

    def stored(member: nn.Module) -> StoredLinear:
        prefix = names[id(member)]
        return StoredLinear(tensors.pop(f"{prefix}.{QWEIGHT}"), tensors.pop(f"{prefix}.{SCALE}"),
                            tensors.pop(f"{prefix}.bias", None))

    if fmt == formats.W8A8:
        formats.share_inputs(model, lambda group: make(group, False), stack=lambda members: _stack(
            [stored(member) for member in members]))
    formats.replace_linear_layers(model, lambda _, child: make(stored(child), child is head))


def int8_values(model: nn.Module) -> dict[str, torch.Tensor]:
    """What the int8 storage holds for ``model``'s linear layers (bfloat16 weights): each layer's int8 values and
    float32 row scales, and its bias (for :func:`int8_layers_into`; both int8-weight formats use the same)."""
    from .gguf_convert import int8_rows_of_bf16, linear_layers
    from transformers.pytorch_utils import Conv1D

    values: dict[str, torch.Tensor] = {}
    for name, layer in linear_layers(model).items():
        qweight, scale = int8_rows_of_bf16(layer.weight.detach(), transposed=isinstance(layer, Conv1D))
        values[f"{name}.{QWEIGHT}"], values[f"{name}.{SCALE}"] = qweight, scale
        if layer.bias is not None:
            values[f"{name}.bias"] = layer.bias.detach()
    return values


def _embedding_from_blocks(model: PreTrainedModel, names: dict[int, str], tensors: dict[str, torch.Tensor],
                           dtype: torch.dtype) -> None:
    """The input embedding as a :class:`GgufRowsEmbedding` when the folder keeps it in its GGUF blocks."""
    embedding = model.get_input_embeddings()
    prefix = names[id(embedding)]
    blocks = tensors.pop(f"{prefix}.{GGUF_BLOCKS}", None)
    if blocks is None:
        return
    ggml_type = int(tensors.pop(f"{prefix}.{GGUF_TYPE}"))
    model.set_input_embeddings(GgufRowsEmbedding(blocks, ggml_type, embedding.embedding_dim, dtype,
                                                 embedding.padding_idx))


def _layer_maker(fmt: str, kernel: str | None, hidden_size: int | None):  # type: ignore[no-untyped-def]
    """``make(stored, is_head)``: the format's layer for a stored linear layer, as :func:`to_int8_format` makes it
    (in w8a8, two-part rows for the head and the layers that narrow the model's width)."""
    def make(linear: StoredLinear, is_head: bool) -> nn.Module:
        if fmt == formats.INT8:
            return formats.Int8WeightLinear.from_int8(linear.qweight, linear.scale, linear.bias)
        two_parts = is_head or formats.narrows(linear, hidden_size)  # type: ignore[arg-type]
        return formats.W8A8Linear.from_int8(linear.qweight, linear.scale, linear.bias, two_parts, kernel)

    return make


def _stack(parts: list[StoredLinear]) -> StoredLinear:
    """A shared-input group's layers as one: their rows, in order (each keeps its own row scales)."""
    biases = [part.bias for part in parts]
    return StoredLinear(torch.cat([part.qweight for part in parts]), torch.cat([part.scale for part in parts]),
                        None if any(bias is None for bias in biases) else torch.cat(biases))  # type: ignore[arg-type]


def _assign(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Give the model's remaining (meta) parameters their stored values; a tensor missing is a damaged folder."""
    result = model.load_state_dict(tensors, strict=False, assign=True)
    if result.unexpected_keys:
        raise ValueError(f"the stored model has tensors the model does not: {', '.join(result.unexpected_keys[:3])}")
    missing = [name for name, param in model.named_parameters() if param.device.type == "meta"]
    if missing:
        raise ValueError(f"the stored model lacks {', '.join(missing[:3])}")
