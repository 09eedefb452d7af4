"""The EAGLE-3 head's model (Li et al. 2025, arXiv 2503.01840): one Llama-style decoder layer on the target's own
features, and the number formats it can run in on a CPU.

The head reads the target's hidden states of three layers (by default the outputs of decoder layers 2, L // 2 and
L - 3 of L, as EAGLE-3's reference code and speculators choose them; indices into transformers'
``output_hidden_states``), side by side [3H], and ``fc`` (3H -> H, no bias) makes them the feature g_t of position t.
Its one Llama-style decoder layer reads, at position t, concat(input_layernorm(embed(x_{t+1})), hidden_norm(g_t))
[2H] into attention (RoPE, a KV cache of its own) with g_t as the residual stream, then the usual post-attention
norm, SwiGLU MLP and residual; a final norm and an LM head over a draft vocabulary (the most frequent target ids;
``draft_ids`` maps a draft index to its target id) give the distribution of x_{t+2}. The embedding is the target's
own, frozen and shared. The checkpoint layouts it loads from are :mod:`specdemo.backends.eagle3_checkpoint`'s; the
drafter that grows trees with it is :mod:`specdemo.methods.eagle`'s.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch
from torch import nn
from transformers.activations import ACT2FN

from ..core.clock import now
from .formats import W8A8, W8A8Linear, replace_linear_layers, share_inputs

logger = logging.getLogger(__name__)

#: the formats a head may run in beside an int8 or w8a8 target on a CPU: whichever drafts fastest on this machine
#: (:func:`fastest_head_format`); "w8a8" is float32 with every linear layer in w8a8's integer kernels, two-part
#: activations (see :func:`head_in_format`), where the CPU has them. Beside every other target the head runs in the
#: target's own dtype. A head's format changes what a draft costs, never what the target writes.
CPU_HEAD_FORMATS = ("float32", "bfloat16", "w8a8")


def default_hidden_layers(num_layers: int) -> tuple[int, int, int]:
    """The target layers an EAGLE-3 head reads by default: 2, L // 2 and L - 3 (indices into
    ``output_hidden_states``: the outputs of those decoder layers), kept inside 0..L for tiny test models."""
    return tuple(sorted((min(2, num_layers), num_layers // 2, max(num_layers - 3, 0))))  # type: ignore[return-value]


@dataclass(frozen=True)
class EagleConfig:
    """The head's shape. ``vocab_size``: the target vocabulary it drafts for (``t2d``'s length); ``hidden_layers``:
    the target states ``fc`` reads (indices into ``output_hidden_states``); ``verifier``: the target it was trained
    for ("" unknown); ``shared_lm_head``: its LM head is the target's own rows at the draft ids (not stored)."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    draft_vocab_size: int
    hidden_layers: tuple[int, ...]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 32768
    attention_bias: bool = False
    qk_norm: bool = False  # Qwen3-style RMSNorm on queries and keys
    norm_before_residual: bool = False  # the residual stream is hidden_norm(g) rather than g (speculators' option)
    norm_before_fc: bool = False  # one RMSNorm over the concatenated states before fc (speculators' gpt-oss heads)
    hidden_act: str = "silu"
    shared_lm_head: bool = False
    verifier: str = ""
    verifier_architectures: tuple[str, ...] = ()

    @property
    def num_features(self) -> int:
        return len(self.hidden_layers)

    def parameter_count(self) -> int:
        """The head's own parameters (the embedding is the target's): with k target layers, hidden size H, h query
        and kv key-value heads of width d, MLP width I and V_draft draft ids,
        k*H*H (fc) + 2H*d*(h + 2*kv) + h*d*H (attention) + 3*H*I (MLP) + 4H (norms) + H*V_draft (the LM head,
        none when it is the target's rows), plus the optional biases and norms."""
        hidden, heads, kv_heads, head_dim = (self.hidden_size, self.num_attention_heads, self.num_key_value_heads,
                                             self.head_dim)
        count = self.num_features * hidden * hidden + 2 * hidden * head_dim * (heads + 2 * kv_heads)
        count += heads * head_dim * hidden + 3 * hidden * self.intermediate_size + 4 * hidden
        count += 0 if self.shared_lm_head else hidden * self.draft_vocab_size
        count += head_dim * (heads + 2 * kv_heads) + hidden if self.attention_bias else 0
        count += 2 * head_dim if self.qk_norm else 0
        count += self.num_features * hidden if self.norm_before_fc else 0
        return count



class _RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        dtype = hidden.dtype
        hidden = hidden.float()
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * hidden.to(dtype)


class KeyValueWriter(Protocol):
    """Where the head's attention writes a pass's keys and values: it returns every key and value to attend to."""

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


