"""EAGLE-3: a one-decoder-layer draft head on the target's own features (Li et al. 2025, arXiv 2503.01840), drafting
EAGLE-2's dynamic tree under greedy settings and a chain under sampling.

The head reads the target's hidden states of three layers (by default the outputs of decoder layers 2, L // 2 and
L - 3 of L, as EAGLE-3's reference code and speculators choose them; indices into transformers'
``output_hidden_states``), side by side [3H], and ``fc`` (3H -> H, no bias) makes them the feature g_t of position t.
Its one Llama-style decoder layer reads, at position t, concat(input_layernorm(embed(x_{t+1})), hidden_norm(g_t))
[2H] into attention (RoPE, a KV cache of its own) with g_t as the residual stream, then the usual post-attention
norm, SwiGLU MLP and residual; a final norm and an LM head over a draft vocabulary (the most frequent target ids;
``d2t`` maps a draft index to its target id) give the distribution of x_{t+2}. The embedding is the target's own,
frozen and shared. Each further draft step feeds the layer's own output (before the final norm) back as the next
position's feature, with the token it has just drafted. After verification the target's features of the accepted
rows (and of the row that chose the correction or bonus) become the head's next inputs: its cache keeps committed
positions only (target features, accepted tokens) and drops the drafted ones.

Heads load from three layouts: this project's own (:func:`save_head`: ``config.json`` with ``specdemo_format``
and ``model.safetensors``), the original EAGLE-3 checkpoints (e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B: a
Llama-style ``config.json`` with ``draft_vocab_size``; ``pytorch_model.bin`` or ``model.safetensors`` with
``fc.weight``, ``midlayer.*``, ``norm.weight``, ``lm_head.weight``, ``d2t``, ``t2d``) and speculators' (``config.json``
with ``speculators_model_type: "eagle3"``, ``transformer_layer_config``, ``speculators_config.verifier``; the layer's
weights under ``layers.0.*``). In all three ``d2t[i]`` holds the offset target_id - i and ``t2d`` is a mask over the
target's vocabulary. A Hub id is fetched with huggingface_hub's snapshot download; weights are read with
safetensors or ``torch.load(weights_only=True)``, never with remote code.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import re
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn
from transformers.activations import ACT2FN

from ..backends.formats import (
    INT8,
    W8A8,
    W8A8Linear,
    output_rows,
    output_weight,
    replace_linear_layers,
    share_inputs,
    w8a8_kernel_available,
)
from ..backends.loading import LoadedModel
from ..core.acceptance import target_distribution
from ..core.clock import now
from ..core.errors import InputError, first_line
from ..core.events import DRAFTED_BY_BOTH, DRAFTED_BY_HEAD, DRAFTED_BY_LOOKUP
from ..core.files import atomic_path, file_sha256
from ..core.protocol import DraftLengthPolicy, Proposal, RoundResult, TargetPass
from ..core.settings import SamplingSettings
from ..core.tree import add_branch
from .base import (
    BuildContext,
    Method,
    PolicyContext,
    drafter_generator,
    heads_policy,
    to_target_vocab,
    tree_verify_cost,
)
from .ngram import LookupBranch

logger = logging.getLogger(__name__)

#: ``specdemo_format`` in the config.json of this project's own layout
FORMAT = "specdemo-eagle3"
FORMAT_VERSION = 1
#: the weights files a head folder may hold, in the order they are looked for
WEIGHTS_NAMES = ("model.safetensors", "pytorch_model.bin")
#: the heads shipped for offline targets (offline-pack name -> folder, sha256 of its weights file), checked on load;
#: trained here by ``python -m specdemo.training.eagle`` (provenance in the folder's training.json)
SHIPPED_HEADS: dict[str, tuple[Path, str]] = {
    "qwen2.5-coder-1.5b": (
        Path(__file__).resolve().parents[1] / "data" / "eagle" / "qwen2.5-coder-1.5b",
        "0f7c42483d53ac98712315c0a313b23819444425c049cac8fe97099f81b5339b",
    ),
}
#: a tree's candidates per node: each expanded node's top tokens, and the nodes expanded at each depth
TOP_K = 4
#: the deepest a tree grows (draft steps after the first)
MAX_TREE_DEPTH = 8
#: the most rounds a tree drafter sits out (head not run) after trees that did not pay, before it looks again
MAX_REST = 32
#: the formats a head may run in beside an int8 or w8a8 target on a CPU: whichever drafts fastest on this machine
#: (:func:`fastest_head_format`); "w8a8" is float32 with every linear layer in w8a8's integer kernels, two-part
#: activations (see :func:`head_in_format`), where the CPU has them. Beside every other target the head runs in the
#: target's own dtype. A head's format changes what a draft costs, never what the target writes.
CPU_HEAD_FORMATS = ("float32", "bfloat16", "w8a8")
#: who drafted a node of a tree: the head, the prompt-lookup branch, or both
_SOURCES = {"tree": DRAFTED_BY_HEAD, "branch": DRAFTED_BY_LOOKUP, "both": DRAFTED_BY_BOTH}


class EagleLoadError(ValueError):
    """A head that cannot be loaded or does not fit the target, with a message fit to show as is."""


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


# ----------------------------------------------------------------------------------------------------------------
# the head


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


class _KVCache:
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
        cache: _KVCache | None,
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
        cache: _KVCache | None,
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
        cache: _KVCache | None = None,
        visible: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The layer's outputs [n, H] for features [n, H] and token embeddings [n, H] at ``positions`` [n].
        ``visible`` [n, cached + n] (True: attend): None = causal over the new rows after everything cached."""
        dtype = self.dtype
        count = features.shape[0]
        cached = cache.length if cache is not None else 0
        if visible is None and count > 1:
            visible = torch.ones(count, cached + count, dtype=torch.bool, device=features.device)
            visible[:, cached:] = torch.ones(count, count, dtype=torch.bool, device=features.device).tril()
        frequencies = positions.to(torch.float32)[:, None] * self._inv_freq.to(positions.device)[None]
        angles = torch.cat([frequencies, frequencies], dim=-1)
        cos, sin = (angles.cos() * self._rope_scaling).to(dtype), (angles.sin() * self._rope_scaling).to(dtype)
        return self.midlayer(embeds.to(dtype), features.to(dtype), cos, sin, cache, visible)

    def logits(self, outputs: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(outputs))


