"""Plain and speculative decoding as generators of per-round events.

Both decoders take a prompt (token ids) and yield one :class:`~specdemo.core.events.RoundEvent` per target forward
pass. The engine never prints, never seeds the global RNG and knows nothing of any UI. Each decoder times only its
own device work (drafting, verification), so two decoders can be interleaved by one consumer (see
:mod:`specdemo.session.race`) without either being charged for the other.

The speculative loop runs one short round at a time (:func:`_round`, in the spirit of gpt-fast's
``speculative_decode``): draft, one verify pass
over [last token + draft], acceptance, keep the accepted rows in the target's cache, write the accepted tokens and
the target's own. A chain is the tree whose parents are ``[-1, 0, 1, ...]``, so both go through the same pass and
cache update; only acceptance differs (greedy chains: :func:`accept_greedy`, sampled chains: rejection sampling,
trees: :func:`accept_greedy_tree`). What is shown (text pieces, token kinds, probabilities, rejected tokens) is made
from each round's raw data by :class:`~specdemo.core.display.EventMaker`, outside the timed work. The clock is
injectable (any callable returning seconds), so a simulator runs this same loop on a stub target and simulated time
(see :mod:`specdemo.replay`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
from transformers import PreTrainedTokenizerBase

from .acceptance import (
    Verdict,
    accept_greedy,
    accept_greedy_tree,
    accept_sampling,
    choose_token,
    target_distribution,
)
from .clock import Clock, device_clock
from .display import EventMaker, VerifyRound
from .events import Counters, RoundEvent
from .protocol import (
    Drafter,
    DraftLengthPolicy,
    LanguageModel,
    Proposal,
    RoundResult,
    TargetPass,
)
from .settings import GenerationSettings, SamplingSettings
from .tree import chain_parents, is_chain, tree_depths

logger = logging.getLogger(__name__)


class _Output:
    """The ids written so far; finds EOS and the length limit."""

    def __init__(self, settings: GenerationSettings, eos_token_ids: Sequence[int]) -> None:
        self.ids: list[int] = []
        self.limit = settings.max_new_tokens
        self.eos = set(eos_token_ids) if settings.stop_on_eos else set()
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
    target: LanguageModel,
    prompt: torch.Tensor,
    sampling: SamplingSettings,
    generator: torch.Generator | None,
    clock: Clock,
    with_hidden: bool,
    layers: dict[str, tuple[int, ...]] | None = None,
) -> tuple[int, TargetPass, float]:
    """The prompt's pass: the first new token, the pass (its last position) and the seconds it took. ``layers``:
    ``{"hidden_layers": ...}`` for a drafter that reads chosen layers' states (of every prompt position)."""
    start = clock()
    target.reset()
    prefill = target.run(prompt, all_logits=False, with_hidden=with_hidden, **(layers or {}))
    token = choose_token(prefill.logits[-1], sampling, generator)
    return token, prefill, clock() - start


def _draft(drafter: Drafter, context: Sequence[int], num_draft_tokens: int) -> Proposal:
    """The drafter's proposal cut to ``num_draft_tokens`` tokens, as verified: ``parents`` None for a chain."""
    proposal = drafter.propose(context, num_draft_tokens) if num_draft_tokens > 0 else Proposal()
    tokens = [int(t) for t in proposal.tokens[:num_draft_tokens]]
    parents = None if is_chain(proposal.parents) else list(proposal.parents or ())[: len(tokens)]
    probs = proposal.draft_probs[: len(tokens)] if proposal.draft_probs is not None else None
    sources = list(proposal.sources[: len(tokens)]) if proposal.sources is not None else None
    return Proposal(tokens, probs, proposal.catch_up_seconds, parents, sources)


