"""Medusa heads' model (Cai et al. 2024, Medusa-1): extra prediction heads on the target's own last hidden state.

Head k (1-based) guesses the token k + 1 positions ahead of the position whose hidden state it reads; the target's
own LM head gives the token right after. Each head is ``num_layers`` residual blocks ``h + SiLU(W h + b)`` on the
target's final (post-norm) hidden state, then an LM head: the target's own, frozen and shared (this project's
heads; optionally scored over a token subset, as the draft model's head is), or a head of its own (the layout of
FasterDecoding/Medusa's published checkpoints).

On disk (FasterDecoding's layout, which :meth:`MedusaHeads.save` writes and
:func:`specdemo.backends.medusa_checkpoint.load_heads` reads): a folder with ``config.json`` (``medusa_num_heads``,
``medusa_num_layers``, ``base_model_name_or_path``) and ``medusa_lm_head.safetensors`` (or ``.pt``) with keys
``{head}.{layer}.linear.weight|bias`` and, for heads with an LM head of their own, ``{head}.{num_layers}.weight``.
The drafter that reads them is :mod:`specdemo.methods.medusa`'s.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..core.files import file_sha256

logger = logging.getLogger(__name__)

WEIGHTS_NAMES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")


@dataclass(frozen=True)
class MedusaConfig:
    num_heads: int
    num_layers: int
    hidden_size: int
    vocab_size: int  # rows of the LM head the heads score (the target's, when it is shared)
    own_lm_head: bool = False
    head_tokens: int = 0  # score only the lowest this many ids (plus the prompt's); 0 = all
    base_model: str = ""


class ResidualBlock(nn.Module):
    """``h + SiLU(W h + b)`` with W zero-initialised, so an untrained head starts as the target's own head."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + nn.functional.silu(self.linear(hidden))


class MedusaHeads(nn.Module):
    """The heads. ``features`` maps hidden states [n, H] to each head's input to an LM head, [K, n, H];
    ``logits`` scores them with the shared LM head weight (rows ``token_ids`` only, when given) or each head's own."""

    def __init__(self, config: MedusaConfig) -> None:
        super().__init__()
        self.config = config
        self.blocks = nn.ModuleList(
            nn.Sequential(*[ResidualBlock(config.hidden_size) for _ in range(config.num_layers)])
            for _ in range(config.num_heads)
        )
        self.lm_heads = (
            nn.ModuleList(nn.Linear(config.hidden_size, config.vocab_size, bias=False) for _ in range(config.num_heads))
            if config.own_lm_head
            else None
        )

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.stack([block(hidden) for block in self.blocks])

    def logits(
        self, hidden: torch.Tensor, shared_weight: torch.Tensor | None, token_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """[K, n, V'] logits; V' = len(token_ids) when given (rows of the vocabulary), else the whole vocabulary."""
        return self.scores(self.features(hidden), shared_weight, token_ids)

    def scores(
        self, features: torch.Tensor, shared_weight: torch.Tensor | None, token_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The logits (see :meth:`logits`) of the heads' ``features`` [K, n, H]."""
        if self.lm_heads is not None:
            rows = [head(features[k]) for k, head in enumerate(self.lm_heads)]
            stacked = torch.stack(rows)
            return stacked if token_ids is None else stacked.index_select(-1, token_ids)
        if shared_weight is None:
            raise ValueError("these heads share the target's LM head: pass its weight")
        weight = shared_weight if token_ids is None else shared_weight.index_select(0, token_ids)
        return features.to(weight.dtype) @ weight.T  # an int8-weight target's head is shared as bfloat16

    # -- files ---------------------------------------------------------------------------------------------------
    def state_in_fasterdecoding_layout(self) -> dict[str, torch.Tensor]:
        state: dict[str, torch.Tensor] = {}
        for k, block in enumerate(self.blocks):
            for layer, residual in enumerate(block):
                state[f"{k}.{layer}.linear.weight"] = residual.linear.weight.detach()
                state[f"{k}.{layer}.linear.bias"] = residual.linear.bias.detach()
            if self.lm_heads is not None:
                state[f"{k}.{self.config.num_layers}.weight"] = self.lm_heads[k].weight.detach()
        return state

    def save(self, folder: Path, dtype: torch.dtype = torch.bfloat16, extra: dict | None = None) -> str:
        """Write config.json and medusa_lm_head.safetensors; returns the weights file's sha256."""
        from safetensors.torch import save_file

        folder.mkdir(parents=True, exist_ok=True)
        state = {name: tensor.to(dtype).contiguous() for name, tensor in self.state_in_fasterdecoding_layout().items()}
        weights = folder / WEIGHTS_NAMES[0]
        save_file(state, str(weights))
        config = {
            "medusa_num_heads": self.config.num_heads,
            "medusa_num_layers": self.config.num_layers,
            "base_model_name_or_path": self.config.base_model,
            "hidden_size": self.config.hidden_size,
            "vocab_size": self.config.vocab_size,
            "shared_lm_head": not self.config.own_lm_head,
            "head_tokens": self.config.head_tokens,
            "torch_dtype": str(dtype).replace("torch.", ""),
        }
        config.update(extra or {})
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        return file_sha256(weights)