# ----------------------------------------------------------------------------------------------------------------
# files


@dataclass(frozen=True)
class TargetFacts:
    """What a head must fit: the target's hidden size, vocabulary (LM-head rows), decoder layers, names, classes."""

    source: str
    hidden_size: int
    vocab_size: int
    num_layers: int
    names: tuple[str, ...] = ()
    architectures: tuple[str, ...] = ()


def _name_keys(name: str) -> set[str]:
    """Comparable forms of a model name or path: its last component (and a Hub cache folder's repository name),
    lower case, letters and digits only; owners and parent folders do not count."""
    parts = [part for part in re.split(r"[/\\]", name.strip()) if part]
    names = parts[-1:] + [part.rsplit("--", 1)[-1] for part in parts if part.startswith("models--")]
    return {key for key in (re.sub(r"[^a-z0-9]", "", part.lower()) for part in names) if key}


def target_facts(target: LoadedModel) -> TargetFacts:
    """The facts a head is checked against, read from a loaded target."""
    model = target.model
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    names = [target.source, str(getattr(model.config, "_name_or_path", "") or "")]
    from ..backends.offline import OFFLINE_MODELS, is_offline_source, offline_name

    if is_offline_source(target.source) and offline_name(target.source) in OFFLINE_MODELS:
        names.append(OFFLINE_MODELS[offline_name(target.source)].description.split(",")[0])  # its Hub name
    architectures = tuple(getattr(model.config, "architectures", None) or ()) + (type(model).__name__,)
    return TargetFacts(
        source=target.source,
        hidden_size=int(model.get_input_embeddings().weight.shape[1]),
        vocab_size=output_rows(model),
        num_layers=int(getattr(config, "num_hidden_layers", 0) or 0),
        names=tuple(n for n in names if n),
        architectures=architectures,
    )


