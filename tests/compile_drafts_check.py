"""A report, not a test: what drafts, eager against compiled (inductor, as ``--compile on`` gives on a CPU), with
the offline pack.

The shipped EAGLE head's tree step (4 rows) and chain step (1 row) after 300 committed positions, the shipped Medusa
heads' features, and the offline 0.5B draft's step (its int8 copy eager, bfloat16 eager, bfloat16 compiled):
medians of 15 after 3 untimed calls (the first of which compiles), milliseconds. Run it alone on the cores:

    python tests/compile_drafts_check.py [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable

import torch

from specdemo.backends.eagle3_checkpoint import head_for
from specdemo.backends.eagle3_head import HeadKVCache
from specdemo.backends.eagle3_static import StaticHeadCache
from specdemo.backends.loading import LoadedModel, LoadSettings, load_model
from specdemo.backends.medusa_checkpoint import heads_for
from specdemo.backends.passes import EAGER, Passes
from specdemo.core.settings import SamplingSettings
from specdemo.methods.draft_model import DraftModelDrafter

COMPILED = Passes("default")
TARGET, DRAFT = "offline:qwen2.5-coder-1.5b", "offline:qwen2.5-coder-0.5b"


def median_ms(step: Callable[[], object], repeats: int = 15, untimed: int = 3) -> float:
    times = []
    for index in range(repeats + untimed):
        started = time.perf_counter()
        step()
        if index >= untimed:
            times.append(time.perf_counter() - started)
    return round(statistics.median(times) * 1000, 2)


@torch.inference_mode()
def eagle_head_steps(target: LoadedModel) -> dict:
    head = head_for(target)
    rows = torch.randn(300, head.config.hidden_size, dtype=head.dtype)
    visible = torch.ones(4, 304, dtype=torch.bool)
    report = {}
    for name, cache in (("eager", HeadKVCache()), ("compiled", StaticHeadCache(head, 428, COMPILED.compile_mode))):
        cache.step(head, rows, rows, torch.arange(300), all_logits=False)

        def tree(cache=cache) -> None:
            cache.crop(300)
            cache.step(head, rows[:4], rows[:4], torch.full((4,), 300), visible)

        def chain(cache=cache) -> None:
            cache.crop(300)
            cache.step(head, rows[:1], rows[:1], torch.tensor([300]))

        report[name] = {"tree_4_rows_ms": median_ms(tree), "chain_1_row_ms": median_ms(chain)}
    return report


@torch.inference_mode()
def medusa_features(target: LoadedModel) -> dict:
    heads = heads_for(target)
    hidden = torch.randn(1, heads.config.hidden_size, dtype=target.dtype)
    return {name: median_ms(lambda features=passes.medusa_features(heads): features(hidden))
            for name, passes in (("eager", EAGER), ("compiled", COMPILED))}


@torch.inference_mode()
def draft_steps(draft: LoadedModel) -> dict:
    prompt = list(range(1000, 1300))
    report = {}
    for name, int8, passes in (("int8 eager", True, EAGER), ("bfloat16 eager", False, EAGER),
                               ("bfloat16 compiled", False, COMPILED)):
        drafter = DraftModelDrafter(draft.model, SamplingSettings(), 151936, int8=int8, passes=passes,
                                    max_new_tokens=128)
        drafter.start(prompt)
        drafter.propose(prompt + [5], 1)  # the prompt's catch-up (and the compiling)
        feed = torch.tensor([7])

        def step(drafter=drafter) -> None:
            drafter._logits(feed)
            drafter.lm.rollback(1)

        report[name] = median_ms(step)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the report here too")
    args = parser.parse_args()
    target = load_model(TARGET, LoadSettings(dtype="bfloat16"), progress=False)
    report = {"eagle_head_ms": eagle_head_steps(target), "medusa_features_ms": medusa_features(target)}
    report["draft_0.5b_step_ms"] = draft_steps(load_model(DRAFT, LoadSettings(dtype="bfloat16"), progress=False))
    print(json.dumps(report, indent=1))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(report, handle, indent=1)


if __name__ == "__main__":
    main()
