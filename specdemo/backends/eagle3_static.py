"""The EAGLE-3 head's steps on a static KV cache, compiled with the target's passes (``--compile``).

Where :class:`~specdemo.backends.eagle3_head.HeadKVCache` grows its buffers and attends over the positions written,
:class:`StaticHeadCache` keeps one pair of buffers per head, sized once and reused race after race (so compiled
graphs keep their inputs), writes a step's keys and values at the slots it is given (a tensor: one graph serves every
position) and attends over the whole buffer under a mask over it, as :class:`~specdemo.backends.static_lm.StaticLM`
does for a model. A draft step over a few rows (a tree's frontier, a chain's one token) runs as one compiled graph
(CUDA graphs on a GPU, where an eager step is a few dozen kernel launches; inductor on a CPU); a longer catch-up after
plain steps runs eagerly on the same buffers. The graphs count against the process's bound
(:data:`~specdemo.backends.static_lm.GRAPHS`).
"""

from __future__ import annotations

import logging
import weakref
from typing import Callable

import torch

from .eagle3_head import EagleHead
from .static_lm import GRAPHS, INDUCTOR, capacity_for, compiled

logger = logging.getLogger(__name__)

#: a head step over at most this many rows runs compiled (a tree step's frontier, a chain's one token); a longer one
#: (a catch-up after plain steps) runs eagerly
MAX_COMPILED_ROWS = 8


class _SlotWriter:
    """Where the head's attention writes one step's keys and values: at ``slots`` of the buffers, returning the whole
    buffers to attend to (the step's mask covers them)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
        self.keys, self.values, self.slots = keys, values, slots

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys.index_copy_(1, self.slots, keys)
        self.values.index_copy_(1, self.slots, values)
        return self.keys, self.values


def _head_pass(
    head: EagleHead, features: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
    visible: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
) -> torch.Tensor:
    return head(features, embeds, positions, _SlotWriter(keys, values, slots), visible)


class _HeadBuffers:
    """One head's keys and values [kv_heads, capacity, head_dim], zeroed (a masked slot is never NaN)."""

    def __init__(self, head: EagleHead, capacity: int) -> None:
        config = head.config
        shape = (config.num_key_value_heads, capacity, config.head_dim)
        self.capacity = capacity
        self.keys = torch.zeros(shape, dtype=head.dtype, device=head.device)
        self.values = torch.zeros(shape, dtype=head.dtype, device=head.device)
        if head.device.type == "cuda":  # CUDA graphs write into them in place (on a CPU, inductor's freezing
            # would fold a static input into the graph as a constant)
            torch._dynamo.mark_static_address(self.keys)
            torch._dynamo.mark_static_address(self.values)


#: each head's buffers, keyed weakly by the head (freed with it)
_BUFFERS: "weakref.WeakKeyDictionary[EagleHead, _HeadBuffers]" = weakref.WeakKeyDictionary()


def _buffers_for(head: EagleHead, max_tokens: int) -> _HeadBuffers:
    """The head's buffers when they hold ``max_tokens`` and the longest draft, else larger ones in their place."""
    current = _BUFFERS.get(head)
    if current is None or current.capacity < capacity_for(max_tokens):
        current = _BUFFERS[head] = _HeadBuffers(head, capacity_for(max_tokens))
    return current


class StaticHeadCache:
    """The head's cache for one sequence of at most ``max_tokens`` positions on its static buffers, its short steps
    compiled with ``compile_mode`` (None: eager): what :class:`~specdemo.backends.eagle3_head.HeadKVCache` offers a
    drafter (``length``, ``crop``, ``step``)."""

    def __init__(self, head: EagleHead, max_tokens: int, compile_mode: str | None = None) -> None:
        self.compile_mode = compile_mode
        self.length = 0
        self._buffers = _buffers_for(head, max_tokens)
        self.capacity = self._buffers.capacity
        self._device = head.device

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)

    def step(
        self, head: EagleHead, features: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor,
        visible: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``head`` over these rows after the cached ones (``visible`` [n, cached + n], None: causal), written at the
        next slots of the buffers."""
        count = int(features.shape[0])
        if self.length + count > self.capacity:
            raise ValueError(f"a head step over {count} rows after {self.length} does not fit its static cache of "
                             f"{self.capacity}")
        mask = torch.zeros(count, self.capacity, dtype=torch.bool, device=self._device)
        if visible is None:
            mask[:, : self.length] = True
            mask[:, self.length : self.length + count] = torch.ones(count, count, dtype=torch.bool,
                                                                         device=self._device).tril()
        else:
            mask[:, : visible.shape[1]] = visible
        slots = self.length + torch.arange(count, device=self._device)
        outputs = self._runner(head, count)(head, features, embeds, positions, slots, mask, self._buffers.keys,
                                            self._buffers.values)
        self.length += count
        return outputs

    def _runner(self, head: EagleHead, rows: int) -> Callable[..., torch.Tensor]:
        """The compiled step for ``rows`` when compiling, the rows are few and the graph bound allows; else eager."""
        if self.compile_mode is None or rows > MAX_COMPILED_ROWS:
            return _head_pass
        if self.compile_mode == INDUCTOR:  # dynamic shapes: one graph for a row, one for more, on any buffers
            key: tuple = ("eagle head", id(head), min(rows, 2), self.compile_mode)
        else:  # CUDA graphs: one per row count, on these buffers
            key = ("eagle head", id(head), id(self._buffers), rows, self.compile_mode)
        if not GRAPHS.admit(key):
            logger.info("compiled graph bound (%d) reached: a %d-row head step runs eagerly", GRAPHS.limit, rows)
            return _head_pass
        return compiled(_head_pass, self.compile_mode)
