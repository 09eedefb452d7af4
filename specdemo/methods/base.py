"""What every drafting method shares: the method descriptor and small drafting helpers.

The drafter interface itself (:class:`~specdemo.core.protocol.Drafter`, :class:`~specdemo.core.protocol.Proposal`,
:class:`~specdemo.core.protocol.RoundResult`) lives in the core, beside the loop that drives it: a drafter proposes
up to ``num_draft_tokens`` tokens (a chain, or a tree) and hears the target's verdict, in the spirit of
transformers' ``CandidateGenerator``.

Each method file declares one :class:`Method` per mode it offers: what the mode needs (a draft model, the target's
hidden states), what it does (drafts for free, proposes trees, samples exactly), the options it reads and how to
build its drafter. :mod:`specdemo.methods` collects them in one registry; nothing else keeps a table of modes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from ..backends.passes import EAGER, Passes
from ..backends.static_lm import StaticLM
from ..backends.transformers_lm import CachedLM
from ..core.clock import now
from ..core.loop import seeded_generator
from ..core.protocol import Drafter, DraftLengthPolicy
from .draft_length import TreeBudget, make_policy

if TYPE_CHECKING:
    from ..backends.loading import LoadedModel
    from ..backends.suffix_trees import SuffixMemory
    from ..core.economics import CostCurve
    from ..core.settings import GenerationSettings

logger = logging.getLogger(__name__)


def head_token_ids(head_tokens: int, vocab_size: int, prompt_ids: Sequence[int], eos_ids: Sequence[int]) -> list[int]:
    """The token ids a restricted LM head scores: the lowest ``head_tokens`` ids (the earliest BPE merges, i.e. the
    most frequent tokens), every prompt id and the EOS ids, all below ``vocab_size``, ascending."""
    extra = {int(t) for t in prompt_ids} | {int(t) for t in eos_ids}
    return sorted(set(range(min(head_tokens, vocab_size))) | {t for t in extra if 0 <= t < vocab_size})


def to_target_vocab(probs: torch.Tensor, id_map: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """A probability row over a restricted head's ids (``id_map``; None = the head's own leading ids) spread onto
    the target's ``vocab_size`` ids, zero elsewhere."""
    full = torch.zeros(vocab_size, dtype=probs.dtype, device=probs.device)
    if id_map is None:
        width = min(probs.shape[0], vocab_size)
        full[:width] = probs[:width]
    else:
        inside = id_map < vocab_size
        full[id_map[inside]] = probs[inside]
    return full


def drafter_generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    """A drafter's own random stream, never the target's: seeded with ``seed + 1`` (None: unseeded)."""
    return seeded_generator(None if seed is None else seed + 1, device)


