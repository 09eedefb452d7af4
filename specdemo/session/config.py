"""What a racing session serves and how: :class:`SessionConfig`.

It holds the pair presets, the device and the default format, the limits on what a race may ask for, and how models
are loaded, warmed up, calibrated and freed. The recorder races with it as is; the app's
:class:`~specdemo.app.config.AppConfig` adds the page's own settings on top.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..backends.loading import (
    CacheKey,
    LoadedModel,
    ModelLoadError,
    load_model,
    resolve_device,
)
from .pipeline import release_models
from .presets import PRESETS, PairPreset, default_preset_key

logger = logging.getLogger(__name__)

#: tokens of the untimed warm-up run a pair and mode get before their first timed run (the app, the recorder and
#: the bench alike: see :func:`specdemo.session.racer.warm_up`)
WARMUP_TOKENS = 16
#: default cap on prompt tokens: a prompt pass is cheap on a GPU, tens of seconds per thousand tokens on a CPU
DEFAULT_MAX_PROMPT_TOKENS = {"cpu": 2048, "mps": 4096, "cuda": 8192}

#: ``load_model(source, settings, progress=..., on_progress=...)``, or a stand-in with that signature
Loader = Callable[..., LoadedModel]


def default_max_prompt_tokens(device_type: str) -> int:
    """The prompt cap that fits the hardware: 2,048 tokens on a CPU, more on a GPU."""
    return DEFAULT_MAX_PROMPT_TOKENS.get(device_type, DEFAULT_MAX_PROMPT_TOKENS["cuda"])


def cuda_quantization_reason() -> str | None:
    """Why 4-bit/8-bit loading is unavailable here, or None when it is available."""
    if not torch.cuda.is_available():
        return "4-bit/8-bit needs a CUDA GPU (bitsandbytes); none found"
    if importlib.util.find_spec("bitsandbytes") is None:
        return "4-bit/8-bit needs the bitsandbytes package (pip install bitsandbytes)"
    return None


@dataclass
class SessionConfig:
    """What a session races: presets, device, format, limits, and how models are loaded and freed."""

    pair: str | None = None  # default pair preset key (None: the offline pair when installed)
    device: str = "auto"
    dtype: str = "auto"
    custom_models: bool = True  # custom target/draft sources allowed (switch off for hosted use)
    #: strangers reach this session (a Space, --share, bound beyond loopback): custom sources are Hub ids only, or
    #: folders under ``model_roots``, and Hub downloads are capped at ``max_download_gb``
    hosted: bool = False
    model_roots: tuple[str, ...] = ()
    max_download_gb: float = 16.0
    presets: dict[str, PairPreset] = field(default_factory=lambda: dict(PRESETS))
    loader: Loader = load_model
    #: called when the pair changes, with the cache keys of the new pair's models, to free every other model
    #: (None: keep everything)
    forget_models: Callable[[frozenset[CacheKey]], None] | None = release_models
    max_new_tokens_limit: int = 2048
    max_prompt_tokens: int | None = None  # cap on prompt tokens; None: 2,048 on a CPU, more on a GPU
    race_time_budget: float | None = None  # seconds of wall clock per race before it stops; None: no limit
    medusa_heads: str | None = None  # Medusa heads folder for the medusa modes; None: the target's shipped heads
    #: EAGLE-3 head (folder or Hub id) for the eagle modes; None: the head shipped for the target, or its preset's
    eagle_head: str | None = None
    calibrate: bool = True  # measure (once per machine, model and format) what a pass costs here
    warmup_tokens: int = WARMUP_TOKENS  # the untimed warm-up run the first time a pair and mode race (0: none)
    #: how the target's passes run (``--compile``): auto (compiled on a GPU, eager on a CPU), on or off; compiling
    #: happens while a pair and mode are prepared, before the race
    compile: str = "auto"
    zero_gpu: bool = False  # a ZeroGPU Space: the GPU comes and goes, nothing is compiled at run time
    quantization_reason: str | None = "auto"  # "auto": detect; None: available; text: why it is unavailable

    def default_pair(self) -> str:
        """The preset raced when a request names none."""
        if self.pair:
            if self.pair not in self.presets:
                raise ValueError(f"unknown pair preset {self.pair!r}; known: {', '.join(self.presets)}")
            return self.pair
        if set(PRESETS) <= set(self.presets):
            return default_preset_key()
        return next(iter(self.presets))

    def prompt_token_limit(self) -> int:
        """The cap on prompt tokens: the configured one, else the default for this session's device."""
        if self.max_prompt_tokens is not None:
            return self.max_prompt_tokens
        try:
            device_type = resolve_device(self.device).type
        except (ModelLoadError, RuntimeError, ValueError):
            device_type = "cpu"
        return default_max_prompt_tokens(device_type)

    def quantization_unavailable(self) -> str | None:
        """Why 4-bit/8-bit loading cannot be asked for here, or None when it can."""
        if self.quantization_reason == "auto":
            if self.device.strip().lower() in ("cpu", "mps"):
                return f"4-bit/8-bit needs a CUDA GPU; this app runs on {self.device}"
            return cuda_quantization_reason()
        return self.quantization_reason
