"""A second implementation of :class:`specdemo.core.protocol.LanguageModel`: one sequence in transformers'
``StaticCache``, optionally compiled with ``torch.compile``.

Where :class:`~specdemo.backends.transformers_lm.CachedLM` grows a ``DynamicCache`` and crops it, this backend
preallocates the keys and values once per model and role and never reallocates them: a rollback moves a length
pointer (the cache's own ``crop``), a tree's accepted path is moved up inside the buffers, and rejected slots are
simply overwritten by the next pass, as in gpt-fast. For CUDA graphs (and eagerly) every pass after the prompt is
padded up to one of :data:`PASS_SIZES` rows (the padding rows see the cached prefix and themselves, and nothing reads
their outputs), so a race needs a handful of graphs, one per pass size, and a one-token step costs a few launches
instead of hundreds; inductor on a CPU compiles dynamic shapes instead (see :func:`compiled_pass`). Each pass gets
its own 4D mask over the whole buffer (a chain's causal mask or a tree's ancestors), so slots beyond the sequence are
never seen.

The prompt's pass runs eagerly (its length differs from prompt to prompt). The compiled graphs are counted per
process (:class:`GraphBudget`): past the bound a pass size runs eagerly instead of compiling another graph, so a
hosted app's visitors cannot make it compile without end.
"""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from transformers import PreTrainedModel, StaticCache
from transformers.cache_utils import StaticLayer

from ..core.protocol import TargetPass
from ..core.tree import is_chain, tree_depths
from .transformers_lm import cache_keyword, chosen_hidden_states

logger = logging.getLogger(__name__)

#: the row counts a pass is padded up to: the last token and a draft of 0, 1, 2, 4, ..., 64 tokens (a pass over more
#: rows runs unpadded and eagerly)
PASS_SIZES: tuple[int, ...] = (1, 2, 3, 5, 9, 17, 33, 65)
#: ``torch.compile`` modes: CUDA graphs (a GPU), inductor (a CPU)
CUDA_GRAPHS, INDUCTOR = "reduce-overhead", "default"
#: compiled graphs one process keeps at most (pass sizes x with/without hidden states x models x capacities)
MAX_GRAPHS = 64
#: the smallest buffer a model's static cache gets (tokens); larger needs round up to a power of two
MIN_CAPACITY = 1024


def pass_size(num_tokens: int) -> int | None:
    """The padded row count of a pass over ``num_tokens`` new tokens, or None when it is larger than any."""
    return next((size for size in PASS_SIZES if size >= num_tokens), None)


def capacity_for(num_tokens: int) -> int:
    """The buffer length for a sequence of at most ``num_tokens`` tokens plus the largest padded pass, rounded up to
    a power of two (so a few capacities serve every request and each keeps its graphs)."""
    need = max(num_tokens + PASS_SIZES[-1], MIN_CAPACITY)
    return 1 << (need - 1).bit_length()


def supports_static_cache(model: PreTrainedModel) -> str | None:
    """None when ``model`` can run on this backend, else why not (one line)."""
    try:
        cache = StaticCache(config=model.config, max_cache_len=8)
    except Exception as error:  # noqa: BLE001 - a config transformers cannot build a static cache for
        return f"no static cache for {type(model).__name__}: {error}"
    if any(type(layer) is not StaticLayer for layer in cache.layers):
        return f"{type(model).__name__} has sliding-window or other non-full attention layers"
    return None


@dataclass
class GraphBudget:
    """How many compiled graphs this process has made, against :data:`MAX_GRAPHS`."""

    limit: int = MAX_GRAPHS
    made: set = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def admit(self, key: tuple) -> bool:
        """Whether the graph ``key`` may be used (already made, or one more fits)."""
        with self.lock:
            if key in self.made:
                return True
            if len(self.made) >= self.limit:
                return False
            self.made.add(key)
            return True

    def clear(self) -> None:
        with self.lock:
            self.made.clear()


GRAPHS = GraphBudget()


def _raise_dynamo_limits() -> None:
    """Let dynamo keep one entry per graph this process may make (its default of 8 recompilations of one function
    would silently fall back to eager after the eighth pass size)."""
    config = torch._dynamo.config
    config.cache_size_limit = max(config.cache_size_limit, MAX_GRAPHS)
    if hasattr(config, "accumulated_cache_size_limit"):
        config.accumulated_cache_size_limit = max(config.accumulated_cache_size_limit, MAX_GRAPHS)


