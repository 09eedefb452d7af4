"""A causal LM seen as "ids in, logits out", with a KV cache that rolls back.

The engine only talks to :class:`CachedLM`, so the algorithm can be tested on anything with the same methods.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

import torch
from transformers import DynamicCache, PreTrainedModel

logger = logging.getLogger(__name__)


class CausalLM(Protocol):
    """What the engine needs from a target model."""

    length: int

    def reset(self) -> None: ...

    def forward(self, input_ids: torch.Tensor, all_logits: bool = True) -> torch.Tensor: ...

    def rollback(self, num_tokens: int) -> None: ...


class CachedLM:
    """Wraps a Hugging Face causal LM and one sequence's KV cache (batch size 1).

    ``forward(ids)`` appends ``ids`` (1-D) to the cached sequence and returns logits [n, V] (or [1, V] for the
    last position only); ``rollback(n)`` forgets the last n cached positions (``cache.crop(-n)``), so rejected
    draft tokens are never recomputed from the prompt.
    """

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.cache: DynamicCache | None = None
        self.length = 0

    def reset(self) -> None:
        self.cache = DynamicCache(config=self.model.config)
        self.length = 0

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, all_logits: bool = True) -> torch.Tensor:
        if self.cache is None:
            self.reset()
        out = self.model(
            input_ids=input_ids.view(1, -1).to(self.device),
            cache=self.cache,
            use_cache=True,
            logits_to_keep=0 if all_logits else 1,
        )
        self.length += int(input_ids.numel())
        return out.logits[0]

    @torch.inference_mode()
    def hidden_states(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Final hidden states [n, H] of the base model (no LM head), extending the cache like ``forward``."""
        if self.cache is None:
            self.reset()
        out = self.model.base_model(input_ids=input_ids.view(1, -1).to(self.device), cache=self.cache, use_cache=True)
        self.length += int(input_ids.numel())
        return out.last_hidden_state[0]

    @torch.inference_mode()
    def rollback(self, num_tokens: int) -> None:
        if num_tokens <= 0 or self.cache is None:
            return
        if num_tokens > self.length:
            raise ValueError(f"cannot roll back {num_tokens} tokens from a cache of {self.length}")
        self.cache.crop(-num_tokens)
        self.length -= num_tokens


def now(device: torch.device) -> float:
    """Wall clock for timing device work; on CUDA waits for queued kernels first."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()
    return time.perf_counter()
