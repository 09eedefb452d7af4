"""The transformers implementation of :class:`specdemo.core.protocol.LanguageModel`: a Hugging Face causal LM
with one sequence's KV cache, which rolls back and keeps the accepted path of a token tree."""

from __future__ import annotations

import inspect
import logging
from typing import Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from ..core.protocol import TargetPass
from ..core.tree import is_chain, tree_attention_mask, tree_depths

logger = logging.getLogger(__name__)


def cache_keyword(model: PreTrainedModel) -> str:
    """The name under which ``model``'s forward takes its KV cache: ``cache`` from transformers 5.24 on,
    ``past_key_values`` before (an unknown keyword would be swallowed by ``**kwargs`` and the cache never filled)."""
    parameters = inspect.signature(model.forward).parameters
    return "cache" if "cache" in parameters or "past_key_values" not in parameters else "past_key_values"


def chosen_hidden_states(
    states: tuple[torch.Tensor, ...], count: int, all_rows: bool, hidden_layers: Sequence[int] | None
) -> torch.Tensor:
    """The hidden states a pass returns, from transformers' ``output_hidden_states`` of a pass whose first
    ``count`` rows are its tokens (the rest padding, if any): the final states [count, H] (the last row's only
    unless ``all_rows``), or those of ``hidden_layers`` side by side [count, len(hidden_layers) * H], every row."""
    if hidden_layers is None:
        hidden = states[-1][0, :count]
        return hidden if all_rows else hidden[-1:]
    if any(not 0 <= layer < len(states) for layer in hidden_layers):
        raise ValueError(f"hidden layers {tuple(hidden_layers)} asked of a model with {len(states)} hidden states "
                         "(the embeddings and one per decoder layer)")
    return torch.cat([states[layer][0, :count] for layer in hidden_layers], dim=-1)


class CachedLM:
    """Wraps a Hugging Face causal LM and one sequence's KV cache (batch size 1): a
    :class:`~specdemo.core.protocol.LanguageModel`.

    ``forward(ids)`` appends ``ids`` (1-D) to the cached sequence and returns logits [n, V] (or [1, V] for the
    last position only); ``rollback(n)`` forgets the last n cached positions (``cache.crop(-n)``), so rejected
    draft tokens are never recomputed from the prompt.
    """

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.cache: DynamicCache | None = None
        self.length = 0
        self._cache_keyword = cache_keyword(model)

    def reset(self) -> None:
        self.cache = DynamicCache(config=self.model.config)
        self.length = 0

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, all_logits: bool = True) -> torch.Tensor:
        if self.cache is None:
            self.reset()
        out = self.model(
            input_ids=input_ids.view(1, -1).to(self.device),
            **{self._cache_keyword: self.cache},
            use_cache=True,
            logits_to_keep=0 if all_logits else 1,
        )
        self.length += int(input_ids.numel())
        return out.logits[0]

    @torch.inference_mode()
    def run(
        self,
        input_ids: torch.Tensor,
        all_logits: bool = True,
        parents: Sequence[int] | None = None,
        with_hidden: bool = True,
        hidden_layers: Sequence[int] | None = None,
    ) -> TargetPass:
        """One pass over ``input_ids`` after the cached sequence, returning logits and (``with_hidden``) the final
        hidden states; the plain baseline asks for none, so it does exactly what ``generate`` does.

        ``hidden_layers`` (with ``with_hidden``): the hidden states of these layers instead, concatenated
        ([n, len(hidden_layers) * H], for every new token even when ``all_logits`` is False): indices into
        transformers' ``output_hidden_states`` (0 the embeddings, i the output of decoder layer i; the last, the
        final post-norm state). EAGLE-3 reads three of them.

        ``parents``: the new tokens form a tree (``parents[i]`` is the index of token i's parent among the new
        tokens, -1 for a token that follows the cached sequence): each token attends to the cache and its own
        ancestors only, at position ``cached + depth``. None = a chain (the usual causal pass).
        """
        if self.cache is None:
            self.reset()
        ids = input_ids.view(1, -1).to(self.device)
        extra: dict = {}
        if parents is not None and not is_chain(parents):
            if len(parents) != ids.shape[1]:
                raise ValueError(f"{len(parents)} parents for {ids.shape[1]} tokens")
            depths = torch.tensor(tree_depths(parents), device=self.device)
            extra["position_ids"] = (self.length + depths).view(1, -1)
            extra["attention_mask"] = tree_attention_mask(parents, self.length, self.model.dtype, self.device)
        out = self.model(
            input_ids=ids,
            **{self._cache_keyword: self.cache},
            use_cache=True,
            logits_to_keep=0 if all_logits else 1,
            output_hidden_states=with_hidden,
            **extra,
        )
        count = int(ids.shape[1])
        self.length += count
        if not with_hidden or out.hidden_states is None:
            return TargetPass(out.logits[0], None)
        return TargetPass(out.logits[0], chosen_hidden_states(out.hidden_states, count, all_logits, hidden_layers))

    @torch.inference_mode()
    def keep(self, num_new: int, rows: Sequence[int]) -> None:
        """Of the last ``num_new`` cached positions keep only ``rows`` (indices among them, ascending): the
        accepted path of a tree. A prefix of rows is a plain crop."""
        rows = list(rows)
        if rows == list(range(len(rows))):
            self.rollback(num_new - len(rows))
            return
        if self.cache is None or num_new > self.length:
            raise ValueError(f"cannot keep rows of {num_new} new positions in a cache of {self.length}")
        base = self.length - num_new
        index = torch.tensor(rows, dtype=torch.long, device=self.device) + base
        for layer in self.cache.layers:
            if not hasattr(layer, "keys") or getattr(layer, "is_sliding", False):
                raise NotImplementedError("keeping a tree path needs a full-attention cache")
            # the kept rows move up behind the prefix (only the new rows are copied), the rest is cut off
            layer.keys[:, :, base : base + len(rows)] = layer.keys.index_select(2, index)
            layer.values[:, :, base : base + len(rows)] = layer.values.index_select(2, index)
            layer.keys = layer.keys[:, :, : base + len(rows)]
            layer.values = layer.values[:, :, : base + len(rows)]
        self.length = base + len(rows)

    @torch.inference_mode()
    def hidden_states(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Final hidden states [n, H] of the base model (no LM head), extending the cache like ``forward``."""
        if self.cache is None:
            self.reset()
        base = self.model.base_model
        out = base(input_ids=input_ids.view(1, -1).to(self.device), **{cache_keyword(base): self.cache},
                   use_cache=True)
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
