"""The target writing many continuations at once: a batch of prompts (left padded), greedy or sampled, each
continuation cut after its first stop token; and the batch size that writes the most tokens per second on the
machine at hand, measured.

The batches go through a loop of the model's own passes over transformers' ``DynamicCache``
(:func:`generate_batch`) rather than through ``generate``: ``generate`` computes every row until the last one stops,
and in the pool's answer batches (64 rows, up to 256 tokens) 39 % of the rows it computed had stopped already. In
this loop a row that stopped leaves the batch, its cache rows dropped with the cache's ``batch_select_indices``.
The passes, positions and choices are ``generate``'s: greedy answers are the same token for token (a test), and a
sampled batch draws from the distribution the project's own sampling uses
(:func:`~specdemo.core.acceptance.target_distribution`), seeded per batch.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable, Sequence

import torch
from transformers import DynamicCache

from ..backends.transformers_lm import cache_keyword
from ..core.acceptance import target_distribution
from ..core.settings import SamplingSettings

if TYPE_CHECKING:
    from ..backends.loading import LoadedModel

logger = logging.getLogger(__name__)

#: the batch sizes :func:`fastest_batch_size` tries. Measured on a 2-core AMD EPYC, bfloat16, 1.5B target, chat
#: prompts: 32 new tokens, 1 row 4.9 tokens/s, 8 rows 20.5, 32 rows 27.9, 64 rows 22.7 (the prompts' own pass is most
#: of such a short run, so :func:`fastest_batch_size` times longer answers); one token a row after the prompts'
#: pass, 64 rows 83 rows/s, 128 rows 97 (47 passes, states recorded)
BATCH_SIZES = (32, 64, 128)


#: called before each pass of :func:`generate_batch` with the (original) indices of the rows in that pass
PassObserver = Callable[[torch.Tensor], None]


def pad_id(loaded: "LoadedModel") -> int:
    tokenizer = loaded.tokenizer
    if tokenizer.pad_token_id is not None:
        return int(tokenizer.pad_token_id)
    return min(loaded.eos_token_ids, default=0)


@torch.inference_mode()
def generate_batch(loaded: "LoadedModel", headers: Sequence[Sequence[int]], max_new_tokens: int,
                   stop_ids: Sequence[int], sampling: SamplingSettings | None = None, min_new_tokens: int = 0,
                   on_pass: PassObserver | None = None) -> list[tuple[list[int], bool]]:
    """Each header's continuation, cut after its first stop token, and whether it stopped (False: it ran to
    ``max_new_tokens``): greedy, or drawn as ``sampling`` says (its ``seed`` seeds the batch). ``min_new_tokens``:
    no row stops before (for timing a batch at a fixed length). ``on_pass`` is called before each pass with the
    rows it computes (the headers' indices): a row that stopped leaves the batch."""
    model = loaded.model
    device = next(model.parameters()).device
    ids, mask = _left_padded(headers, pad_id(loaded), device)
    stops = torch.tensor(sorted(set(stop_ids)), dtype=torch.long, device=device)
    generator = None
    if sampling is not None and not sampling.greedy:
        generator = torch.Generator(device=device).manual_seed(sampling.seed or 0)
    cache, keyword = DynamicCache(config=model.config), cache_keyword(model)
    rows = torch.arange(len(headers), device=device)  # the headers' indices of the rows still writing
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)  # as generate counts them
    continuations: list[list[int]] = [[] for _ in headers]
    stopped = [False] * len(headers)
    for step in range(max_new_tokens):
        if on_pass is not None:
            on_pass(rows)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                       logits_to_keep=1, **{keyword: cache}).logits[:, -1]
        if step < min_new_tokens and stops.numel():
            logits[:, stops] = float("-inf")
        tokens = _choose(logits, sampling, generator)
        ended = torch.isin(tokens, stops)
        for row, token, end in zip(rows.tolist(), tokens.tolist(), ended.tolist()):
            continuations[row].append(token)
            stopped[row] = end
        going = (~ended).nonzero().squeeze(1)
        if step + 1 == max_new_tokens or going.numel() == 0:
            break
        if going.numel() < rows.numel():  # rows that stopped leave the batch, cache and all
            cache.batch_select_indices(going)
            rows, mask, tokens, positions = rows[going], mask[going], tokens[going], positions[going]
        ids, positions = tokens[:, None], positions[:, -1:] + 1
        mask = torch.cat([mask, mask.new_ones(rows.numel(), 1)], dim=1)
    return list(zip(continuations, stopped))


def _choose(logits: torch.Tensor, sampling: SamplingSettings | None, generator: torch.Generator | None,
            ) -> torch.Tensor:
    """Each row's next token: the argmax, or a draw from the warped distribution."""
    if sampling is None or sampling.greedy:
        return logits.argmax(-1)
    return torch.multinomial(target_distribution(logits, sampling), 1, generator=generator).squeeze(1)


def _left_padded(headers: Sequence[Sequence[int]], padding: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The headers left padded to the longest: ids and attention mask [B, width]."""
    width = max(len(header) for header in headers)
    ids = torch.tensor([[padding] * (width - len(h)) + list(h) for h in headers], device=device)
    mask = torch.tensor([[0] * (width - len(h)) + [1] * len(h) for h in headers], device=device)
    return ids, mask


def fastest_batch_size(loaded: "LoadedModel", headers: Sequence[Sequence[int]], new_tokens: int = 96,
                       sizes: Sequence[int] = BATCH_SIZES) -> tuple[int, dict[int, float]]:
    """The batch size that wrote the most tokens per second over ``headers``, each size timed once after a short
    warm-up, greedy, every row ``new_tokens`` long; and the measured tokens per second of each size. Each size
    answers the headers of the middle lengths, as many as it holds: the runs answer batches of prompts sorted by
    length, so a batch pads little (unsorted, a batch of 64 of the pool's prompts was padded to 470 tokens against
    139 on average, and the timing measured mostly the padding)."""
    usable = [size for size in sizes if size <= len(headers)] or [len(headers)]
    stops = loaded.eos_token_ids
    by_length = sorted(headers, key=len)
    generate_batch(loaded, by_length[:2], 4, stops, min_new_tokens=4)  # warm-up: first-call costs out of the timings
    rates: dict[int, float] = {}
    for size in usable:
        middle = (len(by_length) - size) // 2
        started = time.perf_counter()
        generate_batch(loaded, by_length[middle : middle + size], new_tokens, stops, min_new_tokens=new_tokens)
        rates[size] = size * new_tokens / (time.perf_counter() - started)
        logger.info("batch of %d: %.1f tokens/s", size, rates[size])
    return max(rates, key=rates.__getitem__), rates
