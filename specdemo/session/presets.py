"""Ready-made target/draft model pairs for speculative decoding."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ..backends import offline

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PairPreset:
    """A target model and a small draft model; ``mode`` is the speculative mode the pair is meant for
    ("draft" when both share a tokenizer, "uag" when they do not)."""

    key: str
    label: str
    target: str
    draft: str
    description: str
    hardware: str
    mode: str = "draft"
    #: a published EAGLE-3 head for the target (a Hub id), raised for the eagle modes when the user names none
    eagle_head: str | None = None
    #: the app process's measured resident memory after a race on this pair ("" where nobody measured it yet)
    resident_memory: str = ""


PRESETS: dict[str, PairPreset] = {
    preset.key: preset
    for preset in (
        PairPreset(
            key="offline-qwen-coder",
            label="Qwen2.5-Coder 1.5B + 0.5B (offline pack)",
            target="offline:qwen2.5-coder-1.5b",
            draft="offline:qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-1.5B-Instruct drafted by Qwen2.5-Coder-0.5B-Instruct, from the offline "
            "pack (Q4_K_M GGUF dequantized); no network needed.",
            hardware="CPU ok (2 cores, w8a8; ~5 GB RAM; first start ~2 min, 3 GB disk)",
            resident_memory="4.9 GB resident (app process, w8a8 target, CPU, int8 draft copy included)",
        ),
        PairPreset(
            key="qwen2.5-7b",
            label="Qwen2.5 7B + 0.5B (Hub)",
            target="Qwen/Qwen2.5-7B-Instruct",
            draft="Qwen/Qwen2.5-0.5B-Instruct",
            description="Qwen2.5-7B-Instruct drafted by Qwen2.5-0.5B-Instruct; downloads ~16 GB from the Hub.",
            hardware="GPU with ≥24 GB (or ≥12 GB with 8-bit)",
        ),
        PairPreset(
            key="llama-3.1-8b",
            label="Llama 3.1 8B + 3.2 1B (Hub, gated)",
            target="meta-llama/Llama-3.1-8B-Instruct",
            draft="meta-llama/Llama-3.2-1B-Instruct",
            description="Llama-3.1-8B-Instruct drafted by Llama-3.2-1B-Instruct; gated on the Hub: accept Meta's "
            "licence and log in (hf auth login) first.",
            hardware="GPU with ≥24 GB (or ≥12 GB with 8-bit)",
            eagle_head="yuhuili/EAGLE3-LLaMA3.1-Instruct-8B",
        ),
        PairPreset(
            key="smollm2-1.7b",
            label="SmolLM2 1.7B + 135M (Hub)",
            target="HuggingFaceTB/SmolLM2-1.7B-Instruct",
            draft="HuggingFaceTB/SmolLM2-135M-Instruct",
            description="SmolLM2-1.7B-Instruct drafted by SmolLM2-135M-Instruct; downloads ~4 GB from the Hub.",
            hardware="CPU ok (bf16; ~8 GB RAM), any GPU",
        ),
        PairPreset(
            key="qwen2.5-coder-7b",
            label="Qwen2.5-Coder 7B + 0.5B (Hub)",
            target="Qwen/Qwen2.5-Coder-7B-Instruct",
            draft="Qwen/Qwen2.5-Coder-0.5B-Instruct",
            description="Qwen2.5-Coder-7B-Instruct drafted by Qwen2.5-Coder-0.5B-Instruct; downloads ~16 GB "
            "from the Hub.",
            hardware="GPU with ≥24 GB (or ≥12 GB with 8-bit)",
        ),
        PairPreset(
            key="offline-smollm-qwen-coder",
            label="Qwen2.5-Coder 1.5B + SmolLM2 135M, different tokenizers (offline pack, uag)",
            target="offline:qwen2.5-coder-1.5b",
            draft="offline:smollm2-135m",
            description="Universal assisted generation: SmolLM2-135M-Instruct (its own tokenizer) drafts for "
            "Qwen2.5-Coder-1.5B-Instruct through text; no network needed.",
            hardware="CPU ok (bf16; ~5 GB RAM)",
            resident_memory="4.3–4.4 GB resident (app process, bf16, CPU)",
            mode="uag",
        ),
        PairPreset(
            key="offline-smollm-qwen-coder-0.5b",
            label="Qwen2.5-Coder 0.5B + SmolLM2 135M, different tokenizers (offline pack, uag)",
            target="offline:qwen2.5-coder-0.5b",
            draft="offline:smollm2-135m",
            description="Universal assisted generation with the smaller Qwen target; no network needed.",
            hardware="CPU ok (bf16; ~3 GB RAM)",
            resident_memory="2.1 GB resident (bf16, CPU, one race in a process with the app's modules)",
            mode="uag",
        ),
        PairPreset(
            key="gemma-2-9b-uag",
            label="Gemma 2 9B + SmolLM2 135M, different tokenizers (Hub, uag)",
            target="google/gemma-2-9b-it",
            draft="HuggingFaceTB/SmolLM2-135M-Instruct",
            description="Universal assisted generation: a SmolLM2 draft for a Gemma target (gated: accept the "
            "licence on the Hub first).",
            hardware="GPU with ≥24 GB",
            mode="uag",
        ),
        PairPreset(
            key="qwen2.5-7b-uag",
            label="Qwen2.5 7B + Llama 3.2 1B, different tokenizers (Hub, uag)",
            target="Qwen/Qwen2.5-7B-Instruct",
            draft="meta-llama/Llama-3.2-1B-Instruct",
            description="Universal assisted generation: a small Llama drafts for a Qwen target (the Llama draft "
            "is gated).",
            hardware="GPU with ≥24 GB",
            mode="uag",
        ),
    )
}

OFFLINE_PRESET_KEY = "offline-qwen-coder"


def get_preset(key: str) -> PairPreset:
    """The preset called ``key``; ValueError listing the known keys otherwise."""
    try:
        return PRESETS[key]
    except KeyError:
        raise ValueError(f"unknown preset '{key}'; known: {', '.join(PRESETS)}") from None


def preset_installed(preset: PairPreset) -> bool:
    """True when every offline model of ``preset`` is installed (Hub models count as available)."""
    for source in (preset.target, preset.draft):
        if offline.is_offline_source(source) and not offline.offline_installed(offline.offline_name(source)):
            return False
    return True


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def default_preset_key() -> str:
    """The offline pair when its pack is installed, else a Hub pair suited to the hardware."""
    if preset_installed(PRESETS[OFFLINE_PRESET_KEY]):
        return OFFLINE_PRESET_KEY
    return "qwen2.5-7b" if _cuda_available() else "smollm2-1.7b"


def preset_eagle_head(preset: PairPreset | None, target_source: str) -> str | None:
    """The published EAGLE-3 head of ``preset``'s target when ``target_source`` is that target, else None."""
    if preset is None or target_source != preset.target:
        return None
    return preset.eagle_head


def preset_choices() -> list[tuple[str, str]]:
    """``(label, key)`` pairs in display order, for a dropdown."""
    return [(preset.label, preset.key) for preset in PRESETS.values()]