class HeadKVCache:
    """The head's keys and values [kv_heads, positions, head_dim] in buffers that grow by doubling; ``crop`` drops
    the drafted positions at no cost."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.length = 0

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        needed = self.length + keys.shape[1]
        if self.keys is None or self.values is None or needed > self.keys.shape[1]:
            capacity = max(needed, 64, 2 * (self.keys.shape[1] if self.keys is not None else 0))
            grown_keys = keys.new_empty(keys.shape[0], capacity, keys.shape[2])
            grown_values = values.new_empty(values.shape[0], capacity, values.shape[2])
            if self.keys is not None and self.values is not None:
                grown_keys[:, : self.length] = self.keys[:, : self.length]
                grown_values[:, : self.length] = self.values[:, : self.length]
            self.keys, self.values = grown_keys, grown_values
        self.keys[:, self.length : needed] = keys
        self.values[:, self.length : needed] = values
        self.length = needed
        return self.keys[:, :needed], self.values[:, :needed]

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)

    def step(
        self, head: "EagleHead", features: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor,
        visible: torch.Tensor | None = None, all_logits: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``head`` over these rows after the cached ones (see :meth:`EagleHead.forward`), extending this cache: its
        outputs [n, H] and its scores over the draft vocabulary (every row's, else the last row's)."""
        outputs = head(features, embeds, positions, self, visible)
        return outputs, head.logits(outputs if all_logits else outputs[-1:])


def _rotate_half(states: torch.Tensor) -> torch.Tensor:
    first, second = states.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class _Attention(nn.Module):
    """Attention whose queries, keys and values read the 2H input; RoPE; grouped key-value heads."""

    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        width, heads, kv_heads, head_dim = (2 * config.hidden_size, config.num_attention_heads,
                                            config.num_key_value_heads, config.head_dim)
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(width, heads * head_dim, bias=config.attention_bias)
        self.k_proj = nn.Linear(width, kv_heads * head_dim, bias=config.attention_bias)
        self.v_proj = nn.Linear(width, kv_heads * head_dim, bias=config.attention_bias)
        self.o_proj = nn.Linear(heads * head_dim, config.hidden_size, bias=config.attention_bias)
        self.q_norm = _RMSNorm(head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = _RMSNorm(head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(
        self,
        inputs: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KeyValueWriter | None,
        visible: torch.Tensor | None,
    ) -> torch.Tensor:
        count = inputs.shape[0]
        queries = self.q_proj(inputs).view(count, self.heads, self.head_dim)
        keys = self.k_proj(inputs).view(count, self.kv_heads, self.head_dim)
        values = self.v_proj(inputs).view(count, self.kv_heads, self.head_dim).transpose(0, 1)
        if self.q_norm is not None and self.k_norm is not None:
            queries, keys = self.q_norm(queries), self.k_norm(keys)
        queries, keys = queries.transpose(0, 1), keys.transpose(0, 1)  # [heads, n, head_dim]
        queries = queries * cos + _rotate_half(queries) * sin
        keys = keys * cos + _rotate_half(keys) * sin
        if cache is not None:
            keys, values = cache.append(keys, values)
        groups = self.heads // self.kv_heads
        if groups > 1:
            keys, values = keys.repeat_interleave(groups, dim=0), values.repeat_interleave(groups, dim=0)
        attended = nn.functional.scaled_dot_product_attention(
            queries[None], keys[None], values[None], attn_mask=visible, scale=self.head_dim**-0.5
        )[0]
        return self.o_proj(attended.transpose(0, 1).reshape(count, self.heads * self.head_dim))


class _MLP(nn.Module):
    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act = ACT2FN[config.hidden_act]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(hidden)) * self.up_proj(hidden))


class _DecoderLayer(nn.Module):
    """The one decoder layer: its input is concat(input_layernorm(embedding), hidden_norm(feature)), its residual
    stream the feature."""

    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        self.norm_before_residual = config.norm_before_residual
        self.input_layernorm = _RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = _RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = _Attention(config)
        self.post_attention_layernorm = _RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = _MLP(config)

    def forward(
        self,
        embeds: torch.Tensor,
        features: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KeyValueWriter | None,
        visible: torch.Tensor | None,
    ) -> torch.Tensor:
        normed = self.hidden_norm(features)
        residual = normed if self.norm_before_residual else features
        inputs = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        hidden = residual + self.self_attn(inputs, cos, sin, cache, visible)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


