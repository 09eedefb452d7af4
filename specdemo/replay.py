"""Replay n-gram drafting rules offline against the greedy outputs a benchmark recorded.

Greedy speculative decoding writes exactly the plain output, so how many target passes a greedy drafter needs on
a prompt depends only on the prompt, that output and the drafter, not on timing. Replaying each rule over the
plain outputs of a ``python -m specdemo.bench`` JSON gives tokens per target pass with no timing noise, in well
under a second per rule: a fair way to compare lookup rules on a machine whose single runs swing by 10 to 30 %.

    python -m specdemo.replay bench-out/bf16-all.json --draft-tokens 10

The rules are our n-gram drafter with each ``prefer`` setting (n from 4 down to 1) and transformers' prompt lookup
rule (first occurrence, n from 2 down to 1) run in the same loop. The draft length is fixed, so the figures compare
which tokens each rule proposes, not the adaptive policy.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from .drafters import NGRAM_PREFERENCES, Drafter, NgramDrafter, Proposal, RoundResult
from .models import ModelLoadError
from .offline import OfflinePackError
from .sampling import Verdict

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplayItem:
    """One prompt of a benchmark run: its id, category, prompt ids and the plain (greedy) output."""

    id: str
    category: str
    prompt_ids: list[int]
    output_ids: list[int]


def replay_passes(drafter: Drafter, prompt_ids: Sequence[int], output_ids: Sequence[int], draft_tokens: int) -> int:
    """Target passes greedy speculation with ``drafter`` (at most ``draft_tokens`` per round) needs for the output.

    As in the engine: the prompt pass writes the first token, then each round drafts, accepts the longest prefix
    that matches the output and adds the target's own token; no round drafts past ``len(output_ids)``.
    """
    if draft_tokens < 0:
        raise ValueError(f"draft_tokens must be >= 0, got {draft_tokens}")
    if not output_ids:
        return 0
    drafter.start(list(prompt_ids))
    context = list(prompt_ids) + [output_ids[0]]
    position = passes = 1
    while position < len(output_ids):
        wanted = min(draft_tokens, len(output_ids) - position - 1)
        draft = drafter.propose(context, wanted).tokens[:wanted] if wanted > 0 else []
        accepted = 0
        while accepted < len(draft) and draft[accepted] == output_ids[position + accepted]:
            accepted += 1
        drafter.feedback(RoundResult(Proposal(list(draft)), Verdict(accepted, int(output_ids[position + accepted]))))
        produced = output_ids[position : position + accepted + 1]
        context.extend(produced)
        position += len(produced)
        passes += 1
    return passes


def ngram_rules(min_n: int = 1, max_n: int = 4) -> dict[str, Callable[[], Drafter]]:
    """The rules compared: our drafter with each preference, and transformers' prompt lookup rule."""
    rules: dict[str, Callable[[], Drafter]] = {
        prefer: (lambda prefer=prefer: NgramDrafter(min_n, max_n, prefer)) for prefer in NGRAM_PREFERENCES
    }
    rules["transformers"] = lambda: NgramDrafter(1, 2, "first")
    return rules


def tokens_per_pass(
    items: Sequence[ReplayItem], rules: dict[str, Callable[[], Drafter]], draft_tokens: int
) -> dict[str, dict[str, float]]:
    """``{category or "ALL": {rule: new tokens / target passes}}`` over the items."""
    totals: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    for item in items:
        for name, make in rules.items():
            passes = replay_passes(make(), item.prompt_ids, item.output_ids, draft_tokens)
            for group in (item.category, "ALL"):
                totals[group][name][0] += len(item.output_ids)
                totals[group][name][1] += passes
    ordered = [g for g in totals if g != "ALL"] + ["ALL"]
    return {g: {name: tokens / passes for name, (tokens, passes) in totals[g].items() if passes} for g in ordered if g in totals}


def load_items(path: Path) -> list[ReplayItem]:
    """The plain results of a bench JSON, with their prompt ids (re-encoded with the run's target if absent)."""
    try:
        report = json.loads(Path(path).read_text())
        plain = [r for r in report["results"] if r["mode"] == "plain"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{path}: not a readable bench JSON ({error})") from None
    if not plain:
        raise ValueError(f"{path}: has no plain results to replay (run the bench with the plain mode)")
    if any("prompt_ids" not in r for r in plain):
        prompt_ids = _encode_again(report["config"], [r["id"] for r in plain])
    else:
        prompt_ids = {r["id"]: r["prompt_ids"] for r in plain}
    items = []
    for r in plain:
        ids = prompt_ids[r["id"]]
        if len(ids) != r["prompt_tokens"]:
            raise ValueError(f"{path}: prompt {r['id']} encodes to {len(ids)} tokens, the run had {r['prompt_tokens']}")
        items.append(ReplayItem(r["id"], r["category"], list(ids), list(r["new_token_ids"])))
    return items


def _encode_again(config: dict, ids: list[str]) -> dict[str, list[int]]:
    """Prompt ids for JSONs written before the bench recorded them: load the run's target and prompts again."""
    from .models import LoadSettings, load_model
    from .pipeline import encode_prompt
    from .prompts import load_prompts

    logger.info("this JSON has no prompt ids: encoding the prompts again with %s", config["target"])
    prompts = {p.id: p for p in load_prompts(None if config["prompts"] == "bundled" else config["prompts"])}
    missing = [i for i in ids if i not in prompts]
    if missing:
        raise ValueError(f"prompts {', '.join(missing)} are not in {config['prompts']}")
    target = load_model(config["target"], LoadSettings(device="cpu"), progress=False)
    return {i: encode_prompt(target, prompts[i].text, chat=config.get("chat", True)) for i in ids}


def format_replay(table: dict[str, dict[str, float]], draft_tokens: int) -> str:
    rules = list(next(iter(table.values())))
    lines = [f"tokens per target pass, greedy, k = {draft_tokens} (replayed; higher is better)"]
    lines.append(f"{'category':<16}" + "".join(f"{r:>14}" for r in rules))
    for group, row in table.items():
        lines.append(f"{group:<16}" + "".join(f"{row.get(r, 0.0):>14.3f}" for r in rules))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specdemo.replay", description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, help="a JSON written by python -m specdemo.bench (with the plain mode)")
    parser.add_argument("--draft-tokens", type=int, default=10, help="draft length k, fixed (default 10)")
    parser.add_argument("--ngram-min", type=int, default=1)
    parser.add_argument("--ngram-max", type=int, default=4)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        if args.draft_tokens < 1:
            raise ValueError(f"--draft-tokens must be >= 1, got {args.draft_tokens}")
        rules = ngram_rules(args.ngram_min, args.ngram_max)
        items = load_items(args.results)
        table = tokens_per_pass(items, rules, args.draft_tokens)
    except (ValueError, OSError, ModelLoadError, OfflinePackError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(format_replay(table, args.draft_tokens))
    return 0


if __name__ == "__main__":
    sys.exit(main())