def _accept(
    draft: torch.Tensor,
    proposal: Proposal,
    logits: torch.Tensor,
    sampling: SamplingSettings,
    generator: torch.Generator | None,
) -> tuple[Verdict, torch.Tensor | None]:
    """The verdict on a draft, and the target distribution when acceptance needed it (sampling)."""
    if proposal.parents is not None:
        if not sampling.greedy:
            raise ValueError("a token tree is verified greedily only; a sampled run drafts a chain")
        return accept_greedy_tree(draft, proposal.parents, logits), None
    if sampling.greedy:
        return accept_greedy(draft, logits), None
    target_probs = target_distribution(logits, sampling)
    return accept_sampling(draft, proposal.draft_probs, target_probs, generator), target_probs


def plain_decode(
    target: LanguageModel,
    prompt_ids: Sequence[int],
    settings: GenerationSettings,
    eos_token_ids: Sequence[int] = (),
    tokenizer: PreTrainedTokenizerBase | None = None,
    side: str = "plain",
    clock: Clock | None = None,
) -> Iterator[RoundEvent]:
    """The baseline: one target pass per token, exactly what ``model.generate`` does."""
    settings.validate()
    prompt = _check_prompt(prompt_ids)
    clock = clock or device_clock(target.device)
    generator = seeded_generator(settings.sampling.seed, target.device)
    output, events, counters = _Output(settings, eos_token_ids), EventMaker(tokenizer, settings, side), Counters()

    token, prefill, seconds = _prefill(target, prompt, settings.sampling, generator, clock, with_hidden=False)
    logits = prefill.logits[-1]
    output.admit([token])
    counters.observe_prefill(seconds, len(output.ids))
    yield events.plain_step(0, token, logits, seconds, counters, output.ids, output.finish_reason)
    round_index = 0
    while output.finish_reason is None:
        round_index += 1
        start = clock()
        logits = target.run(torch.tensor([token]), all_logits=False, with_hidden=False).logits[-1]
        token = choose_token(logits, settings.sampling, generator)
        seconds = clock() - start
        output.admit([token])
        counters.observe(0, 0, new_tokens=len(output.ids), verify_seconds=seconds)
        yield events.plain_step(round_index, token, logits, seconds, counters, output.ids, output.finish_reason)


@dataclass
class _Speculation:
    """What every round of one speculative run works with. ``layers``: ``{"hidden_layers": ...}`` for a drafter
    that names the target layers it reads, passed to every target pass (else empty, so every other drafter's
    passes stay exactly what they were)."""

    target: LanguageModel
    drafter: Drafter
    policy: DraftLengthPolicy
    sampling: SamplingSettings
    generator: torch.Generator | None
    clock: Clock
    layers: dict[str, tuple[int, ...]]

    @property
    def with_hidden(self) -> bool:
        return self.drafter.needs_hidden_states


@dataclass
class _Round:
    """What one round did: the proposal as verified, the target's pass and the verdict on it (with the target
    distribution where acceptance computed it), and the seconds of drafting and of verifying."""

    proposal: Proposal
    target_pass: TargetPass
    verdict: Verdict
    target_probs: torch.Tensor | None
    draft_seconds: float
    verify_seconds: float

    @property
    def tokens(self) -> list[int]:
        """The accepted draft tokens and the target's own next token."""
        return [self.proposal.tokens[node] for node in self.verdict.accepted_nodes] + [self.verdict.next_token]

    @property
    def depth(self) -> int:
        """The draft's depth: a chain's length, a tree's longest path."""
        if self.proposal.parents is None:
            return len(self.proposal.tokens)
        return max(tree_depths(self.proposal.parents), default=-1) + 1

    def sources(self, written: int) -> list[str]:
        """Who drafted each accepted token among the first ``written`` tokens (an EOS inside the path cuts it)."""
        if not self.proposal.sources:
            return []
        return [self.proposal.sources[node] for node in self.verdict.accepted_nodes[:written]]