def _llama_fields(raw: dict) -> dict[str, Any]:
    """The EagleConfig fields a Llama-style config dict gives (rope settings in either transformers spelling)."""
    hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
    rope = raw.get("rope_parameters")
    if isinstance(rope, dict):  # transformers 5 spells rope_theta and rope_scaling as one dict
        theta = float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))
        scaling = rope if rope.get("rope_type", rope.get("type", "default")) != "default" else None
    else:
        theta, scaling = float(raw.get("rope_theta", 10000.0)), raw.get("rope_scaling")
    if scaling is not None:
        scaling = {key: value for key, value in scaling.items() if key != "rope_theta"}
    return {
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": int(raw.get("num_key_value_heads") or heads),
        "head_dim": int(raw.get("head_dim") or hidden // heads),
        "intermediate_size": int(raw["intermediate_size"]),
        "rms_norm_eps": float(raw.get("rms_norm_eps", 1e-6)),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "max_position_embeddings": int(raw.get("max_position_embeddings") or 32768),
        "attention_bias": bool(raw.get("attention_bias", False)),
        "qk_norm": raw.get("model_type") == "qwen3",
        "hidden_act": str(raw.get("hidden_act", "silu")),
    }


def _layers(value: Any) -> tuple[int, ...] | None:
    return tuple(int(layer) for layer in value) if value else None


def _parse_config(raw: dict, folder: Path) -> tuple[dict[str, Any], str, str]:
    """(EagleConfig fields, some with ``hidden_layers`` None for "the default", the layout's name, the prefix of
    the layer's weights) from a head's config.json, whichever of the three layouts it is in."""
    if "speculators_model_type" in raw:
        kind = raw["speculators_model_type"]
        if kind != "eagle3":
            raise EagleLoadError(f"{folder} holds a speculators {kind!r} model, not an EAGLE-3 head")
        spec = raw.get("speculators_config") or {}
        if spec.get("algorithm", "eagle3") != "eagle3":
            raise EagleLoadError(f"{folder} holds a speculators {spec.get('algorithm')!r} model, not an EAGLE-3 head")
        layer = raw.get("transformer_layer_config") or {}
        if int(layer.get("num_hidden_layers", 1)) != 1:
            raise EagleLoadError(f"{folder}: EAGLE-3 heads with {layer['num_hidden_layers']} decoder layers are not "
                                 "supported (one layer only)")
        verifier = spec.get("verifier") or {}
        fields = _llama_fields(layer)
        fields.update(
            vocab_size=int(layer["vocab_size"]),
            draft_vocab_size=int(raw.get("draft_vocab_size") or layer["vocab_size"]),
            hidden_layers=_layers(raw.get("eagle_aux_hidden_state_layer_ids")),
            norm_before_residual=bool(raw.get("norm_before_residual", False)),
            norm_before_fc=bool(raw.get("norm_before_fc", False)),
            verifier=str(verifier.get("name_or_path") or ""),
            verifier_architectures=tuple(verifier.get("architectures") or ()),
            target_hidden_size=raw.get("target_hidden_size"),
        )
        return fields, "speculators", "layers.0."
    if raw.get("specdemo_format") == FORMAT:
        fields = _llama_fields(raw)
        fields.update(
            vocab_size=int(raw["vocab_size"]),
            draft_vocab_size=int(raw["draft_vocab_size"]),
            hidden_layers=_layers(raw.get("hidden_layers")),
            norm_before_residual=bool(raw.get("norm_before_residual", False)),
            norm_before_fc=bool(raw.get("norm_before_fc", False)),
            qk_norm=bool(raw.get("qk_norm", False)),
            shared_lm_head=bool(raw.get("shared_lm_head", False)),
            verifier=str(raw.get("verifier") or ""),
            verifier_architectures=tuple(raw.get("verifier_architectures") or ()),
        )
        return fields, "specdemo", "midlayer."
    if "draft_vocab_size" in raw or any("eagle3" in str(a).lower() for a in raw.get("architectures") or ()):
        fields = _llama_fields(raw)
        if int(raw.get("num_hidden_layers", 1)) != 1:
            raise EagleLoadError(f"{folder}: EAGLE-3 heads with {raw['num_hidden_layers']} decoder layers are not "
                                 "supported (one layer only)")
        eagle = raw.get("eagle_config") or {}
        fields.update(
            vocab_size=int(raw["vocab_size"]),
            draft_vocab_size=int(raw.get("draft_vocab_size") or raw["vocab_size"]),
            hidden_layers=_layers(eagle.get("eagle_aux_hidden_state_layer_ids")),
            norm_before_residual=bool(raw.get("norm_before_residual", False)),
            target_hidden_size=raw.get("target_hidden_size"),
        )
        return fields, "EAGLE", "midlayer."
    raise EagleLoadError(f"{folder / 'config.json'} is not an EAGLE-3 head config (it has no draft_vocab_size, "
                         "speculators_model_type or specdemo_format)")


def _check_fit(fields: dict[str, Any], facts: TargetFacts) -> None:
    """Refuse, in one line, a head that does not fit the target: hidden size, vocabulary, layers, verifier."""
    if fields["hidden_size"] != facts.hidden_size:
        raise EagleLoadError(f"this EAGLE head is for hidden size {fields['hidden_size']}, the target's is "
                             f"{facts.hidden_size}")
    reads = fields.get("target_hidden_size")
    if reads and int(reads) != facts.hidden_size:
        raise EagleLoadError(f"this EAGLE head reads target states of width {reads}, the target's hidden size is "
                             f"{facts.hidden_size}")
    if fields["vocab_size"] != facts.vocab_size:
        raise EagleLoadError(f"this EAGLE head drafts for a vocabulary of {fields['vocab_size']} tokens, the "
                             f"target's has {facts.vocab_size}")
    layers = fields["hidden_layers"]
    if facts.num_layers and any(not 0 <= layer <= facts.num_layers for layer in layers):
        raise EagleLoadError(f"this EAGLE head reads the target's states at layers {list(layers)}, the target has "
                             f"{facts.num_layers} layers")
    verifier = fields.get("verifier") or ""
    if verifier and facts.names and not _name_keys(verifier) & set().union(*map(_name_keys, facts.names)):
        raise EagleLoadError(f"this EAGLE head was trained for {verifier}, the target is {facts.source}")
    architectures = set(fields.get("verifier_architectures") or ())
    if architectures and facts.architectures and not architectures & set(facts.architectures):
        raise EagleLoadError(f"this EAGLE head was trained for a {', '.join(sorted(architectures))}, the target is "
                             f"a {facts.architectures[0]}")


def _resolve_folder(source: str | Path) -> Path:
    """The local folder of a head: ``source`` itself, or a Hub id's snapshot (huggingface_hub's download)."""
    text = str(source)
    folder = Path(text).expanduser()
    if folder.is_dir():
        return folder
    if folder.exists():
        raise EagleLoadError(f"{text} is a file: name the EAGLE head's folder (config.json and its weights)")
    if re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", text) and not text.startswith((".", "~")):
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(text, allow_patterns=["*.json", "*.safetensors", "pytorch_model.bin"]))
        except Exception as error:  # no network, no such repository, no access: one line
            raise EagleLoadError(f"cannot fetch the EAGLE head {text} from the Hugging Face Hub: "
                                 f"{first_line(error)}") from None
    raise EagleLoadError(f"EAGLE head not found: {text} is neither a folder nor a Hub id")


def weights_file(folder: Path) -> Path | None:
    """A head folder's weights file: the first of :data:`WEIGHTS_NAMES` there (None: none)."""
    return next((folder / name for name in WEIGHTS_NAMES if (folder / name).is_file()), None)


def _read_state(folder: Path) -> tuple[dict[str, torch.Tensor], Path]:
    path = weights_file(folder)
    if path is None:
        raise EagleLoadError(f"no EAGLE head weights in {folder}: expected {' or '.join(WEIGHTS_NAMES)}")
    try:
        if path.name.endswith(".safetensors"):
            from safetensors.torch import load_file

            state = load_file(str(path))
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # a corrupt or foreign file: one line, not a traceback
        raise EagleLoadError(f"cannot read the EAGLE head {path}: {type(error).__name__}: "
                             f"{first_line(error)}") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise EagleLoadError(f"{path} holds no tensor dictionary of an EAGLE head")
    return state, path