def _model_pass(
    model: torch.nn.Module, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache: StaticCache,
    keyword: str, with_hidden: bool, extra: dict,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
    out = model(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=True,
                output_hidden_states=with_hidden, **{keyword: cache}, **extra)
    logits = getattr(out, "logits", None)
    if logits is None:  # a base model: its last hidden state stands in the logits' place
        return out.last_hidden_state, None
    return logits, out.hidden_states if with_hidden else None


_COMPILED: dict[tuple[Callable, str, bool], Callable] = {}


def _frozen(compiled: Callable) -> Callable:
    """``compiled`` called with inductor's freezing on (and off again after)."""
    import torch._inductor.config as inductor_config

    def call(*args: object) -> Any:
        with inductor_config.patch(freezing=True):
            return compiled(*args)

    return call


def compiled_pass(mode: str) -> Callable:
    """``_model_pass`` compiled with ``mode`` (see :func:`compiled`)."""
    return compiled(_model_pass, mode)


def compiled(function: Callable, mode: str, dynamic: bool = True) -> Callable:
    """``function`` (a pass of a module) compiled with ``mode``, once per function, mode and process; the graphs
    themselves are made on first use of each shape (``dynamic``: with inductor, one graph for one row and one for
    more, else one per row count).

    ``"reduce-overhead"`` (:data:`CUDA_GRAPHS`): CUDA graphs, one per padded pass size. ``"default"``
    (:data:`INDUCTOR`, on a CPU): inductor with the weights frozen into the graph, with dynamic shapes (one graph for
    one row, one for every larger pass). Freezing is what pays on a CPU: the linear layers then run on weights
    prepacked for oneDNN (a Qwen2.5-1.5B bfloat16 pass after 300 tokens, AMD EPYC, 2 cores: one token 145 ms
    instead of 235 ms eager, five tokens 129 ms instead of 189 ms; without freezing, no faster than eager). Each
    frozen graph holds its own packed copy of the weights, hence dynamic shapes: two graphs, two copies, not one per
    pass size. Freezing is a process-wide setting of inductor's, read while a call traces and compiles: it is on
    only around these calls (``generate``'s own compilation, the bench's ``hf-static``, stays stock)."""
    key = (function, mode, dynamic)
    if key not in _COMPILED:
        _raise_dynamo_limits()
        if mode == INDUCTOR:
            _COMPILED[key] = _frozen(torch.compile(function, dynamic=dynamic))
        else:
            _COMPILED[key] = torch.compile(function, mode=mode, dynamic=False)
    return _COMPILED[key]


def kept(outputs: Any, mode: str | None) -> Any:
    """A compiled call's outputs (a tensor, a tuple of them, or None) as the caller may keep them: under CUDA graphs
    they live in the graph's memory pool and the next replay of that graph overwrites them (torch then refuses to
    read them), so they are copied out; inductor's outputs on a CPU are the caller's already."""
    if mode != CUDA_GRAPHS or outputs is None:
        return outputs
    if isinstance(outputs, tuple):
        return tuple(kept(item, mode) for item in outputs)
    return outputs.clone()


def forget_compiled() -> None:
    """Drop every compiled graph (models were freed: their graphs must not keep them, nor count against the bound)."""
    if GRAPHS.made:
        torch._dynamo.reset()
    _COMPILED.clear()
    GRAPHS.clear()


class _Buffers:
    """One model's static cache at one capacity, kept across sequences so compiled graphs keep their inputs."""

    def __init__(self, model: PreTrainedModel, capacity: int) -> None:
        self.capacity = capacity
        self.cache = StaticCache(config=model.config, max_cache_len=capacity)


#: each model's buffers, keyed weakly by the model (freed with it): {role: buffers}
_BUFFERS: "weakref.WeakKeyDictionary[PreTrainedModel, dict[str, _Buffers]]" = weakref.WeakKeyDictionary()


def _buffers_for(model: PreTrainedModel, role: str, max_tokens: int) -> _Buffers:
    """The buffers of ``model`` for ``role`` (two sequences of one model raced side by side need two) that hold
    ``max_tokens`` and the largest padded pass: the role's buffers when they do (so their graphs serve again), else
    larger ones in their place (:func:`capacity_for`)."""
    per_model = _BUFFERS.setdefault(model, {})
    current = per_model.get(role)
    if current is None or current.capacity < max_tokens + PASS_SIZES[-1]:
        per_model[role] = _Buffers(model, capacity_for(max_tokens))
    return per_model[role]


def _unmark_static(cache: StaticCache) -> None:
    """Let inductor see the cache's tensors as the inputs they are. transformers marks them static for CUDA graphs
    when it first fills them; inductor's freezing (see :func:`compiled_pass`) would then fold them into the graph
    as constants, and a compiled pass would write its keys and values, and move the length, in a copy."""
    for layer in cache.layers:
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None),
                       getattr(layer, "cumulative_length", None)):
            if tensor is not None and hasattr(tensor, "_dynamo_static_input_type"):
                del tensor._dynamo_static_input_type