def _round(run: _Speculation, context: Sequence[int], num_draft_tokens: int) -> _Round:
    """One round: draft, one verify pass over [last token + draft], acceptance, the accepted rows kept in the
    target's cache, and the drafter and the policy told the outcome."""
    start = run.clock()
    proposal = _draft(run.drafter, context, num_draft_tokens)
    drafted_at = run.clock()
    draft = torch.tensor(proposal.tokens, dtype=torch.long, device=run.target.device)
    parents = chain_parents(len(draft)) if proposal.parents is None else proposal.parents
    verify_input = torch.cat([torch.tensor([context[-1]], device=run.target.device), draft])
    tree_parents = [-1] + [parent + 1 for parent in parents]
    target_pass = run.target.run(verify_input, parents=tree_parents, with_hidden=run.with_hidden, **run.layers)
    verdict, target_probs = _accept(draft, proposal, target_pass.logits, run.sampling, run.generator)
    run.target.keep(len(draft) + 1, [0] + [node + 1 for node in verdict.accepted_nodes])
    done = _Round(proposal, target_pass, verdict, target_probs, drafted_at - start, run.clock() - drafted_at)
    run.drafter.feedback(RoundResult(proposal, verdict, target_pass))
    catch_up = proposal.catch_up_seconds  # booked apart: it is no cost per drafted token
    run.policy.update(len(draft), verdict.num_accepted, done.draft_seconds - catch_up, done.verify_seconds, catch_up)
    return done


def speculative_decode(
    target: LanguageModel,
    drafter: Drafter,
    policy: DraftLengthPolicy,
    prompt_ids: Sequence[int],
    settings: GenerationSettings,
    eos_token_ids: Sequence[int] = (),
    tokenizer: PreTrainedTokenizerBase | None = None,
    side: str = "spec",
    clock: Clock | None = None,
) -> Iterator[RoundEvent]:
    """Speculative decoding: draft, one verify pass over [last token + draft], vectorised acceptance.

    Greedy settings keep the longest draft prefix matching the target's argmax and add the target's own token;
    sampling settings use rejection sampling. A drafter may propose a tree (greedy only): it is verified in the same
    one pass with a tree attention mask and its deepest matching path is kept. The target cache keeps the accepted
    rows and drops the rest, never recomputing anything. The target computes hidden states only for a drafter that
    reads them, and the states of the layers a drafter names in its ``hidden_layers`` (EAGLE) only for it.
    ``clock``: seconds for timing (default: the target device's wall clock).
    """
    settings.validate()
    layers = {"hidden_layers": tuple(drafter.hidden_layers)} if drafter.hidden_layers is not None else {}
    generator = seeded_generator(settings.sampling.seed, target.device)
    clock = clock or device_clock(target.device)
    run = _Speculation(target, drafter, policy, settings.sampling, generator, clock,
                       layers if drafter.needs_hidden_states else {})
    prompt = _check_prompt(prompt_ids)
    output, events, counters = _Output(settings, eos_token_ids), EventMaker(tokenizer, settings, side), Counters()

    token, prefill, seconds = _prefill(target, prompt, run.sampling, run.generator, run.clock, run.with_hidden,
                                       run.layers)
    drafter.start(prompt_ids, prefill)
    context = [int(t) for t in prompt_ids] + output.admit([token])
    counters.observe_prefill(seconds, len(output.ids))
    yield events.plain_step(0, token, prefill.logits[-1], seconds, counters, output.ids, output.finish_reason)
    round_index = 0
    while output.finish_reason is None:
        round_index += 1
        remaining = settings.max_new_tokens - len(output.ids)
        done = _round(run, context, min(policy.next_num_draft_tokens(remaining), remaining - 1))
        written = output.admit(done.tokens)
        context.extend(written)
        counters.observe(len(done.proposal.tokens), done.verdict.num_accepted, new_tokens=len(output.ids),
                         depth=done.depth, sources=done.sources(len(written)), draft_seconds=done.draft_seconds,
                         verify_seconds=done.verify_seconds)
        verified = VerifyRound(round_index, done.proposal, done.target_pass.logits, done.target_probs, done.verdict,
                               written, done.draft_seconds, done.verify_seconds)
        yield events.verify_round(verified, counters, output.ids, output.finish_reason)


def collect(events: Iterator[RoundEvent]) -> RoundEvent:
    """Run a decoder to the end and return its final event."""
    last = None
    for last in events:
        pass
    if last is None:
        raise RuntimeError("the decoder produced no event")
    return last