def _draft_ids(state: dict[str, torch.Tensor], config: EagleConfig, path: Path) -> torch.Tensor:
    """The target id of each draft index, from ``d2t`` (offsets) and checked against ``t2d``."""
    size, vocab = config.draft_vocab_size, config.vocab_size
    d2t, t2d = state.get("d2t"), state.get("t2d")
    if d2t is None:
        if size != vocab:
            raise EagleLoadError(f"{path} has no d2t: its {size} draft ids cannot be mapped to the {vocab} target ids")
        return torch.arange(size)
    if tuple(d2t.shape) != (size,):
        raise EagleLoadError(f"{path}: d2t has shape {tuple(d2t.shape)}, expected ({size},)")
    ids = torch.arange(size) + d2t.long()
    if int(ids.min()) < 0 or int(ids.max()) >= vocab or ids.unique().numel() != size:
        raise EagleLoadError(f"{path}: d2t maps draft ids outside the target's {vocab} ids or two onto one")
    if t2d is not None:
        if tuple(t2d.shape) != (vocab,):
            raise EagleLoadError(f"this EAGLE head's t2d covers {t2d.shape[0]} target ids, the target has {vocab}")
        if int(t2d.bool().sum()) != size or not bool(t2d.bool()[ids].all()):
            raise EagleLoadError(f"{path}: d2t and t2d disagree on the draft vocabulary")
    return ids


def load_head(
    source: str | Path,
    facts: TargetFacts,
    expected_sha256: str | None = None,
    lm_head_weight: Callable[[], torch.Tensor] | None = None,
) -> EagleHead:
    """A head from a folder or Hub id in any of the three layouts, checked against the target first.

    ``expected_sha256``: refuse a weights file whose digest differs (the shipped heads are checked this way).
    ``lm_head_weight``: the target's LM-head weight (a callable, read only for a head that shares it).
    """
    folder = _resolve_folder(source)
    try:
        raw = json.loads((folder / "config.json").read_text())
        if not isinstance(raw, dict):
            raise TypeError("not a JSON object")
        fields, layout, prefix = _parse_config(raw, folder)
    except FileNotFoundError:
        raise EagleLoadError(f"no config.json in {folder}: not an EAGLE-3 head folder") from None
    except (ValueError, KeyError, TypeError) as error:
        if isinstance(error, EagleLoadError):
            raise
        raise EagleLoadError(f"{folder / 'config.json'} is not an EAGLE-3 head config ({type(error).__name__}: "
                             f"{first_line(error)})") from None
    if fields["hidden_layers"] is None:  # the original checkpoints do not say: EAGLE-3's own choice
        fields["hidden_layers"] = default_hidden_layers(facts.num_layers)
    _check_fit(fields, facts)
    fields.pop("target_hidden_size", None)
    config = EagleConfig(**fields)
    state, weights_path = _read_state(folder)
    if expected_sha256 is not None:
        digest = file_sha256(weights_path)
        if digest != expected_sha256:
            raise EagleLoadError(f"{weights_path} is damaged or replaced: sha256 {digest[:16]}…, expected "
                                 f"{expected_sha256[:16]}…")
    head = EagleHead(config)
    own = head.state_dict()
    with torch.no_grad():
        for name, tensor in own.items():
            if name == "lm_head.weight" and config.shared_lm_head:
                continue
            stored_name = prefix + name[len("midlayer."):] if name.startswith("midlayer.") else name
            stored = state.get(stored_name)
            if stored is None:
                raise EagleLoadError(f"{weights_path}: no {stored_name} ({layout} layout)")
            if stored.shape != tensor.shape:
                raise EagleLoadError(f"{weights_path}: {stored_name} has shape {tuple(stored.shape)}, expected "
                                     f"{tuple(tensor.shape)} from its config")
            tensor.copy_(stored.float())
        head.draft_ids.copy_(_draft_ids(state, config, weights_path))
        if config.shared_lm_head:
            if lm_head_weight is None:
                raise EagleLoadError(f"{folder}: this EAGLE head shares the target's LM head; load it for a target")
            head.lm_head.weight.copy_(lm_head_weight()[head.draft_ids].float())
    logger.info("EAGLE-3 head from %s (%s layout): %d draft ids, target layers %s", source, layout,
                config.draft_vocab_size, list(config.hidden_layers))
    return head.eval().requires_grad_(False)