class StaticLM:
    """A Hugging Face causal LM on a static KV cache, passes padded to :data:`PASS_SIZES` and, with ``compile_mode``,
    compiled: a :class:`~specdemo.core.protocol.LanguageModel` with the same methods as ``CachedLM``.

    ``max_tokens``: the longest sequence it will hold (prompt + new tokens); ``compile_mode``: None (eager), or
    ``torch.compile``'s mode (``"default"`` for inductor, ``"reduce-overhead"`` for CUDA graphs); ``role``: which
    of a model's sequences this is (the plain and the speculative side of a race each keep their own buffers, reused
    race after race so compiled graphs keep their inputs).
    """

    def __init__(
        self, model: PreTrainedModel, max_tokens: int, compile_mode: str | None = None, role: str = "target"
    ) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.compile_mode = compile_mode
        self.length = 0
        self._buffers = _buffers_for(model, role, max_tokens)
        self.capacity = self._buffers.capacity
        self._keyword = cache_keyword(model)
        self._base_keyword = cache_keyword(model.base_model)
        self._slots = torch.arange(self.capacity, device=self.device)
        #: passes are padded to :data:`PASS_SIZES` (CUDA graphs replay fixed shapes; eager, the same cache handling);
        #: inductor on a CPU compiles shapes dynamically, so a pass there holds its own rows only
        self.pads = compile_mode != INDUCTOR
        self.reset()  # the role's buffers may hold an earlier sequence (a race stopped halfway, say)

    @property
    def cache(self) -> StaticCache:
        return self._buffers.cache

    def reset(self) -> None:
        """An empty sequence: every layer's write pointer back to the start (read from each layer, so a pass that
        failed halfway through the layers leaves nothing behind)."""
        for layer in self.cache.layers:
            written = int(layer.cumulative_length)
            if written:
                layer.crop(-written)
        self.length = 0

    # -- passes ---------------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def run(
        self,
        input_ids: torch.Tensor,
        all_logits: bool = True,
        parents: Sequence[int] | None = None,
        with_hidden: bool = True,
        hidden_layers: Sequence[int] | None = None,
    ) -> TargetPass:
        """One pass over ``input_ids`` after the cached sequence (see ``CachedLM.run``)."""
        ids = input_ids.view(-1)
        logits, states = self._pass(self.model, self._keyword, ids, parents, with_hidden, all_logits)
        count = int(ids.numel())
        if not all_logits:
            logits = logits[-1:]
        if not with_hidden or states is None:
            return TargetPass(logits, None)
        return TargetPass(logits, chosen_hidden_states(states, count, all_logits, hidden_layers))

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, all_logits: bool = True) -> torch.Tensor:
        """Logits [n, V] (or [1, V]) of a pass over ``input_ids``, extending the cache (as ``CachedLM.forward``)."""
        return self.run(input_ids, all_logits=all_logits, with_hidden=False).logits

    @torch.inference_mode()
    def hidden_states(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Final hidden states [n, H] of the base model (no LM head), extending the cache."""
        states, _ = self._pass(self.model.base_model, self._base_keyword, input_ids.view(-1), None, False, True)
        return states

    def _pass(
        self, module: torch.nn.Module, keyword: str, ids: torch.Tensor, parents: Sequence[int] | None,
        with_hidden: bool, all_rows: bool,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
        """One pass of ``module`` over ``ids`` (padded), the cache advanced by the real rows only: the real rows'
        logits (or last hidden states, for a base model; the last row's only for an unpadded pass not asked for
        ``all_rows``) and every layer's states (padded) when ``with_hidden``."""
        count = int(ids.numel())
        if count == 0:
            raise ValueError("a pass needs at least one token")
        if parents is not None and len(parents) != count:
            raise ValueError(f"{len(parents)} parents for {count} tokens")
        size = None  # the prompt's pass, or one longer than any padded size: unpadded and eager
        if self.length > 0 and count <= PASS_SIZES[-1]:
            size = pass_size(count) if self.pads else count
        rows = size or count
        if self.length + rows > self.capacity:
            raise ValueError(f"a pass over {count} tokens after {self.length} does not fit this static cache of "
                             f"{self.capacity} tokens")
        padded = torch.zeros(rows, dtype=torch.long, device=self.device)
        padded[:count] = ids.to(self.device)
        positions, mask = self._positions_and_mask(count, rows, parents)
        # inductor's graphs on a CPU always return the hidden states (they cost nothing more there): one graph
        # serves a run that reads them and one that does not, and each frozen graph holds a copy of the weights
        graph_hidden = with_hidden or (self.compile_mode == INDUCTOR and size is not None and module is self.model)
        step = self._step(module, rows, graph_hidden, size is not None)
        # the prompt's pass scores its last row only (an LM head over every prompt row costs more than the pass)
        last_only = size is None and not all_rows and module is self.model
        extra = {"logits_to_keep": 1} if last_only else {}
        outputs, states = step(module, padded.view(1, -1), positions.view(1, -1), mask, self.cache, keyword,
                               graph_hidden, extra)
        states = states if with_hidden else None
        if step is not _model_pass:
            outputs, states = kept(outputs, self.compile_mode), kept(states, self.compile_mode)
        if self.compile_mode == INDUCTOR:
            _unmark_static(self.cache)
        self._advance(count, rows)
        return (outputs[0] if last_only else outputs[0, :count]), states

    def _step(self, module: torch.nn.Module, rows: int, with_hidden: bool, padded: bool) -> Callable:
        """The compiled pass for this shape when compiling and the graph budget allows, else the eager one."""
        if self.compile_mode is None or not padded:
            return _model_pass
        if self.pads:
            key: tuple = (id(module), id(self.cache), rows, with_hidden, self.compile_mode)
        else:  # inductor: one graph for one row and one for more, whichever buffers they run on
            key = (id(module), min(rows, 2), with_hidden, self.compile_mode)
        if not GRAPHS.admit(key):
            logger.info("compiled graph bound (%d) reached: a %d-row pass runs eagerly", GRAPHS.limit, rows)
            return _model_pass
        return compiled_pass(self.compile_mode)

    def _positions_and_mask(
        self, count: int, rows: int, parents: Sequence[int] | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions [rows] and an additive 4D mask [1, 1, rows, capacity] for a pass whose first ``count`` rows are
        ``ids`` (a chain, or the tree ``parents``) and the rest padding; the pass writes slots ``length + row``."""
        base = self.length
        row_slots = base + torch.arange(rows, device=self.device)
        if parents is None or is_chain(parents):
            positions = row_slots.clone()
            visible = self._slots.view(1, -1) <= row_slots.view(-1, 1)
        else:
            depths = torch.tensor(tree_depths(parents), device=self.device)
            positions = row_slots.clone()
            positions[:count] = base + depths
            visible = self._slots.view(1, -1) < base
            visible = visible.expand(rows, -1).clone()
            visible[torch.arange(rows), row_slots] = True
            ancestry = torch.zeros(count, count, dtype=torch.bool)
            for index, parent in enumerate(parents):
                if parent >= 0:
                    ancestry[index] = ancestry[parent]
                ancestry[index, index] = True
            visible[:count, base : base + count] = ancestry.to(self.device)
        dtype = self.model.dtype
        mask = torch.zeros(rows, self.capacity, dtype=dtype, device=self.device)
        mask.masked_fill_(~visible, torch.finfo(dtype).min)
        return positions, mask.view(1, 1, rows, self.capacity)

    # -- the cache ------------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def keep(self, num_new: int, rows: Sequence[int]) -> None:
        """Of the last ``num_new`` cached positions keep only ``rows`` (ascending indices among them): the kept rows
        move up behind the prefix inside the buffers; the rest is left to be overwritten."""
        rows = list(rows)
        if num_new > self.length:
            raise ValueError(f"cannot keep rows of {num_new} new positions in a cache of {self.length}")
        base = self.length - num_new
        if rows != list(range(len(rows))):
            index = torch.tensor(rows, dtype=torch.long, device=self.device) + base
            for layer in self.cache.layers:
                layer.keys[:, :, base : base + len(rows)] = layer.keys.index_select(2, index)
                layer.values[:, :, base : base + len(rows)] = layer.values.index_select(2, index)
        self._drop(num_new - len(rows))

    def rollback(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        if num_tokens > self.length:
            raise ValueError(f"cannot roll back {num_tokens} tokens from a cache of {self.length}")
        self._drop(num_tokens)

    def _advance(self, count: int, rows: int) -> None:
        """A pass wrote ``rows`` slots, of which the sequence keeps the first ``count`` (the rest was padding)."""
        self.length += rows
        self._drop(rows - count)

    def _drop(self, num_tokens: int) -> None:
        """Forget the last ``num_tokens`` positions: the cache's write pointer moves back (its ``crop`` moves it in
        place, on the device, keeping the buffers' addresses for compiled graphs)."""
        if num_tokens > 0:
            self.cache.crop(-num_tokens)
            self.length -= num_tokens
