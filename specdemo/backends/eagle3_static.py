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
from .static_lm import GRAPHS, INDUCTOR, capacity_for, compiled, kept

logger = logging.getLogger(__name__)

#: the row counts a compiled head step is padded up to (a chain's one token, a tree's frontier of 4, a short
#: catch-up); a longer step (a catch-up after plain steps) runs eagerly. Static shapes on both backends: inductor's
#: dynamic-shape graph of the head ran 10x slower than eager on a CPU, its static ones about 1.8x faster
COMPILED_ROWS: tuple[int, ...] = (1, 2, 3, 5)


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of the head and its scores over the draft vocabulary, every row (one graph when compiled)."""
    outputs = head(features, embeds, positions, _SlotWriter(keys, values, slots), visible)
    return outputs, head.logits(outputs)


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
        visible: torch.Tensor | None = None, all_logits: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``head`` over these rows after the cached ones (``visible`` [n, cached + n], None: causal), written at the
        next slots of the buffers: its outputs [n, H] and scores (every row's, else the last row's)."""
        count = int(features.shape[0])
        rows = next((size for size in COMPILED_ROWS if size >= count), None) if self.compile_mode else None
        run = self._runner(head, rows) if rows is not None else None
        rows = rows if run is not None else count
        if self.length + rows > self.capacity:
            raise ValueError(f"a head step over {count} rows after {self.length} does not fit its static cache of "
                             f"{self.capacity}")
        mask = self._mask(count, rows, visible)
        slots = self.length + torch.arange(rows, device=self._device)
        if run is None:  # eager: the rows asked for are scored
            writer = _SlotWriter(self._buffers.keys, self._buffers.values, slots)
            outputs = head(features, embeds, positions, writer, mask)
            logits = head.logits(outputs if all_logits else outputs[-1:])
        else:
            outputs, logits = kept(run(head, _padded(features, rows), _padded(embeds, rows), _padded(positions, rows),
                                       slots, mask, self._buffers.keys, self._buffers.values), self.compile_mode)
            outputs, logits = outputs[:count], logits[:count] if all_logits else logits[count - 1 : count]
        self.length += count
        return outputs, logits

    def _mask(self, count: int, rows: int, visible: torch.Tensor | None) -> torch.Tensor:
        """Which slots each of ``rows`` rows attends to [rows, capacity]: the step's own ``count`` rows as asked
        (None: causal after the cached ones), a padding row only itself."""
        mask = torch.zeros(rows, self.capacity, dtype=torch.bool, device=self._device)
        if visible is None:
            mask[:count, : self.length] = True
            mask[:count, self.length : self.length + count] = torch.ones(count, count, dtype=torch.bool,
                                                                         device=self._device).tril()
        else:
            mask[:count, : visible.shape[1]] = visible
        padding = torch.arange(count, rows, device=self._device)
        mask[padding, self.length + padding] = True
        return mask

    def _runner(self, head: EagleHead, rows: int) -> Callable[..., tuple[torch.Tensor, torch.Tensor]] | None:
        """The compiled step over ``rows`` (padded) rows when the graph bound allows, else None (eager)."""
        key = ("eagle head", id(head), rows, self.compile_mode)
        if self.compile_mode != INDUCTOR:  # CUDA graphs replay on these buffers' addresses
            key += (id(self._buffers),)
        if not GRAPHS.admit(key):
            logger.info("compiled graph bound (%d) reached: a %d-row head step runs eagerly", GRAPHS.limit, rows)
            return None
        return compiled(_head_pass, self.compile_mode, dynamic=False)


def _padded(rows: torch.Tensor, count: int) -> torch.Tensor:
    """``rows`` with copies of its last row appended up to ``count`` rows."""
    missing = count - rows.shape[0]
    return rows if missing == 0 else torch.cat([rows, rows[-1:].expand(missing, *rows.shape[1:])])
