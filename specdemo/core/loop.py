"""Plain and speculative decoding as generators of per-round events.

Both decoders take a prompt (token ids) and yield one :class:`RoundEvent` per target forward pass. The engine
never prints, never seeds the global RNG and knows nothing of any UI. Each decoder times only its own device work
(drafting, verification), so two decoders can be interleaved by one consumer (see :mod:`specdemo.session.race`) without
either being charged for the other.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Iterator, Sequence

import torch
from transformers import PreTrainedTokenizerBase

from .detok import IncrementalDetokenizer
from ..methods.draft_length import DraftLengthPolicy
from ..methods.base import Drafter, Proposal, RoundResult
from ..backends.transformers_lm import CausalLM, TargetPass, is_chain, now, tree_depths
from .acceptance import (
    SamplingSettings,
    Verdict,
    accept_greedy,
    accept_greedy_tree,
    accept_sampling,
    choose_token,
    target_distribution,
)

logger = logging.getLogger(__name__)

#: how a token came to be
ACCEPTED, CORRECTED, BONUS, PLAIN, REJECTED = "accepted", "corrected", "bonus", "plain", "rejected"


@dataclass(frozen=True)
class GenerationSettings:
    max_new_tokens: int = 128
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    stop_on_eos: bool = True
    #: compute each shown token's draft/target probability for display (outside the timed work)
    collect_probs: bool = True

    def validate(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a whole number >= 1, got {self.max_new_tokens!r}")
        if self.max_new_tokens > 32768:
            raise ValueError(f"max_new_tokens must be at most 32768, got {self.max_new_tokens}")
        self.sampling.validate()


@dataclass
class TokenEvent:
    """One token as shown: its id, its text piece, how it was made, and the probabilities behind it."""

    id: int
    text: str
    kind: str
    round: int
    draft_prob: float | None = None
    target_prob: float | None = None


@dataclass
class Counters:
    """Running totals of one decoding run."""

    new_tokens: int = 0
    target_passes: int = 0
    rounds: int = 0  # verification rounds (passes after the prefill)
    drafted: int = 0
    accepted: int = 0
    rejection_rounds: int = 0  # rounds in which a draft token was rejected
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    accepted_lengths: list[int] = field(default_factory=list)  # tokens per verification round (bonus included)
    draft_lengths: list[int] = field(default_factory=list)  # tokens drafted in each verification round
    drafted_at: list[int] = field(default_factory=list)  # per draft position: how often a token was drafted there
    accepted_at: list[int] = field(default_factory=list)  # ... and accepted there
    tested_at: list[int] = field(default_factory=list)  # ... and checked there (every earlier one accepted)

    def snapshot(self) -> "Counters":
        """A copy that later rounds do not change."""
        return replace(
            self,
            accepted_lengths=list(self.accepted_lengths),
            draft_lengths=list(self.draft_lengths),
            drafted_at=list(self.drafted_at),
            accepted_at=list(self.accepted_at),
            tested_at=list(self.tested_at),
        )

    @property
    def seconds(self) -> float:
        return self.prefill_seconds + self.draft_seconds + self.verify_seconds

    def record_round(self, drafted: int, accepted: int, produced: int, depth: int | None = None) -> None:
        """One verify round: ``drafted`` tokens (tree nodes), ``accepted`` of them (the accepted path's length),
        ``produced`` tokens written; per-position counts go by depth (a chain's depth is its length)."""
        depth = drafted if depth is None else depth
        self.rounds += 1
        self.target_passes += 1
        self.drafted += drafted
        self.accepted += accepted
        if accepted < drafted:
            self.rejection_rounds += 1
        self.accepted_lengths.append(produced)
        self.draft_lengths.append(drafted)
        while len(self.drafted_at) < depth:
            self.drafted_at.append(0)
            self.accepted_at.append(0)
            self.tested_at.append(0)
        for position in range(depth):
            self.drafted_at[position] += 1
            if position <= accepted:
                self.tested_at[position] += 1
            if position < accepted:
                self.accepted_at[position] += 1

    @classmethod
    def total(cls, runs: Sequence["Counters"]) -> "Counters":
        """The counters of several runs added up, as if they were one run."""
        total = cls()
        for run in runs:
            for name in (
                "new_tokens", "target_passes", "rounds", "drafted", "accepted", "rejection_rounds",
                "prefill_seconds", "draft_seconds", "verify_seconds",
            ):
                setattr(total, name, getattr(total, name) + getattr(run, name))
            total.accepted_lengths.extend(run.accepted_lengths)
            total.draft_lengths.extend(run.draft_lengths)
            for name in ("drafted_at", "accepted_at", "tested_at"):
                mine, theirs = getattr(total, name), getattr(run, name)
                mine.extend([0] * (len(theirs) - len(mine)))
                for position, count in enumerate(theirs):
                    mine[position] += count
        return total


@dataclass
class RoundEvent:
    """What one target forward pass produced."""

    side: str  # "plain" or "spec"
    round: int  # 0 = the prefill pass
    tokens: list[TokenEvent]
    rejected: list[TokenEvent]
    drafted: int
    accepted: int
    draft_seconds: float
    verify_seconds: float
    counters: Counters
    finished: bool = False
    finish_reason: str | None = None  # "eos" or "length"
    new_token_ids: list[int] = field(default_factory=list)  # the whole output so far (set on the final event)
    text: str = ""  # the whole output text so far (set on the final event)


class _Output:
    """Collects accepted ids, finds EOS and the length limit, and turns ids into text pieces."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase | None, settings: GenerationSettings, eos_token_ids: Sequence[int]
    ) -> None:
        self.ids: list[int] = []
        self.limit = settings.max_new_tokens
        self.eos = set(eos_token_ids) if settings.stop_on_eos else set()
        self.detok = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self.finish_reason: str | None = None

    def admit(self, ids: Sequence[int]) -> list[int]:
        """The prefix of ``ids`` that is kept (up to and including EOS, within the length limit)."""
        kept: list[int] = []
        for token in ids:
            if len(self.ids) + len(kept) >= self.limit:
                break
            kept.append(int(token))
            if token in self.eos:
                self.finish_reason = "eos"
                break
        self.ids.extend(kept)
        if self.finish_reason is None and len(self.ids) >= self.limit:
            self.finish_reason = "length"
        return kept

    def pieces(self, ids: Sequence[int]) -> list[str]:
        if self.detok is None:
            return ["" for _ in ids]
        pieces = [self.detok.add(t) for t in ids]
        if self.finish_reason is not None and pieces:
            pieces[-1] += self.detok.flush()
        return pieces

    @property
    def text(self) -> str:
        return self.detok.text if self.detok is not None else ""


def _prob(probs: torch.Tensor | None, row: int, token: int) -> float | None:
    return None if probs is None else float(probs[row, token])


def seeded_generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    """A torch.Generator seeded with ``seed`` on ``device`` (None when no seed is given)."""
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def _check_prompt(prompt_ids: Sequence[int]) -> torch.Tensor:
    if len(prompt_ids) == 0:
        raise ValueError("the prompt is empty: give at least one token")
    return torch.tensor(list(prompt_ids), dtype=torch.long)


def _prefill(
    target: CausalLM,
    prompt: torch.Tensor,
    settings: GenerationSettings,
    generator: torch.Generator | None,
    with_hidden: bool = True,
) -> tuple[int, TargetPass, float]:
    """The prompt's pass: the first new token, the pass (its last position) and the seconds it took."""
    device = getattr(target, "device", torch.device("cpu"))
    start = now(device)
    target.reset()
    prefill = target.run(prompt, all_logits=False, with_hidden=with_hidden)
    token = choose_token(prefill.logits[-1], settings.sampling, generator)
    return token, prefill, now(device) - start


def _finish(event: RoundEvent, output: _Output) -> RoundEvent:
    if output.finish_reason is not None:
        event.finished = True
        event.finish_reason = output.finish_reason
        event.new_token_ids = list(output.ids)
        event.text = output.text
    return event


def plain_decode(
    target: CausalLM,
    prompt_ids: Sequence[int],
    settings: GenerationSettings,
    eos_token_ids: Sequence[int] = (),
    tokenizer: PreTrainedTokenizerBase | None = None,
    side: str = "plain",
) -> Iterator[RoundEvent]:
    """The baseline: one target pass per token, exactly what ``model.generate`` does."""
    settings.validate()
    prompt = _check_prompt(prompt_ids)
    device = getattr(target, "device", torch.device("cpu"))
    generator = seeded_generator(settings.sampling.seed, device)
    output = _Output(tokenizer, settings, eos_token_ids)
    counters = Counters()

    token, prefill, seconds = _prefill(target, prompt, settings, generator, with_hidden=False)
    logits = prefill.logits[-1]
    counters.prefill_seconds += seconds
    counters.target_passes += 1
    round_index = 0
    while True:
        kept = output.admit([token])
        counters.new_tokens = len(output.ids)
        target_prob = None
        if settings.collect_probs:
            target_prob = float(target_distribution(logits, settings.sampling)[token])
        pieces = output.pieces(kept)
        shown = [TokenEvent(token, pieces[0], PLAIN, round_index, None, target_prob)]
        event = RoundEvent(side, round_index, shown, [], 0, 0, 0.0, seconds, counters.snapshot())
        yield _finish(event, output)
        if output.finish_reason is not None:
            return
        round_index += 1
        start = now(device)
        logits = target.run(torch.tensor([token]), all_logits=False, with_hidden=False).logits[-1]
        token = choose_token(logits, settings.sampling, generator)
        seconds = now(device) - start
        counters.verify_seconds += seconds
        counters.record_round(0, 0, 1)


def speculative_decode(
    target: CausalLM,
    drafter: Drafter,
    policy: DraftLengthPolicy,
    prompt_ids: Sequence[int],
    settings: GenerationSettings,
    eos_token_ids: Sequence[int] = (),
    tokenizer: PreTrainedTokenizerBase | None = None,
    side: str = "spec",
) -> Iterator[RoundEvent]:
    """Speculative decoding: draft, one verify pass over [last token + draft], vectorised acceptance.

    Greedy settings keep the longest draft prefix matching the target's argmax and add the target's own token;
    sampling settings use rejection sampling. A drafter may propose a tree (greedy only): it is verified in the same
    one pass with a tree attention mask and its deepest matching path is kept. The target cache keeps the accepted
    rows and drops the rest, never recomputing anything.
    """
    settings.validate()
    sampling = settings.sampling
    prompt = _check_prompt(prompt_ids)
    device = getattr(target, "device", torch.device("cpu"))
    generator = seeded_generator(sampling.seed, device)
    output = _Output(tokenizer, settings, eos_token_ids)
    counters = Counters()

    token, prefill, seconds = _prefill(target, prompt, settings, generator)
    logits = prefill.logits[-1]
    drafter.start(prompt_ids, prefill)
    counters.prefill_seconds += seconds
    counters.target_passes += 1
    context: list[int] = [int(t) for t in prompt_ids]

    kept = output.admit([token])
    context.extend(kept)
    counters.new_tokens = len(output.ids)
    target_prob = float(target_distribution(logits, sampling)[token]) if settings.collect_probs else None
    first = [TokenEvent(token, output.pieces(kept)[0], PLAIN, 0, None, target_prob)]
    yield _finish(RoundEvent(side, 0, first, [], 0, 0, 0.0, seconds, counters.snapshot()), output)
    if output.finish_reason is not None:
        return

    round_index = 0
    while True:
        round_index += 1
        remaining = settings.max_new_tokens - len(output.ids)
        wanted = min(policy.next_length(remaining), remaining - 1)

        start = now(device)
        proposal = drafter.propose(context, wanted) if wanted > 0 else Proposal()
        tokens = [int(t) for t in proposal.tokens[:wanted]]
        num_drafted = len(tokens)
        parents = None if is_chain(proposal.parents) else list(proposal.parents or ())[:num_drafted]
        draft_tokens = torch.tensor(tokens, dtype=torch.long, device=device)
        draft_probs = proposal.draft_probs[:num_drafted] if proposal.draft_probs is not None else None
        drafted_at = now(device)

        verify_input = torch.cat([torch.tensor([context[-1]], device=device), draft_tokens])
        verify_parents = None if parents is None else [-1] + [parent + 1 for parent in parents]
        target_pass = target.run(verify_input, all_logits=True, parents=verify_parents)
        target_logits = target_pass.logits
        target_probs = None
        if parents is not None:
            if not sampling.greedy:
                raise ValueError("a token tree is verified greedily only; a sampled run drafts a chain")
            verdict: Verdict = accept_greedy_tree(draft_tokens, parents, target_logits)
        elif sampling.greedy:
            verdict = accept_greedy(draft_tokens, target_logits)
        else:
            target_probs = target_distribution(target_logits, sampling)
            verdict = accept_sampling(draft_tokens, draft_probs, target_probs, generator)
        path = verdict.accepted_nodes
        target.keep(num_drafted + 1, [0] + [node + 1 for node in path])
        verified_at = now(device)

        draft_seconds, verify_seconds = drafted_at - start, verified_at - drafted_at
        counters.draft_seconds += draft_seconds
        counters.verify_seconds += verify_seconds
        verified = Proposal(tokens, draft_probs, proposal.catch_up_seconds, parents)
        drafter.feedback(RoundResult(verified, verdict, target_pass))
        catch_up = proposal.catch_up_seconds  # booked apart: it is no cost per drafted token
        policy.update(num_drafted, verdict.num_accepted, draft_seconds - catch_up, verify_seconds, catch_up)

        produced = [tokens[node] for node in path] + [verdict.next_token]
        kept = output.admit(produced)
        context.extend(kept)
        depths = tree_depths(parents) if parents is not None else None
        depth = max(depths) + 1 if depths else num_drafted
        counters.record_round(num_drafted, verdict.num_accepted, len(produced), depth)
        counters.new_tokens = len(output.ids)

        # --- what is shown (not timed) ---
        if settings.collect_probs and target_probs is None:
            target_probs = target_distribution(target_logits, sampling)
        rows = [0] + [node + 1 for node in path]  # the pass's row whose logits chose each produced token
        last_node = path[-1] if path else -1
        parent_of = parents if parents is not None else list(range(-1, num_drafted - 1))
        if num_drafted == 0:
            last_kind = PLAIN
        elif last_node not in parent_of:  # the accepted path ran to a leaf: the target's token comes on top
            last_kind = BONUS
        else:
            last_kind = CORRECTED
        pieces = output.pieces(kept)
        shown: list[TokenEvent] = []
        for position, (token_id, piece) in enumerate(zip(kept, pieces)):
            is_draft = position < verdict.num_accepted
            shown.append(
                TokenEvent(
                    token_id,
                    piece,
                    ACCEPTED if is_draft else last_kind,
                    round_index,
                    _prob(draft_probs, path[position], token_id) if is_draft else None,
                    _prob(target_probs, rows[position], token_id),
                )
            )
        rejected: list[TokenEvent] = []
        if tokenizer is not None and verdict.num_accepted < num_drafted and output.finish_reason != "eos":
            if parents is None:  # a chain: every draft token after the accepted ones
                turned_down = list(range(verdict.num_accepted, num_drafted))
            else:  # a tree: the candidates the target turned down where it wrote its own token
                turned_down = [node for node, parent in enumerate(parents) if parent == last_node]
            for order, node in enumerate(turned_down):
                token_id = tokens[node]
                first = order == 0 or parents is not None
                rejected.append(
                    TokenEvent(
                        token_id,
                        tokenizer.decode([token_id]),
                        REJECTED,
                        round_index,
                        _prob(draft_probs, node, token_id),
                        _prob(target_probs, rows[-1], token_id) if first else None,
                    )
                )
        event = RoundEvent(
            side,
            round_index,
            shown,
            rejected,
            num_drafted,
            verdict.num_accepted,
            draft_seconds,
            verify_seconds,
            counters.snapshot(),
        )
        yield _finish(event, output)
        if output.finish_reason is not None:
            return


def collect(events: Iterator[RoundEvent]) -> RoundEvent:
    """Run a decoder to the end and return its final event."""
    last = None
    for last in events:
        pass
    if last is None:
        raise RuntimeError("the decoder produced no event")
    return last
