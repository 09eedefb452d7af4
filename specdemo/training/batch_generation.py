"""The target writing many continuations at once: a batch of prompts (left padded) through transformers'
``generate``, greedy or sampled, each continuation cut after its first stop token; and the batch size that writes
the most tokens per second on the machine at hand, measured.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

if TYPE_CHECKING:
    from ..backends.loading import LoadedModel

logger = logging.getLogger(__name__)

#: the batch sizes :func:`fastest_batch_size` tries (measured on a 2-core AMD EPYC, bfloat16, 32 new tokens after
#: chat prompts: 1 row 4.9 tokens/s, 8 rows 20.5, 32 rows 27.9, 64 rows 22.7; the prompts' own pass is most of such
#: a short run, so :func:`fastest_batch_size` times longer answers)
BATCH_SIZES = (16, 32, 64)


@dataclass(frozen=True)
class Sampling:
    """How a batch samples (None in :func:`generate_batch`: greedy); ``seed`` seeds torch's generator per batch."""

    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0


def pad_id(loaded: "LoadedModel") -> int:
    tokenizer = loaded.tokenizer
    if tokenizer.pad_token_id is not None:
        return int(tokenizer.pad_token_id)
    return min(loaded.eos_token_ids, default=0)


@torch.inference_mode()
def generate_batch(loaded: "LoadedModel", headers: Sequence[Sequence[int]], max_new_tokens: int,
                   stop_ids: Sequence[int], sampling: Sampling | None = None, min_new_tokens: int = 0,
                   ) -> list[tuple[list[int], bool]]:
    """Each header's continuation, cut after its first stop token, and whether it stopped (False: it ran to
    ``max_new_tokens``). ``min_new_tokens``: no row stops before (for timing a batch at a fixed length)."""
    model = loaded.model
    padding = pad_id(loaded)
    width = max(len(header) for header in headers)
    device = next(model.parameters()).device
    ids = torch.tensor([[padding] * (width - len(h)) + list(h) for h in headers], device=device)
    mask = torch.tensor([[0] * (width - len(h)) + [1] * len(h) for h in headers], device=device)
    options: dict = {"do_sample": False}
    if sampling is not None:
        torch.manual_seed(sampling.seed)
        options = {"do_sample": True, "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": 0}
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, pad_token_id=padding,
                         eos_token_id=list(stop_ids), min_new_tokens=min_new_tokens, **options)
    stops = set(stop_ids)
    continuations = []
    for row in out[:, width:].tolist():
        kept: list[int] = []
        stopped = False
        for token in row:
            kept.append(token)
            if token in stops:
                stopped = True
                break
        continuations.append((kept, stopped))
    return continuations


def fastest_batch_size(loaded: "LoadedModel", headers: Sequence[Sequence[int]], new_tokens: int = 96,
                       sizes: Sequence[int] = BATCH_SIZES) -> tuple[int, dict[int, float]]:
    """The batch size that wrote the most tokens per second over ``headers`` (the first of them, as many as the
    largest size), each size timed once after a short warm-up, greedy, every row ``new_tokens`` long; and the
    measured tokens per second of each size."""
    usable = [size for size in sizes if size <= len(headers)] or [len(headers)]
    stops = loaded.eos_token_ids
    generate_batch(loaded, headers[:2], 4, stops, min_new_tokens=4)  # warm-up: first-call costs out of the timings
    rates: dict[int, float] = {}
    for size in usable:
        started = time.perf_counter()
        generate_batch(loaded, headers[:size], new_tokens, stops, min_new_tokens=new_tokens)
        rates[size] = size * new_tokens / (time.perf_counter() - started)
        logger.info("batch of %d: %.1f tokens/s", size, rates[size])
    return max(rates, key=rates.__getitem__), rates
