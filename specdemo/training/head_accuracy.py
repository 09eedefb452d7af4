"""How often an EAGLE-3 head drafts right on a bench run's own outputs:
``python -m specdemo.training.head_accuracy RESULTS.json``.

A bench results file (``python -m specdemo.bench --json``) holds every prompt's token ids and plain decoding's
output (``prompt_ids``, ``new_token_ids``). The target runs once over each with teacher forcing, in the format the
run used (or ``--dtype``), and the head (the shipped one, or ``--eagle-head``, in the format a race would run it
in) is scored as the trainer scores its held-out text (:func:`~specdemo.training.eagle.evaluate`): top-1 per draft
step against the target's greedy token, and the mean accepted drafts of greedy chains; per category and over all,
with the share of the target's tokens inside the head's draft vocabulary, and how often the head's first draft,
prompt lookup's (the n-gram drafter's) or either of them is right at the same positions. Set beside the trainer's held-out figures
(``training.json``), these say whether a head falls short on a benchmark because of what it learned from. Nothing
here trains, and nothing is written but ``--json``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

import torch

from ..backends.eagle3_checkpoint import head_for
from ..backends.loading import LoadSettings, ModelLoadError, load_model
from ..backends.offline import OfflinePackError
from ..core.errors import InputError, first_line
from ..core.files import write_json_atomic
from ..methods.ngram import NgramIndex, NgramOptions
from ..session.results import PlainRun, read_plain_runs
from .eagle_cache import sequence_states
from .eagle_unrolled import Split, evaluate, make_batch, unrolled_forward

logger = logging.getLogger(__name__)

#: draft steps scored (the shipped head is trained four deep)
STEPS = 4


def plain_runs(path: Path) -> tuple[dict[str, Any], list[PlainRun]]:
    """The results file's ``config`` and its plain runs that carry their prompt's token ids (InputError else)."""
    config, runs = read_plain_runs(path)
    runs = [run for run in runs if run.prompt_ids is not None]
    if not runs:
        raise InputError(f"{path} holds no plain run with its prompt's token ids: run the bench again")
    return config, runs


def target_splits(model, runs: list[PlainRun], layers: tuple[int, ...], vocab_size: int) -> list[Split]:
    """Each run's prompt and answer with the target's states of ``layers`` and its greedy tokens, as the trainer
    caches them (:func:`~specdemo.training.eagle.sequence_states`)."""
    splits = []
    for run in runs:
        ids = run.prompt_ids + run.new_token_ids
        if max(ids) >= vocab_size:
            raise InputError(f"run {run.id!r} holds token ids outside the target's {vocab_size}: another target's")
        cached = sequence_states(model, ids, len(run.prompt_ids), layers)
        splits.append(Split(cached["ids"], cached["greedy"], cached["states"], torch.tensor([len(ids)]),
                            torch.tensor([cached["answer_start"]])))
    return splits


def first_draft_hits(head, embed: torch.Tensor, split: Split) -> tuple[torch.Tensor, torch.Tensor]:
    """For each answer position of a one-sequence ``split`` that has a label: whether the head's first draft is
    the target's greedy token, and whether prompt lookup's is (the n-gram drafter with its defaults, over the
    prompt and the answer so far, following its last right copy as the drafter does after an accepted draft)."""
    batch = make_batch(split, [0], 1)
    predicted = head.draft_ids[head.logits(unrolled_forward(head, embed, batch, 1)[0]).argmax(-1)]
    ids = split.ids.tolist()
    defaults = NgramOptions()
    index = NgramIndex(defaults.ngram_min, defaults.ngram_max, defaults.ngram_prefer)
    head_hits, lookup_hits = [], []
    for row in torch.nonzero(batch.active).flatten().tolist():
        label = int(batch.labels[0, row])
        if label < 0:
            continue
        index.extend(ids[: row + 2])  # row i reads token i + 1 and drafts the token after it
        copied, _ = index.copy(1)
        lookup_right = bool(copied) and copied[0] == label
        index.follow(int(lookup_right))
        head_hits.append(int(predicted[row]) == label)
        lookup_hits.append(lookup_right)
    return torch.tensor(head_hits, dtype=torch.bool), torch.tensor(lookup_hits, dtype=torch.bool)


def head_accuracy(results: Path, eagle_head: str | None = None, dtype: str | None = None) -> dict[str, Any]:
    """The head's figures on the results file's plain outputs: ``{"target", "dtype", "head_format",
    "by_category": {category: figures}, "all": figures}``, figures as :func:`~specdemo.training.eagle.evaluate`
    gives them plus ``inside_draft_vocab`` (the share of answer tokens the head can draft at all)."""
    config, runs = plain_runs(results)
    target = str(config.get("target") or "")
    dtype = dtype or str(config.get("dtype") or "auto")
    if not target:
        raise InputError(f"{results} does not name its target")
    loaded = load_model(target, LoadSettings(dtype=dtype, device="cpu"), progress=False)
    head = head_for(loaded, eagle_head)
    vocab_size = loaded.model.get_input_embeddings().weight.shape[0]
    logger.info("target states over %d answers (%s, %s)", len(runs), target, loaded.format)
    splits = target_splits(loaded.model, runs, head.hidden_layers, vocab_size)
    embed = loaded.model.get_input_embeddings().weight.to(head.dtype)
    inside = torch.zeros(vocab_size, dtype=torch.bool)
    inside[head.draft_ids] = True
    with torch.inference_mode():
        hits = [first_draft_hits(head, embed, split) for split in splits]

    def figures(members: list[int]) -> dict[str, Any]:
        scored = evaluate(head, embed, Split.join([splits[s] for s in members]), STEPS, batch_tokens=2048)
        answers = torch.cat([torch.tensor(runs[s].new_token_ids) for s in members])
        head_hits = torch.cat([hits[s][0] for s in members])
        lookup_hits = torch.cat([hits[s][1] for s in members])
        share = (lambda right: round(float(right.float().mean()), 4) if right.numel() else 0.0)
        return {"answers": len(members), **scored, "inside_draft_vocab": round(float(inside[answers].float().mean()), 4),
                "first_draft": {"head": share(head_hits), "prompt_lookup": share(lookup_hits),
                                "either": share(head_hits | lookup_hits)}}

    categories: dict[str, list[int]] = {}
    for index, run in enumerate(runs):
        categories.setdefault(run.category, []).append(index)
    by_category = {name: figures(members) for name, members in categories.items()}
    return {"results": str(results), "target": target, "dtype": loaded.format, "eagle_head": eagle_head or "shipped",
            "head_format": head.number_format, "by_category": by_category,
            "all": figures(list(range(len(runs))))}


def table(report: dict[str, Any]) -> str:
    lines = [f"{'category':22s} {'answers':>7s} {'positions':>9s} {'in vocab':>8s}  top-1 by draft step   "
             f"accepted (chain of {STEPS})  first draft: lookup  either"]
    for name, row in [*report["by_category"].items(), ("all", report["all"])]:
        steps = " ".join(f"{value:.2f}" for value in row["top1_per_step"])
        first = row["first_draft"]
        lines.append(f"{name:22s} {row['answers']:7d} {row['positions']:9d} {row['inside_draft_vocab']:8.2f}  "
                     f"{steps:20s}  {row['mean_accepted_drafts'][-1]:20.2f}  {first['prompt_lookup']:18.2f}  "
                     f"{first['either']:6.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specdemo.training.head_accuracy",
                                     description=__doc__.split("\n")[0].rstrip(":"))
    parser.add_argument("results", type=Path, help="a bench results file with a plain run (--json)")
    parser.add_argument("--eagle-head", default=None, help="a head folder or Hub id (default: the shipped head)")
    parser.add_argument("--dtype", default=None, help="the target's format (default: the one the run used)")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here too")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        report = head_accuracy(args.results, args.eagle_head, args.dtype)
    except (InputError, ModelLoadError, OfflinePackError, ValueError) as error:
        print(f"error: {first_line(error)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: nothing written", file=sys.stderr)
        return 130
    print(f"{report['target']} ({report['dtype']}), EAGLE head {report['eagle_head']} in {report['head_format']}")
    print(table(report))
    if args.json is not None:
        write_json_atomic(args.json, report, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
