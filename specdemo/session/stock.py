"""transformers' own ``generate``, stock, as modes to compare the engine's with (the bench's ``hf-*`` modes).

:data:`STOCK_MODES` is their one registry, beside the engine's (:data:`specdemo.methods.METHODS`): what each mode
hands ``generate``, and whether it needs a draft model. :func:`run_stock` runs one and times it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..backends.loading import LoadedModel
from ..core.clock import now
from ..core.errors import InputError
from ..core.settings import GenerationSettings

if TYPE_CHECKING:
    from transformers import GenerationConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StockMode:
    """One way of calling transformers' ``generate``."""

    name: str
    description: str
    #: the draft model goes to ``generate`` as ``assistant_model``
    needs_draft_model: bool = False
    #: the draft has another tokenizer: both tokenizers go to ``generate`` too (universal assisted generation)
    other_tokenizer: bool = False
    #: ``generate`` drafts by prompt lookup, ``prompt_lookup_num_tokens`` at a time
    prompt_lookup: bool = False
    #: ``generate`` runs on a static cache and compiles its one-token step itself (on every device)
    static_cache: bool = False


#: transformers' own implementations, run in the same process for comparison
STOCK_MODES: dict[str, StockMode] = {
    mode.name: mode
    for mode in (
        StockMode("hf-plain", "model.generate(do_sample=...) (stock baseline)"),
        StockMode("hf-static", "model.generate(cache_implementation='static'), compiled by generate itself "
                  "(CUDA graphs on a GPU, inductor on a CPU)", static_cache=True),
        StockMode("hf-assisted", "model.generate(assistant_model=draft), transformers' defaults",
                  needs_draft_model=True),
        StockMode("hf-lookup", "model.generate(prompt_lookup_num_tokens=N)", prompt_lookup=True),
        StockMode(
            "hf-uag",
            "model.generate(assistant_model=draft, tokenizer=..., assistant_tokenizer=...) (different tokenizers)",
            needs_draft_model=True,
            other_tokenizer=True,
        ),
    )
}


@dataclass
class StockRun:
    """One timed ``generate`` call: its new tokens, their text and the wall clock around it."""

    ids: list[int]
    text: str
    seconds: float


def generation_config(target: LoadedModel, settings: GenerationSettings) -> GenerationConfig:
    """The ``GenerationConfig`` of ``settings``: sampling or greedy, stopping at the target's end tokens."""
    from transformers import GenerationConfig

    sampling = settings.sampling
    config = GenerationConfig(
        max_new_tokens=settings.max_new_tokens,
        do_sample=not sampling.greedy,
        eos_token_id=target.eos_token_ids or None,
        pad_token_id=(target.eos_token_ids or [0])[0],
    )
    if not sampling.greedy:
        config.temperature = sampling.temperature
        config.top_p = sampling.top_p
        config.top_k = sampling.top_k or None
    else:
        config.temperature = None
        config.top_p = None
        config.top_k = None
    return config


def static_generation(config: GenerationConfig, device: torch.device, cache_tokens: int | None) -> None:
    """``config`` with a static cache of ``cache_tokens`` (one size for every call, so ``generate`` compiles its
    step once) and ``generate``'s own compilation: CUDA graphs on a GPU; on a CPU, where ``generate`` does not
    compile unless told to, inductor."""
    from transformers import CompileConfig

    config.cache_implementation = "static"
    if cache_tokens is not None:
        config.max_cache_len = cache_tokens
    compile_config = CompileConfig(mode="reduce-overhead" if device.type == "cuda" else "default")
    # transformers' own switch for compiling on devices its criteria leave out (the CPU); no public setter
    compile_config._compile_all_devices = True
    config.compile_config = compile_config


def _generate_kwargs(
    mode: StockMode, target: LoadedModel, draft: LoadedModel | None, lookup_tokens: int
) -> dict[str, Any]:
    """What ``mode`` hands ``generate`` beside the prompt and the generation config."""
    kwargs: dict[str, Any] = {}
    if mode.needs_draft_model:
        if draft is None:
            raise InputError(f"{mode.name} needs a draft model")
        kwargs["assistant_model"] = draft.model
        if mode.other_tokenizer:
            kwargs.update(tokenizer=target.tokenizer, assistant_tokenizer=draft.tokenizer)
    if mode.prompt_lookup:
        kwargs["prompt_lookup_num_tokens"] = lookup_tokens
    return kwargs


def run_stock(
    name: str,
    target: LoadedModel,
    draft: LoadedModel | None,
    prompt_ids: list[int],
    settings: GenerationSettings,
    lookup_tokens: int,
    cache_tokens: int | None = None,
) -> StockRun:
    """One run of the stock mode ``name`` on ``prompt_ids``, timed around ``generate`` alone; ``cache_tokens``: the
    longest prompt and answer of the whole comparison (a static cache is sized for it)."""
    mode = STOCK_MODES[name]
    kwargs = _generate_kwargs(mode, target, draft, lookup_tokens)
    config = generation_config(target, settings)
    if mode.static_cache:
        static_generation(config, target.device, cache_tokens)
    input_ids = torch.tensor([prompt_ids], device=target.device)
    if settings.sampling.seed is not None:
        torch.manual_seed(settings.sampling.seed)  # transformers samples from the global RNG (bench process only)
    start = now(target.device)
    with torch.inference_mode():
        out = target.model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            generation_config=config,
            **kwargs,
        )
    seconds = now(target.device) - start
    ids = out[0, len(prompt_ids) :].tolist()
    return StockRun(ids, target.tokenizer.decode(ids, skip_special_tokens=True), seconds)