def catch_up(lm: "CachedLM | StaticLM", feed: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Feed a draft the ids it is behind on (more than the last round's bonus and correction: text written during
    plain steps) in a pass of its own, without an LM head; returns the last id, still to feed, and the seconds the
    pass took. With two ids or fewer behind, nothing is run: ``(feed, 0.0)``."""
    if feed.numel() <= 2:
        return feed, 0.0
    started = now(lm.device)
    lm.hidden_states(feed[:-1])  # the cache is all a catch-up needs: no LM head
    return feed[-1:], now(lm.device) - started


# ----------------------------------------------------------------------------------------------------------------
# the method descriptor


@dataclass(frozen=True)
class BuildContext:
    """What building a drafter may use: the loaded pair, the run's settings, the method's options, the run's
    draft-length policy, and the answers of earlier races (None: no memory) for a drafter that drafts from them."""

    target: "LoadedModel"
    draft: "LoadedModel | None"
    settings: "GenerationSettings"
    options: Any
    policy: "DraftLengthPolicy | None" = None
    memory: "SuffixMemory | None" = None
    #: what a drafter that times its own drafting reads the time from (None: the wall clock; a replay on simulated
    #: time gives one that stands still, as its drafting takes no simulated time)
    clock: "Callable[[], float] | None" = None
    #: how the run's passes run, a draft model's and a head's too (compiled when the target's are and their format
    #: can be)
    passes: Passes = EAGER


@dataclass(frozen=True)
class PolicyContext:
    """What choosing a draft-length policy may use (see :attr:`Method.make_policy`)."""

    target: "LoadedModel"
    settings: "GenerationSettings"
    options: Any
    num_draft_tokens_schedule: str
    num_draft_tokens: int | None
    max_num_draft_tokens: int
    prior: "CostCurve | None"


@dataclass(frozen=True)
class Method:
    """One speculative mode, as every front end and the session see it.

    ``options`` is the dataclass of the :class:`~specdemo.methods.SpecSettings` fields the method reads (made from
    them by name, validated by its ``validate``); ``build`` makes the drafter; ``check`` refuses a pair it cannot
    work with, in one line, before any decoding (for example heads that do not fit the target); ``make_policy``
    chooses the draft-length policy when the generic one (free or costed drafts) does not fit.
    """

    name: str
    label: str
    build: Callable[[BuildContext], Drafter]
    options: type | None = None
    needs_draft_model: bool = False
    #: the draft model may use another tokenizer than the target's (text is re-encoded between them)
    other_tokenizer: bool = False
    #: drafting costs next to nothing beside a target pass (no draft model runs)
    drafts_for_free: bool = False
    #: under greedy settings the drafter proposes a tree of candidates, verified in one pass
    proposes_trees: bool = False
    #: sampled output follows the target's distribution exactly (rejection sampling on a chain)
    samples_exactly: bool = True
    #: the drafter reads the target's hidden states from every pass
    needs_hidden_states: bool = False
    #: the drafter drafts from the answers of earlier races too (:attr:`BuildContext.memory`)
    drafts_from_memory: bool = False
    #: a calibration's draft-step cost (measured on the draft-model drafter) is this mode's drafting cost
    calibrated_draft_cost: bool = False
    check: "Callable[[LoadedModel, LoadedModel | None, Any], None] | None" = None
    #: whether the draft model runs as an int8 copy (None: the drafter decides), from the options and the pair
    draft_int8: "Callable[[Any, LoadedModel, LoadedModel | None], bool | None] | None" = None
    make_policy: "Callable[[PolicyContext], DraftLengthPolicy] | None" = None
    #: what a results file records about the method's own parts beside this target (for example the number format
    #: a head runs in), as JSON-ready values
    describe: "Callable[[LoadedModel, Any], dict[str, Any]] | None" = None
    #: the model or head the drafter runs through :attr:`BuildContext.passes` (compiled with the target's passes),
    #: from the target, the draft and the options, so a warm-up can make its graphs before the race; None: the
    #: drafter runs none that way
    drafting_model: "Callable[[LoadedModel, LoadedModel | None, Any], torch.nn.Module] | None" = None


def heads_policy(context: PolicyContext, tree: bool, chain_cap: int | None = None) -> DraftLengthPolicy:
    """The draft-length policy of heads on the target, whose drafts cost next to nothing: a node budget for a
    greedy adaptive tree (the drafter sizes each tree from the budget's verify costs), else the free-drafts policy
    with chains of at most ``chain_cap`` tokens (None: no cap beyond the settings')."""
    if tree and context.settings.sampling.greedy and context.num_draft_tokens_schedule == "adaptive":
        return TreeBudget(max_num_draft_tokens=context.max_num_draft_tokens, prior=context.prior)
    cap = context.max_num_draft_tokens if chain_cap is None else min(context.max_num_draft_tokens, chain_cap)
    return make_policy(context.num_draft_tokens_schedule, context.num_draft_tokens, cap, free_drafts=True,
                       prior=context.prior)


def tree_verify_cost(policy: DraftLengthPolicy | None, tree: bool) -> Callable[[int], float] | None:
    """The verify-cost model a tree drafter sizes its trees with (None for a chain or without a node budget)."""
    return policy.verify_cost if tree and isinstance(policy, TreeBudget) else None
