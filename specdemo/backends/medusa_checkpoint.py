"""Medusa heads on disk: reading FasterDecoding's layout, the fit checks against a target, the heads shipped with
specdemo, and the per-target cache of loaded heads."""

from __future__ import annotations

import json
import logging
import weakref
from pathlib import Path

import torch

from ..core.errors import InputError
from ..core.files import file_sha256
from .loading import LoadedModel
from .medusa_heads import WEIGHTS_NAMES, MedusaConfig, MedusaHeads
from .offline import shipped_for

logger = logging.getLogger(__name__)

#: the heads shipped for the offline target, and the sha256 of their weights file (checked on load)
SHIPPED_HEADS: dict[str, tuple[Path, str]] = {
    "qwen2.5-coder-1.5b": (
        Path(__file__).resolve().parents[1] / "data" / "medusa" / "qwen2.5-coder-1.5b",
        "618166726f8b3bbe1f989b4f9be9c57ae45f0808ee2000a004e2af5b6823fd65",
    ),
}


class MedusaLoadError(ValueError):
    """Heads that cannot be loaded or do not fit the target, with a message fit to show as is."""



def weights_file(folder: Path) -> Path | None:
    """A heads folder's weights file: the first of :data:`WEIGHTS_NAMES` there (None: none)."""
    return next((folder / name for name in WEIGHTS_NAMES if (folder / name).is_file()), None)


def _read_state(folder: Path) -> tuple[dict[str, torch.Tensor], Path]:
    path = weights_file(folder)
    if path is None:
        raise MedusaLoadError(f"no Medusa heads in {folder}: expected {' or '.join(WEIGHTS_NAMES)} and config.json")
    try:
        if path.name.endswith(".safetensors"):
            from safetensors.torch import load_file

            return load_file(str(path)), path
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # corrupt or foreign file: one line, not a traceback
        raise MedusaLoadError(f"cannot read Medusa heads from {path}: {type(error).__name__}: {error}") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise MedusaLoadError(f"{path} holds no tensor dictionary of Medusa heads")
    return state, path


def load_heads(
    source: str | Path,
    hidden_size: int,
    vocab_size: int,
    expected_sha256: str | None = None,
) -> MedusaHeads:
    """Heads from a folder in FasterDecoding's layout, checked against the target's hidden size and vocabulary.

    ``expected_sha256``: refuse a weights file whose digest differs (the shipped heads are checked this way).
    """
    folder = Path(source).expanduser()
    if not folder.is_dir():
        raise MedusaLoadError(f"Medusa heads not found: {source} is not a folder")
    try:
        raw = json.loads((folder / "config.json").read_text())
        num_heads = int(raw["medusa_num_heads"])
        num_layers = int(raw.get("medusa_num_layers", 1))
    except FileNotFoundError:
        raise MedusaLoadError(f"no config.json in {folder}: not a Medusa heads folder") from None
    except (ValueError, KeyError, TypeError) as error:
        raise MedusaLoadError(f"{folder / 'config.json'} is not a Medusa config ({error})") from None
    state, weights_path = _read_state(folder)
    if expected_sha256 is not None:
        digest = file_sha256(weights_path)
        if digest != expected_sha256:
            raise MedusaLoadError(
                f"{weights_path} is damaged or replaced: sha256 {digest[:16]}…, expected {expected_sha256[:16]}…"
            )
    if num_heads < 1 or num_layers < 0:
        raise MedusaLoadError(f"{folder}: medusa_num_heads must be >= 1 and medusa_num_layers >= 0")
    own_lm_head = f"0.{num_layers}.weight" in state
    for k in range(num_heads):
        for layer in range(num_layers):
            weight = state.get(f"{k}.{layer}.linear.weight")
            if weight is None or f"{k}.{layer}.linear.bias" not in state:
                raise MedusaLoadError(f"{weights_path}: missing weights of head {k}, layer {layer}")
            if tuple(weight.shape) != (hidden_size, hidden_size):
                raise MedusaLoadError(
                    f"these Medusa heads are for hidden size {weight.shape[-1]}, the target's is {hidden_size}"
                )
        if own_lm_head:
            head = state.get(f"{k}.{num_layers}.weight")
            if head is None:
                raise MedusaLoadError(f"{weights_path}: head {k} has no LM head weight")
            if head.shape[1] != hidden_size:
                raise MedusaLoadError(
                    f"these Medusa heads are for hidden size {head.shape[1]}, the target's is {hidden_size}"
                )
            if head.shape[0] != vocab_size:
                raise MedusaLoadError(
                    f"these Medusa heads score a vocabulary of {head.shape[0]} tokens, the target's has {vocab_size}"
                )
    declared_vocab = raw.get("vocab_size")
    if not own_lm_head and declared_vocab is not None and int(declared_vocab) != vocab_size:
        raise MedusaLoadError(f"these Medusa heads are for a vocabulary of {declared_vocab} tokens, the target's has "
                              f"{vocab_size}")
    if num_layers == 0 and not own_lm_head:
        raise MedusaLoadError(f"{weights_path}: heads with no layers need an LM head of their own")
    config = MedusaConfig(
        num_heads=num_heads,
        num_layers=num_layers,
        hidden_size=hidden_size,
        vocab_size=vocab_size,
        own_lm_head=own_lm_head,
        head_tokens=int(raw.get("head_tokens", 0) or 0),
        base_model=str(raw.get("base_model_name_or_path", "")),
    )
    heads = MedusaHeads(config)
    own = heads.state_in_fasterdecoding_layout()
    with torch.no_grad():
        for name, tensor in own.items():
            tensor.copy_(state[name].float())
    heads.eval().requires_grad_(False)
    return heads


#: Medusa heads loaded per target model (freed with it), by source folder
_HEADS: "weakref.WeakKeyDictionary[torch.nn.Module, dict[str, MedusaHeads]]" = weakref.WeakKeyDictionary()


def heads_for(target: LoadedModel, source: str | None = None) -> MedusaHeads:
    """The Medusa heads for ``target`` in its format and on its device: from ``source`` (a folder), or the heads
    shipped for an offline target (sha256-checked); InputError with one line when there are none or they misfit."""
    expected_sha256 = None
    if source is None:
        shipped = shipped_for(SHIPPED_HEADS, target.source)
        if shipped is None:
            raise InputError(
                f"no Medusa heads ship for {target.source}: name a heads folder (--medusa-heads PATH), or use "
                "offline:qwen2.5-coder-1.5b",
                field="medusa_heads",
            )
        folder, expected_sha256 = shipped
        source = str(folder)
    per_model = _HEADS.setdefault(target.model, {})
    if source in per_model:
        return per_model[source]
    head = target.model.get_output_embeddings()
    try:
        heads = load_heads(source, head.in_features, head.out_features, expected_sha256)
    except MedusaLoadError as error:
        raise InputError(str(error), field="medusa_heads") from None
    heads = heads.to(device=target.device, dtype=target.dtype)
    per_model[source] = heads
    return heads