def save_head(
    head: EagleHead, folder: str | Path, dtype: torch.dtype = torch.bfloat16, extra: dict | None = None
) -> str:
    """Write a head in this project's layout (config.json, model.safetensors with ``fc``, ``midlayer.*``,
    ``norm``, ``lm_head`` (not for a shared LM head), ``d2t`` offsets and the ``t2d`` mask, as EAGLE-3's
    checkpoints hold them); returns the weights file's sha256."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = head.config
    state = {name: tensor.detach().to("cpu", dtype).contiguous() for name, tensor in head.state_dict().items()
             if not (name == "lm_head.weight" and config.shared_lm_head)}
    draft_ids = head.draft_ids.detach().cpu().long()
    state["d2t"] = (draft_ids - torch.arange(config.draft_vocab_size)).contiguous()
    t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    state["t2d"] = t2d
    weights = folder / WEIGHTS_NAMES[0]
    with atomic_path(weights) as partial:
        save_file(state, str(partial))
    raw = {
        "specdemo_format": FORMAT,
        "format_version": FORMAT_VERSION,
        "architectures": ["Eagle3Head"],
        "model_type": "qwen3" if config.qk_norm else "llama",
        "num_hidden_layers": 1,
        **{f.name: getattr(config, f.name) for f in dataclasses.fields(config)},
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    raw.update(extra or {})
    (folder / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    return file_sha256(weights)


def shipped_head_for(target_source: str) -> tuple[Path, str] | None:
    """(folder, sha256) of the head shipped with specdemo for this target (an offline-pack name), or None."""
    from ..backends.offline import is_offline_source, offline_name

    if not is_offline_source(target_source):
        return None
    return SHIPPED_HEADS.get(offline_name(target_source))


#: heads loaded per target model (freed with it), by source
_HEADS: "weakref.WeakKeyDictionary[nn.Module, dict[str, EagleHead]]" = weakref.WeakKeyDictionary()


def head_for(target: LoadedModel, source: str | None = None) -> EagleHead:
    """The EAGLE-3 head for ``target`` in its dtype and on its device (beside an int8 or w8a8 target on a CPU: in
    the fastest of :data:`CPU_HEAD_FORMATS`): from ``source`` (a folder or Hub id), or the head shipped for an
    offline target (sha256-checked); InputError with one line when there is none or it misfits."""
    expected_sha256 = None
    if source is None:
        shipped = shipped_head_for(target.source)
        if shipped is None:
            raise InputError(
                f"no EAGLE head ships for {target.source} yet: name one with --eagle-head PATH, or train one with "
                "python -m specdemo.training.eagle",
                field="eagle_head",
            )
        folder, expected_sha256 = shipped
        source = str(folder)
    per_model = _HEADS.setdefault(target.model, {})
    if source in per_model:
        return per_model[source]
    try:
        head = load_head(source, target_facts(target), expected_sha256, lambda: output_weight(target.model))
    except EagleLoadError as error:
        raise InputError(str(error), field="eagle_head") from None
    if target.device.type == "cpu" and target.format in (INT8, W8A8):
        formats = tuple(fmt for fmt in CPU_HEAD_FORMATS if fmt != W8A8 or w8a8_kernel_available())
        head = fastest_head_format(head, formats)
    else:
        head = head.to(device=target.device, dtype=target.dtype)
    per_model[source] = head
    return head


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
                        ) -> EagleHead:
    """Of ``formats``, the head in the one in which it drafts fastest here: the median seconds of a one-row chain
    step plus a :data:`TOP_K`-row tree step, after ``context`` cached positions, each with its logits. A head's
    format never changes what the target writes, only what a draft costs; measured because it depends on the CPU
    (native bfloat16 or not) and on the kernels torch dispatches to, in about a second."""
    hidden = head.config.hidden_size
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randn(rows, hidden, generator=generator) for rows in (context, 1, TOP_K)]
    seconds: dict[str, float] = {}
    fastest: EagleHead | None = None
    for fmt in formats:
        trial = head_in_format(head, fmt)
        cache = _KVCache()
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


# ----------------------------------------------------------------------------------------------------------------
# drafting


def _best_path_first(parents: Sequence[int]) -> list[int]:
    """The nodes of a tree given best first (``parents[i]`` < i, -1 for a root) in depth-first order, each node's
    children best first: the best path comes first, so its nodes read a prefix of the verify pass's keys and share
    them (the other nodes' keys are gathered, see :func:`~specdemo.backends.formats.row_wise_attention`)."""
    children: dict[int, list[int]] = {-1: []}
    for node, parent in enumerate(parents):
        children.setdefault(parent, []).append(node)
    order: list[int] = []
    stack = children[-1][::-1]
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(children.get(node, [])[::-1])
    return order


class EagleDrafter:
    """Drafts with an EAGLE-3 head on the target's features: no second model.

    ``tree=True`` (greedy only) grows EAGLE-2's dynamic tree: the head's ``top_k`` tokens after the last accepted
    position, then at each depth the ``top_k`` newest nodes with the best path probability expanded by their own
    ``top_k`` tokens (one head step over all of them, a tree mask inside the head); the ``max_tokens`` best nodes
    of all are proposed, a tree in topological order. ``verify_cost`` (seconds of a verify pass over n tokens, from
    the measured cost curve) sizes each tree, as Medusa's are: the node count that maximises expected tokens per
    second, the drafting counted; none when a plain step is better (and then the head rests a few rounds), and a
    tree stops growing when its best new node is worth less than a head step. ``tree=False`` drafts a chain: the
    head's top token at each step, or under sampling a token drawn from the head's warped distribution over the
    draft vocabulary, spread onto the target's (zero elsewhere), which rejection sampling makes exact.
    """

    name = "eagle"
    needs_hidden_states = True

    def __init__(
        self,
        head: EagleHead,
        embed_tokens: nn.Module,
        sampling: SamplingSettings,
        target_vocab_size: int,
        tree: bool = False,
        top_k: int = TOP_K,
        max_depth: int = MAX_TREE_DEPTH,
        generator: torch.Generator | None = None,
        verify_cost: Callable[[int], float] | None = None,
        lookup: LookupBranch | None = None,
    ) -> None:
        if tree and not sampling.greedy:
            raise ValueError("an EAGLE tree is verified greedily only; sampled runs use the chain")
        if lookup is not None and not tree:
            raise ValueError("the prompt-lookup branch joins an EAGLE tree only")
        self.head = head
        self.embed_tokens = embed_tokens
        self.sampling = sampling
        self.target_vocab_size = target_vocab_size
        self.tree = tree
        self.top_k = max(1, min(top_k, head.config.draft_vocab_size)) if tree else 1
        self.max_depth = max_depth
        self.generator = generator
        self.verify_cost = verify_cost
        self.lookup = lookup
        #: the target layers whose states the loop asks every pass for (see LanguageModel.run)
        self.hidden_layers: tuple[int, ...] = tuple(head.hidden_layers)
        self._width = head.config.num_features * head.config.hidden_size
        self._cache = _KVCache()
        self._committed = 0  # head positions in the cache: target features paired with accepted tokens
        self._pending: torch.Tensor | None = None  # target states of the next positions, not yet run
        self._pending_plain = 0  # how many of them came from rounds without a draft
        self._root: tuple[torch.Tensor, torch.Tensor] | None = None  # the last committed position: output, logits
        self._expected = 0.0  # predicted accepted tokens, summed over rounds (decayed), for calibrating scores
        self._observed = 0.0
        self._last_expected = 0.0
        self._step_seconds: float | None = None  # one tree step, seconds (an average that leans low)
        self._rest = 1
        self._resting = 0

    @property
    def device(self) -> torch.device:
        return self.head.device

    def start(self, prompt_ids: Sequence[int], prefill: TargetPass | None = None) -> None:
        states = prefill.hidden_states if prefill is not None else None
        if states is None or states.shape[0] != len(prompt_ids) or states.shape[-1] != self._width:
            raise ValueError(f"an EAGLE head needs the target's states of layers {list(self.hidden_layers)} at "
                             "every prompt position (run the target with hidden_layers)")
        self._cache = _KVCache()
        self._committed, self._pending, self._pending_plain, self._root = 0, states, 0, None
        self._rest, self._resting = 1, 0
        if self.lookup is not None:
            self.lookup.start()

    def _embed(self, token_ids: Sequence[int]) -> torch.Tensor:
        return self.embed_tokens(torch.tensor(list(token_ids), dtype=torch.long, device=self.device))

    def _positions(self, start: int, count: int) -> torch.Tensor:
        return torch.arange(start, start + count, device=self.device)

    @torch.inference_mode()
    def _catch_up(self, context: Sequence[int]) -> float:
        """Run the head over the positions the target has written since its last round (their features and the
        accepted tokens after them), committing them; the seconds it took when some came from plain steps."""
        if self._pending is None:
            return 0.0
        count = self._pending.shape[0]
        if len(context) != self._committed + count + 1:
            raise ValueError(f"the EAGLE head is at position {self._committed + count}, the context at "
                             f"{len(context) - 1}: every target pass must reach the drafter's feedback")
        started = now(self.device)
        tokens = context[self._committed + 1 : self._committed + count + 1]
        features = self.head.features(self._pending)
        outputs = self.head(features, self._embed(tokens), self._positions(self._committed, count), self._cache)
        self._committed += count
        self._root = (outputs[-1], self.head.logits(outputs[-1:])[0])
        self._pending = None
        plain, self._pending_plain = self._pending_plain, 0
        return now(self.device) - started if plain else 0.0

    @torch.inference_mode()
    def propose(self, context: Sequence[int], max_tokens: int) -> Proposal:
        if max_tokens <= 0:
            return Proposal()
        started = now(self.device)
        branch = self.lookup.propose(context, max_tokens) if self.lookup is not None else ([], [])
        if self._resting > 0:  # the last trees did not pay for the head: the head is not even run
            self._resting -= 1
            return self._choose([], [], [], branch, max_tokens, now(self.device) - started, 0.0)
        catch_up_seconds = self._catch_up(context)
        try:
            if not self.sampling.greedy:
                tokens, draft_probs = self._sample_chain(max_tokens)
                return Proposal(tokens, draft_probs, catch_up_seconds)
            started = now(self.device)
            candidates, parents, probs = self._grow_tree(max_tokens)
        finally:
            self._cache.crop(self._committed)  # the drafted positions are never committed
        if not self.tree:
            return Proposal([token for _, token in candidates], None, catch_up_seconds)
        tokens = [token for _, token in candidates]
        return self._choose(tokens, parents, probs, branch, max_tokens, now(self.device) - started, catch_up_seconds)

    def _choose(
        self,
        tokens: list[int],
        parents: list[int],
        probs: list[float],
        branch: tuple[list[int], list[float]],
        max_tokens: int,
        draft_seconds: float,
        catch_up_seconds: float,
    ) -> Proposal:
        """The tree to verify: the head's candidates (best first, with their path probabilities) and the lookup
        branch merged, the nodes that pay for their place in the verify pass kept (all, without a cost model), in
        best-path-first order; the head's pacing and calibration updated."""
        ratio = self._calibration()
        calibrated = [min(1.0, ratio * prob) for prob in probs]  # the branch's rates are calibrated already
        tree = add_branch(tokens, parents, calibrated, *branch).cut(max_tokens)
        tree = tree.cut(self._tree_size(tree.probs, draft_seconds, ratio=1.0))
        head_nodes = [node for node in tree.tree_nodes if node >= 0]
        self._last_expected = sum(probs[node] for node in head_nodes)
        if probs:  # the head ran this round
            self._pace(len(head_nodes))
        chosen = _best_path_first(tree.parents)
        place = {rank: index for index, rank in enumerate(chosen)}
        node_parents = [place[tree.parents[rank]] if tree.parents[rank] >= 0 else -1 for rank in chosen]
        sources = [_SOURCES[tree.sources[rank]] for rank in chosen] if self.lookup is not None else None
        return Proposal([tree.tokens[rank] for rank in chosen], None, catch_up_seconds, node_parents, sources)

    def _grow_tree(self, max_tokens: int) -> tuple[list[tuple[int, int]], list[int], list[float]]:
        """The ``max_tokens`` best candidates, best first: ((creation index, token), parent's index among them,
        path probability); every prefix of the list is a tree (a parent scores at least as high as its children
        and comes first on ties)."""
        assert self._root is not None
        root_output, root_logits = self._root
        draft_ids = self.head.draft_ids
        top = root_logits.float().log_softmax(-1).topk(self.top_k)
        tokens: list[int] = draft_ids[top.indices].tolist()
        parents: list[int] = [-1] * len(tokens)
        depths: list[int] = [0] * len(tokens)
        scores: list[float] = top.values.tolist()
        frontier = list(range(len(tokens)))  # the nodes the next step runs
        run_at: dict[int, int] = {}  # node -> its place in the cache's drafted positions
        outputs: list[torch.Tensor] = []
        grown = now(self.device)
        for step in range(min(max_tokens - 1, self.max_depth)):
            if not self._step_may_pay(scores, frontier, max_tokens, now(self.device) - grown):
                break  # no child the next step could draft would make the tree pay more than it does now
            started = now(self.device)
            done = len(outputs)
            base = self._committed
            visible = torch.zeros(len(frontier), base + done + len(frontier), dtype=torch.bool)
            visible[:, :base] = True
            for row, node in enumerate(frontier):
                ancestor = parents[node]
                while ancestor >= 0:
                    visible[row, base + run_at[ancestor]] = True
                    ancestor = parents[ancestor]
                visible[row, base + done + row] = True
            features = torch.stack([root_output if parents[n] < 0 else outputs[run_at[parents[n]]] for n in frontier])
            stepped = self.head(features, self._embed([tokens[n] for n in frontier]),
                                self._positions(base + step, 1).expand(len(frontier)), self._cache,
                                visible.to(self.device))
            for row, node in enumerate(frontier):
                run_at[node] = done + row
                outputs.append(stepped[row])
            top = self.head.logits(stepped).float().log_softmax(-1).topk(self.top_k, dim=-1)
            children_ids, children_scores = draft_ids[top.indices].tolist(), top.values.tolist()
            children = []
            for row, node in enumerate(frontier):
                for token, score in zip(children_ids[row], children_scores[row]):
                    children.append(len(tokens))
                    tokens.append(token)
                    parents.append(node)
                    depths.append(step + 1)
                    scores.append(scores[node] + score)
            frontier = sorted(children, key=lambda child: (-scores[child], child))[: self.top_k]
            seconds = now(self.device) - started
            self._step_seconds = seconds if self._step_seconds is None else min(
                seconds, 0.8 * self._step_seconds + 0.2 * seconds)
        order = sorted(range(len(tokens)), key=lambda node: (-scores[node], depths[node], node))[:max_tokens]
        rank = {node: index for index, node in enumerate(order)}
        probs = torch.tensor([scores[node] for node in order]).exp().tolist()
        return ([(node, tokens[node]) for node in order], [rank.get(parents[node], -1) for node in order], probs)

    def _sample_chain(self, max_tokens: int) -> tuple[list[int], torch.Tensor]:
        """A chain drawn from the head's warped distributions, and those distributions on the target's vocabulary."""
        assert self._root is not None
        output, logits = self._root
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        for step in range(max_tokens):
            probs = target_distribution(logits, self.sampling)
            index = torch.multinomial(probs, 1, generator=self.generator)
            tokens.append(int(self.head.draft_ids[index][0]))
            rows.append(to_target_vocab(probs, self.head.draft_ids, self.target_vocab_size))
            if step + 1 == max_tokens:
                break
            stepped = self.head(output.view(1, -1), self._embed(tokens[-1:]),
                                self._positions(self._committed + step, 1), self._cache)
            output, logits = stepped[0], self.head.logits(stepped)[0]
        return tokens, torch.stack(rows)

    def _calibration(self) -> float:
        """Observed over predicted accepted tokens of recent trees: the head's probabilities are not calibrated."""
        return (self._observed + 1.0) / (self._expected + 1.0)

    def _best_size(self, probs: list[float], draft_seconds: float, ratio: float | None = None,
                   ) -> tuple[int, float, float]:
        """(count, tokens per second, expected tokens) of the best tree made of the first ``count`` of ``probs``
        (path probabilities, best first, scaled by ``ratio``; None: the head's calibration), the verify pass and
        ``draft_seconds`` of drafting counted; count 0 is a plain step."""
        assert self.verify_cost is not None
        ratio = self._calibration() if ratio is None else ratio
        best_count, best_rate, best_expected = 0, 1.0 / self.verify_cost(1), 1.0
        expected = 1.0
        for count, prob in enumerate(probs, start=1):
            expected += ratio * prob
            rate = expected / (draft_seconds + self.verify_cost(count + 1))
            if rate > best_rate:
                best_count, best_rate, best_expected = count, rate, expected
        return best_count, best_rate, best_expected

    def _tree_size(self, probs: list[float], draft_seconds: float, ratio: float | None = None) -> int:
        """How many of the best nodes pay for their place in the verify pass, the drafting counted (all, without
        a cost model)."""
        if self.verify_cost is None or not probs:
            return len(probs)
        return self._best_size(probs, draft_seconds, ratio)[0]

    def _step_may_pay(self, scores: list[float], frontier: list[int], max_tokens: int, spent: float) -> bool:
        """Whether one more tree step could make the tree pay more than the best tree of the nodes already drafted
        (after ``spent`` seconds of growing). Its children are worth at most their parents' path probabilities,
        each and in sum over the frontier, so the best it could add with j children is bounded and costs the step
        and a verify pass j nodes longer (at the node budget, j children take the places of the j weakest kept
        nodes): without a cost model or a measured step, always."""
        if self.verify_cost is None or self._step_seconds is None:
            return True
        probs = sorted((math.exp(score) for score in scores), reverse=True)[:max_tokens]
        count, rate, expected = self._best_size(probs, spent)
        ratio = self._calibration()
        frontier_probs = [math.exp(scores[node]) for node in frontier]
        best, mass = max(frontier_probs), sum(frontier_probs)
        for children in range(1, self.top_k * len(frontier) + 1):
            displaced = max(0, count + children - max_tokens)  # over the budget a child takes a kept node's place
            if displaced > count:
                break
            gain = ratio * (min(children * best, mass) - sum(probs[count - displaced : count]))
            nodes = count + children - displaced
            if (expected + gain) / (spent + self._step_seconds + self.verify_cost(nodes + 1)) > rate:
                return True
        return False

    def _pace(self, count: int) -> None:
        """After a tree that pays, run the head every round; after one that does not, sit out 1, 2, 4 ... up to
        :data:`MAX_REST` rounds, and let the calibration drift back toward trusting the head (Medusa's pacing)."""
        if self.verify_cost is None:
            return
        if count > 0:
            self._rest = 1
            return
        self._resting = self._rest
        self._rest = min(2 * self._rest, MAX_REST)
        self._expected *= 0.9
        self._observed *= 0.9

    def feedback(self, result: RoundResult) -> None:
        states = result.target_pass.hidden_states if result.target_pass is not None else None
        if states is None or states.shape[-1] != self._width:
            raise ValueError(f"an EAGLE head needs the target's states of layers {list(self.hidden_layers)} from "
                             "every verify pass")
        path = result.verdict.accepted_nodes
        rows = torch.tensor([0] + [node + 1 for node in path], device=states.device)
        accepted = states.index_select(0, rows)
        self._pending = accepted if self._pending is None else torch.cat([self._pending, accepted])
        if self.lookup is not None:
            tokens = result.proposal.tokens
            self.lookup.feedback([tokens[node] for node in path])
        if result.num_drafted == 0:
            self._pending_plain += 1
        elif self.tree and self._last_expected > 0:
            sources = result.proposal.sources  # None: the head drafted every node
            from_head = sum(1 for node in path if sources is None or sources[node] != DRAFTED_BY_LOOKUP)
            self._expected = 0.9 * self._expected + self._last_expected
            self._observed = 0.9 * self._observed + from_head


# ----------------------------------------------------------------------------------------------------------------
# the two modes


@dataclass(frozen=True)
class EagleOptions:
    """``eagle_head``: a head folder (any of the three layouts) or Hub id; None: the head shipped for the target.
    ``eagle_lookup``: the greedy tree also holds prompt lookup's continuation as one more branch (the n-gram
    settings ``ngram_min``, ``ngram_max``, ``ngram_prefer`` choose it, as in the ``ngram`` mode)."""

    eagle_head: str | None = None
    eagle_lookup: bool = True
    ngram_min: int = 1
    ngram_max: int = 4
    ngram_prefer: str = "follow"

    def validate(self) -> None:
        if self.eagle_head is not None and not str(self.eagle_head).strip():
            raise InputError("the EAGLE head is empty: name a folder or Hub id, or leave it out", field="eagle_head")


def _check(target: LoadedModel, draft: LoadedModel | None, options: Any) -> None:
    head_for(target, options.eagle_head)  # none shipped for this target, or a misfit: one line, before any pass


def _describe(target: LoadedModel, options: Any) -> dict[str, Any]:
    """The head a results file records: the format it runs in (and the step times that chose it), its layers and
    draft vocabulary."""
    head = head_for(target, options.eagle_head)
    return {
        "eagle_head": options.eagle_head or "shipped",
        "lookup_branch": bool(options.eagle_lookup),
        "head_format": head.number_format,
        "head_step_seconds": head.format_seconds,
        "hidden_layers": list(head.hidden_layers),
        "draft_vocab_size": head.config.draft_vocab_size,
    }


def _build(context: BuildContext, tree: bool) -> EagleDrafter:
    target, settings = context.target, context.settings
    tree = tree and settings.sampling.greedy  # sampling is exact on a chain only
    policy, options = context.policy, context.options
    lookup = (LookupBranch(options.ngram_min, options.ngram_max, options.ngram_prefer)
              if tree and options.eagle_lookup else None)
    return EagleDrafter(
        head_for(target, context.options.eagle_head),
        target.model.get_input_embeddings(),
        settings.sampling,
        target_vocab_size=output_rows(target.model),
        tree=tree,
        generator=drafter_generator(settings.sampling.seed, target.device),
        verify_cost=tree_verify_cost(policy, tree),
        lookup=lookup,
    )


def _policy(context: PolicyContext, tree: bool) -> DraftLengthPolicy:
    # a head step costs a few percent of a target pass: the adaptive policy learns it from the first rounds
    return heads_policy(context, tree)


METHODS = (
    Method(
        name="eagle",
        label="EAGLE-3 head on the target's features and prompt lookup, a tree of candidates (no draft model)",
        build=lambda context: _build(context, tree=True),
        options=EagleOptions,
        drafts_for_free=True,
        proposes_trees=True,
        needs_hidden_states=True,
        check=_check,
        describe=_describe,
        make_policy=lambda context: _policy(context, tree=True),
    ),
    Method(
        name="eagle-chain",
        label="EAGLE-3 head on the target's features, a chain of its top tokens (no draft model)",
        build=lambda context: _build(context, tree=False),
        options=EagleOptions,
        drafts_for_free=True,
        needs_hidden_states=True,
        check=_check,
        describe=_describe,
        make_policy=lambda context: _policy(context, tree=False),
    ),
)
