"""EAGLE-3 heads on disk: the three checkpoint layouts, the fit checks against a target, the heads shipped with
specdemo, and the per-target cache of loaded heads.

Heads load from three layouts: this project's own (:func:`save_head`: ``config.json`` with ``specdemo_format``
and ``model.safetensors``, its matrices in a float dtype or in int8 with per-row scales), the original EAGLE-3
checkpoints (e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B: a
Llama-style ``config.json`` with ``draft_vocab_size``; ``pytorch_model.bin`` or ``model.safetensors`` with
``fc.weight``, ``midlayer.*``, ``norm.weight``, ``lm_head.weight``, ``d2t``, ``t2d``) and speculators' (``config.json``
with ``speculators_model_type: "eagle3"``, ``transformer_layer_config``, ``speculators_config.verifier``; the layer's
weights under ``layers.0.*``). In all three ``d2t[i]`` holds the offset target_id - i and ``t2d`` is a mask over the
target's vocabulary. A Hub id is fetched with huggingface_hub's snapshot download; weights are read with
safetensors or ``torch.load(weights_only=True)``, never with remote code.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from ..core.errors import InputError, first_line
from ..core.files import atomic_path, file_sha256
from .eagle3_head import (
    CPU_HEAD_FORMATS,
    EagleConfig,
    EagleHead,
    default_hidden_layers,
    fastest_head_format,
)
from .formats import INT8, W8A8, int8_rows, output_rows, output_weight, w8a8_kernel_available
from .loading import LoadedModel
from .offline import OFFLINE_MODELS, is_offline_source, offline_name, shipped_for

logger = logging.getLogger(__name__)

FORMAT = "specdemo-eagle3"
FORMAT_VERSION = 1
#: in this project's int8 layout, the per-row scales of matrix ``NAME`` are stored as ``NAME`` + this
SCALE_SUFFIX = "_scale"
#: the weights files a head folder may hold, in the order they are looked for
WEIGHTS_NAMES = ("model.safetensors", "pytorch_model.bin")
#: the heads shipped for offline targets (offline-pack name -> folder, sha256 of its weights file), checked on load;
#: trained here by ``python -m specdemo.training.eagle`` (provenance in the folder's training.json)
SHIPPED_HEADS: dict[str, tuple[Path, str]] = {
    "qwen2.5-coder-1.5b": (
        Path(__file__).resolve().parents[1] / "data" / "eagle" / "qwen2.5-coder-1.5b",
        "eaf8f123ebe4b26269966eca902db50f584f3f14514dbb584bd20f52de09203e",
    ),
}


class EagleLoadError(ValueError):
    """A head that cannot be loaded or does not fit the target, with a message fit to show as is."""



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
    if is_offline_source(target.source) and offline_name(target.source) in OFFLINE_MODELS:
        names.append(OFFLINE_MODELS[offline_name(target.source)].description.split(",")[0])  # its Hub name
    architectures = tuple(getattr(model.config, "architectures", None) or ()) + (type(model).__name__,)
    return TargetFacts(
        source=target.source,
        hidden_size=int(model.get_input_embeddings().embedding_dim),
        vocab_size=output_rows(model),
        num_layers=int(getattr(config, "num_hidden_layers", 0) or 0),
        names=tuple(n for n in names if n),
        architectures=architectures,
    )


def llama_fields(raw: dict) -> dict[str, Any]:
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
        fields = llama_fields(layer)
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
        fields = llama_fields(raw)
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
        fields = llama_fields(raw)
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
            if stored.dtype == torch.int8:  # this project's int8 layout: one scale per row beside it
                stored = _dequantized(stored, _row_scales(stored, state, stored_name, weights_path))
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


def _row_scales(values: torch.Tensor, state: dict[str, torch.Tensor], name: str, path: Path) -> torch.Tensor:
    """The per-row scales stored beside int8 matrix ``name``, checked to be one floating-point number a row."""
    scale = state.get(name + SCALE_SUFFIX)
    if values.dim() != 2 or scale is None or scale.shape != values.shape[:1] or not scale.is_floating_point():
        raise EagleLoadError(f"{path}: {name} is int8 without one floating-point scale per row "
                             f"({name}{SCALE_SUFFIX})")
    return scale


def _dequantized(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """An int8 matrix of :func:`save_head`'s int8 layout as float32, by its per-row scales."""
    return values.float() * scale.float()[:, None]


def as_written(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The float32 values weight ``name`` holds once :func:`save_head` has written it in ``dtype`` and
    :func:`load_head` has read it back."""
    stored = _stored_tensors(name, tensor, dtype)
    values = stored[name]
    return _dequantized(values, stored[name + SCALE_SUFFIX]) if values.dtype == torch.int8 else values.float()


def _stored_tensors(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """What the weights file holds for one weight: the tensor in ``dtype``; for int8, a matrix as int8 values and
    float32 scales per row (``name`` + :data:`SCALE_SUFFIX`), a vector in bfloat16."""
    tensor = tensor.detach().to("cpu", torch.float32)
    if dtype != torch.int8:
        return {name: tensor.to(dtype).contiguous()}
    if tensor.dim() != 2:
        return {name: tensor.to(torch.bfloat16).contiguous()}
    values, scale = int8_rows(tensor)
    return {name: values.contiguous(), name + SCALE_SUFFIX: scale.contiguous()}


def save_head(
    head: EagleHead, folder: str | Path, dtype: torch.dtype = torch.bfloat16, extra: dict | None = None
) -> str:
    """Write a head in this project's layout (config.json, model.safetensors with ``fc``, ``midlayer.*``,
    ``norm``, ``lm_head`` (not for a shared LM head), ``d2t`` offsets and the ``t2d`` mask, as EAGLE-3's
    checkpoints hold them); returns the weights file's sha256. With ``dtype`` int8 each matrix is stored as int8
    values with one float32 scale per row beside it (half the bytes of bfloat16; the vectors in bfloat16)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = head.config
    state: dict[str, torch.Tensor] = {}
    for name, tensor in head.state_dict().items():
        if not (name == "lm_head.weight" and config.shared_lm_head):
            state.update(_stored_tensors(name, tensor, dtype))
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


#: heads loaded per target model (freed with it), by source
_HEADS: "weakref.WeakKeyDictionary[nn.Module, dict[str, EagleHead]]" = weakref.WeakKeyDictionary()


def head_for(target: LoadedModel, source: str | None = None) -> EagleHead:
    """The EAGLE-3 head for ``target`` in its dtype and on its device (beside an int8 or w8a8 target on a CPU: in
    the fastest of :data:`CPU_HEAD_FORMATS`): from ``source`` (a folder or Hub id), or the head shipped for an
    offline target (sha256-checked); InputError with one line when there is none or it misfits."""
    expected_sha256 = None
    if source is None:
        shipped = shipped_for(SHIPPED_HEADS, target.source)
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