def _inverse_frequencies(config: EagleConfig) -> tuple[torch.Tensor, float]:
    """RoPE's inverse frequencies and attention scaling for the head's rope settings (transformers' own rules,
    scaling types such as Llama 3's included)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    layer_config = LlamaConfig(
        hidden_size=config.num_attention_heads * config.head_dim,
        num_attention_heads=config.num_attention_heads,
        head_dim=config.head_dim,
        rope_theta=config.rope_theta,
        rope_scaling=dict(config.rope_scaling) if config.rope_scaling else None,
        max_position_embeddings=config.max_position_embeddings,
    )
    rotary = LlamaRotaryEmbedding(layer_config)
    return rotary.inv_freq.detach().float().clone(), float(rotary.attention_scaling)


class EagleHead(nn.Module):
    """The EAGLE-3 head. :meth:`features` turns the target's states [n, k*H] into features [n, H]; :meth:`forward`
    runs the layer over (feature, token embedding) pairs at their positions (extending ``cache`` when given) and
    returns its outputs before the final norm [n, H]; :meth:`logits` scores outputs over the draft vocabulary.
    ``draft_ids`` [V_draft]: the target id of each draft index."""

    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        self.config = config
        width = config.num_features * config.hidden_size
        self.input_norm = _RMSNorm(width, config.rms_norm_eps) if config.norm_before_fc else None
        self.fc = nn.Linear(width, config.hidden_size, bias=False)
        self.midlayer = _DecoderLayer(config)
        self.norm = _RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.register_buffer("draft_ids", torch.arange(config.draft_vocab_size), persistent=False)
        self._inv_freq, self._rope_scaling = _inverse_frequencies(config)
        #: seconds of a draft step in each format tried at load (see :func:`fastest_head_format`), else None
        self.format_seconds: dict[str, float] | None = None

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        return self.config.hidden_layers

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the head computes in (its norms'; its linear layers may hold int8 weights)."""
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def number_format(self) -> str:
        """The format the head runs in, as ``--dtype`` spells formats: "w8a8" or its dtype's name."""
        if isinstance(self.fc, W8A8Linear):
            return W8A8
        return str(self.dtype).removeprefix("torch.")

    def features(self, target_states: torch.Tensor) -> torch.Tensor:
        """The feature g_t of each row of the target's concatenated states."""
        states = target_states.to(self.dtype)
        return self.fc(self.input_norm(states) if self.input_norm is not None else states)

    def forward(
        self,
        features: torch.Tensor,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        cache: "HeadKVCache | KeyValueWriter | None" = None,
        visible: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The layer's outputs [n, H] for features [n, H] and token embeddings [n, H] at ``positions`` [n].
        ``visible`` [n, cached + n] (True: attend): None = causal over the new rows after everything cached (a
        :class:`HeadKVCache`'s; another writer is always given a mask)."""
        dtype = self.dtype
        count = features.shape[0]
        if visible is None and count > 1:
            cached = cache.length if isinstance(cache, HeadKVCache) else 0
            visible = torch.ones(count, cached + count, dtype=torch.bool, device=features.device)
            visible[:, cached:] = torch.ones(count, count, dtype=torch.bool, device=features.device).tril()
        frequencies = positions.to(torch.float32)[:, None] * self._inv_freq.to(positions.device)[None]
        angles = torch.cat([frequencies, frequencies], dim=-1)
        cos, sin = (angles.cos() * self._rope_scaling).to(dtype), (angles.sin() * self._rope_scaling).to(dtype)
        return self.midlayer(embeds.to(dtype), features.to(dtype), cos, sin, cache, visible)

    def logits(self, outputs: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(outputs))


def head_in_format(head: EagleHead, fmt: str) -> EagleHead:
    """``head`` in ``fmt`` (one of :data:`CPU_HEAD_FORMATS`): a dtype, or "w8a8", a float32 copy whose linear layers
    are :class:`~specdemo.backends.formats.W8A8Linear` with two-part activations (about 14 bits; a head step reads a
    quarter of float32's bytes). ``head`` itself where it is in that dtype already."""
    if fmt != W8A8:
        dtype = getattr(torch, fmt)
        return head if head.dtype == dtype else copy.deepcopy(head).to(dtype)
    quantised = copy.deepcopy(head).float()
    share_inputs(quantised, lambda linear: W8A8Linear(linear, two_parts=True))  # q, k, v and gate, up: one call each
    replace_linear_layers(quantised, lambda linear, _: W8A8Linear(linear, two_parts=True))
    return quantised


@torch.inference_mode()
def fastest_head_format(head: EagleHead, formats: Sequence[str], context: int = 256, repeats: int = 5,
                        tree_rows: int = 4) -> EagleHead:
    """Of ``formats``, the head in the one in which it drafts fastest here: the median seconds of a one-row chain
    step plus a ``tree_rows``-row tree step, after ``context`` cached positions, each with its logits. A head's
    format never changes what the target writes, only what a draft costs; measured because it depends on the CPU
    (native bfloat16 or not) and on the kernels torch dispatches to, in about a second."""
    hidden = head.config.hidden_size
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randn(rows, hidden, generator=generator) for rows in (context, 1, tree_rows)]
    seconds: dict[str, float] = {}
    fastest: EagleHead | None = None
    for fmt in formats:
        trial = head_in_format(head, fmt)
        cache = HeadKVCache()
        trial(inputs[0], inputs[0], torch.arange(context), cache)
        times = []
        for _ in range(repeats + 1):  # the first a warm-up
            started = now(torch.device("cpu"))
            for rows in inputs[1:]:
                trial.logits(trial(rows, rows, torch.full((rows.shape[0],), context), cache)).float()
                cache.crop(context)
            times.append(now(torch.device("cpu")) - started)
        seconds[fmt] = sorted(times[1:])[repeats // 2]
        if min(seconds, key=seconds.__getitem__) == fmt:
            fastest = trial
        del trial
    if fastest is None:
        raise ValueError("no head format to measure")
    fastest.format_seconds = dict(seconds)
    logger.info("EAGLE head steps: %s; running it in %s", ", ".join(
        f"{fmt} {value * 1000:.1f} ms" for fmt, value in seconds.items()), fastest.number_format)
    return fastest


