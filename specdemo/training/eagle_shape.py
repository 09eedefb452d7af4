"""The EAGLE head's shape for a target: its config fields (the widest MLP under the size a shipped head may take),
the bytes its weights file takes and the dtype it is written in, its weights as written, its draft vocabulary and
the pass-through start."""

from __future__ import annotations

import copy

import torch

from ..backends.eagle3_checkpoint import as_written, llama_fields
from ..backends.eagle3_head import EagleConfig, EagleHead, default_hidden_layers
from ..backends.formats import output_rows

#: the most bytes the head's weights file may take (the size picked for ``--intermediate-size 0``)
MAX_HEAD_BYTES = 40_000_000
#: the dtype a head is written in where it fits :data:`MAX_HEAD_BYTES`, else its matrices go in int8 with one
#: scale per row (:func:`ship_dtype`)
SHIP_DTYPE = torch.bfloat16
#: MLP widths tried for ``--intermediate-size 0`` are multiples of this
WIDTH_STEP = 128


def head_fields(model, draft_vocab_size: int, intermediate_size: int) -> dict:
    """EagleConfig fields for a head on ``model``: its attention shape and rope, the layers EAGLE-3 reads, an
    LM head shared with the target; ``intermediate_size`` 0 picks the widest MLP that fits :data:`MAX_HEAD_BYTES`."""
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    fields = llama_fields(text.to_dict())
    vocab = output_rows(model)
    fields.update(
        vocab_size=vocab,
        draft_vocab_size=min(draft_vocab_size, vocab),
        hidden_layers=default_hidden_layers(int(text.num_hidden_layers)),
        attention_bias=False,
        shared_lm_head=True,
    )
    if intermediate_size <= 0:
        widest = int(fields["intermediate_size"]) or WIDTH_STEP  # never wider than the target's own MLP
        intermediate_size = min(WIDTH_STEP, widest)
        while intermediate_size + WIDTH_STEP <= widest and head_bytes(
            EagleConfig(**{**fields, "intermediate_size": intermediate_size + WIDTH_STEP})
        ) <= MAX_HEAD_BYTES:
            intermediate_size += WIDTH_STEP
    fields["intermediate_size"] = intermediate_size
    return fields


def head_bytes(config: EagleConfig, dtype: torch.dtype = SHIP_DTYPE) -> int:
    """About what the head's weights file takes: its parameters in ``dtype`` (int8: and a float32 scale per
    matrix row), ``d2t`` (int64) and ``t2d`` (one byte per target id), and the file's header."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    scales = 4 * matrix_rows(config) if dtype == torch.int8 else 0
    return itemsize * config.parameter_count() + scales + 8 * config.draft_vocab_size + config.vocab_size + 8192


def matrix_rows(config: EagleConfig) -> int:
    """The rows of the head's stored matrices (fc, q, k, v, o, gate, up, down; the shared LM head is not stored)."""
    hidden, heads, kv_heads = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    head_dim = config.head_dim
    return hidden + (heads + 2 * kv_heads) * head_dim + hidden + 2 * config.intermediate_size + hidden


def ship_dtype(config: EagleConfig) -> torch.dtype:
    """:data:`SHIP_DTYPE` where the head's weights fit :data:`MAX_HEAD_BYTES` in it, else int8."""
    return SHIP_DTYPE if head_bytes(config, SHIP_DTYPE) <= MAX_HEAD_BYTES else torch.int8


def as_shipped(head: EagleHead) -> EagleHead:
    """A float32 copy of ``head`` holding the weights its file will hold (rounded to :func:`ship_dtype`)."""
    shipped = copy.deepcopy(head).float()
    dtype = ship_dtype(head.config)
    with torch.no_grad():
        for name, tensor in shipped.state_dict().items():
            if not (name == "lm_head.weight" and head.config.shared_lm_head):  # the target's rows: not written
                tensor.copy_(as_written(name, tensor, dtype))
    return shipped


def draft_vocabulary(labels: torch.Tensor, size: int, vocab_size: int, eos_ids: list[int]) -> torch.Tensor:
    """The ``size`` target ids most often the target's greedy token in ``labels`` (ties: the lower id), the EOS
    ids always among them, then the lowest unused ids if too few tokens occur; sorted."""
    counts = torch.bincount(labels[labels >= 0].long(), minlength=vocab_size)[:vocab_size]
    order = torch.sort(-counts, stable=True).indices
    chosen = list(dict.fromkeys([i for i in eos_ids if 0 <= i < vocab_size] + order.tolist()))[:size]
    return torch.tensor(sorted(chosen), dtype=torch.long)


def pass_through_init(head: EagleHead) -> None:
    """Start the head as a copy of the target's top: the feature is the highest fused layer's state (the fc's
    last block the identity, the rest zero) and the decoder layer's attention and MLP add nothing yet (their
    output projections zero), so the first draft step scores what the target's LM head makes of that state."""
    size = head.config.hidden_size
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, -size:] = torch.eye(size)
        head.midlayer.self_attn.o_proj.weight.zero_()
        if head.midlayer.self_attn.o_proj.bias is not None:
            head.midlayer.self_attn.o_proj.bias.zero_()
        head.midlayer.mlp.down_proj.weight.zero_()
