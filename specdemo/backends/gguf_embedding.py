"""A token embedding kept in its GGUF blocks, its rows dequantised when a pass looks them up.

A pass reads one embedding row per token, so the table needs no fast layout: kept as the file's quantised blocks
(Q4_K: 0.56 bytes a value), the offline 1.5B target's 151,936 x 1,536 table takes 131 MB instead of 467 MB in
bfloat16 on disk and 933 MB in float32 in memory (the w8a8 format's activation dtype). A row is dequantised by
``gguf``'s own dequantiser, the one transformers' GGUF loader uses, rounded to bfloat16 and cast to the activation
dtype: exactly the values a table loaded in bfloat16 and cast would hold (``tests/test_gguf_convert.py``).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn


class GgufRowsEmbedding(nn.Module):
    """An ``nn.Embedding`` stand-in over a table stored as GGUF blocks ([rows, bytes per row] uint8)."""

    def __init__(self, blocks: torch.Tensor, ggml_type: int, embedding_dim: int, out_dtype: torch.dtype,
                 padding_idx: int | None = None) -> None:
        super().__init__()
        self.register_buffer("blocks", blocks)
        self.ggml_type = int(ggml_type)
        self.num_embeddings = int(blocks.shape[0])
        self.embedding_dim = int(embedding_dim)
        self.out_dtype = out_dtype
        self.padding_idx = padding_idx

    @torch.compiler.disable
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self.rows(input_ids.reshape(-1).cpu())
        return rows.reshape(*input_ids.shape, self.embedding_dim).to(input_ids.device)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows of ``ids`` (1-D), in the output dtype."""
        from gguf import GGMLQuantizationType, dequantize

        picked = self.blocks.index_select(0, ids).numpy()
        values = dequantize(picked, GGMLQuantizationType(self.ggml_type))
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).to(torch.bfloat16).to(self.out_dtype)

    @property
    def weight(self) -> torch.Tensor:
        """The whole table, dequantised (for the rare reader of ``.weight``: training, head checks)."""
        return self.rows(torch.arange(self.num_embeddings))

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, GGUF blocks (ggml type {self.ggml_type})"
