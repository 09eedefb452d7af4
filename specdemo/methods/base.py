"""Drafting strategies: each proposes up to k tokens (a chain, or a tree) and hears the verdict of the target.

The interface follows transformers' ``CandidateGenerator`` in spirit: :meth:`Drafter.propose` (get candidates)
and :meth:`Drafter.feedback` (update the strategy from the round's :class:`RoundResult`: the proposal, the verdict
and the target's pass). :meth:`Drafter.start` begins a new sequence and sees the prompt's pass.
"""

from __future__ import annotations

import bisect
import logging
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import torch
from transformers import PreTrainedModel

from ..backends.transformers_lm import CachedLM, TargetPass, now
from ..backends.memory import return_free_memory
from ..core.acceptance import SamplingSettings, Verdict, target_distribution

logger = logging.getLogger(__name__)


@dataclass
class Proposal:
    """Draft tokens and, for drafters that sample, the distribution each was drawn from ([n, V_target]).

    ``parents``: None for a chain (token i follows token i - 1); for a tree, each token's parent index among the
    tokens (-1 = it follows the context), parents before children, siblings with different tokens.
    """

    tokens: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None
    #: seconds the drafter spent catching up on text written since its last round (after plain steps), which is
    #: part of drafting's cost but not of its cost per drafted token
    catch_up_seconds: float = 0.0
    parents: list[int] | None = None


@dataclass
class RoundResult:
    """What a drafter hears after a round: its proposal (as verified), the verdict and the target's pass."""

    proposal: Proposal
    verdict: Verdict
    target_pass: TargetPass | None = None

    @property
    def num_drafted(self) -> int:
        return len(self.proposal.tokens)

    @property
    def num_accepted(self) -> int:
        return self.verdict.num_accepted


class Drafter(Protocol):
    """A drafting strategy. ``context`` is the whole sequence so far (prompt + accepted output)."""

    name: str

    def start(self, prompt_ids: Sequence[int], prefill: TargetPass | None = None) -> None: ...

    def propose(self, context: Sequence[int], max_tokens: int) -> Proposal: ...

    def feedback(self, result: RoundResult) -> None: ...


# ----------------------------------------------------------------------------------------------------------------
# n-gram (prompt lookup)


NGRAM_PREFERENCES = ("follow", "recent", "first")


class NgramIndex:
    """Maps every n-gram (min_n..max_n) of a growing token sequence to the ends of all its occurrences.

    Only occurrences followed by at least one token are indexed, so a lookup of the sequence's own suffix finds an
    earlier occurrence with a continuation. Which occurrence of the longest matching suffix is copied:

    - ``"recent"``: the most recent one (the one before it when the latest leaves too short a continuation, as in a
      repeated pattern);
    - ``"first"``: the first one (transformers' prompt lookup does this);
    - ``"follow"``: the first one at or after ``follow_from`` (the source position where the last accepted copy
      ended, so an output that copies the prompt in order with edits keeps copying from the right place), and the
      most recent one when there is none or no copy was accepted yet.

    Updating is incremental: each new position is indexed once.
    """

    def __init__(self, min_n: int = 1, max_n: int = 4, prefer: str = "follow") -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        if prefer not in NGRAM_PREFERENCES:
            raise ValueError(f"n-gram preference must be one of {', '.join(NGRAM_PREFERENCES)}, got {prefer!r}")
        self.min_n = min_n
        self.max_n = max_n
        self.prefer = prefer
        self.tokens: list[int] = []
        self._ends: dict[tuple[int, ...], list[int]] = {}  # n-gram -> ends of its occurrences, ascending
        self._indexed_ends = 0  # ends 0.._indexed_ends-1 are in the table

    def reset(self) -> None:
        self.tokens = []
        self._ends = {}
        self._indexed_ends = 0

    def extend(self, context: Sequence[int]) -> bool:
        """Bring the index up to date with ``context``; returns True when it had to start over (a new sequence)."""
        known = len(self.tokens)
        restarted = False
        if len(context) < known or list(context[max(0, known - 8) : known]) != self.tokens[max(0, known - 8) :]:
            self.reset()
            known = 0
            restarted = True
        self.tokens.extend(int(t) for t in context[known:])
        tokens = self.tokens
        for end in range(self._indexed_ends, len(tokens) - 1):
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                self._ends.setdefault(tuple(tokens[end - n + 1 : end + 1]), []).append(end)
        self._indexed_ends = max(self._indexed_ends, len(tokens) - 1)
        return restarted

    def find(self, max_tokens: int, follow_from: int | None = None) -> tuple[list[int], int | None]:
        """The continuation to copy and the end of the occurrence it follows (None when nothing matches)."""
        tokens = self.tokens
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            ends = self._ends.get(tuple(tokens[len(tokens) - n :]))
            if not ends:
                continue
            after = len(ends)
            if self.prefer == "follow" and follow_from is not None:
                after = bisect.bisect_left(ends, follow_from)
            if self.prefer == "first":
                source = ends[0]
            elif after < len(ends):
                source = ends[after]
            else:
                source = self._recent(ends, max_tokens)
            return tokens[source + 1 : source + 1 + max_tokens], source
        return [], None

    def lookup(self, max_tokens: int) -> list[int]:
        """Continuation of the longest suffix n-gram that occurred before (see the class for which occurrence)."""
        return self.find(max_tokens)[0]

    def _recent(self, ends: list[int], max_tokens: int) -> int:
        latest = ends[-1]
        if len(ends) > 1 and len(self.tokens) - 1 - latest < max_tokens:
            # the latest occurrence runs into the suffix: the one before it has a longer continuation
            return ends[-2]
        return latest


class NgramDrafter:
    """Prompt lookup decoding: propose what followed an earlier occurrence of the context's longest suffix n-gram."""

    name = "ngram"

    def __init__(self, min_n: int = 1, max_n: int = 4, prefer: str = "follow") -> None:
        self.index = NgramIndex(min_n, max_n, prefer)
        self._source: int | None = None  # end of the occurrence the last proposal copied from
        self._follow_from: int | None = None  # source position of the last accepted copied token

    def start(self, prompt_ids: Sequence[int], prefill: TargetPass | None = None) -> None:
        self.index.reset()
        self._source = self._follow_from = None

    def propose(self, context: Sequence[int], max_tokens: int) -> Proposal:
        self._source = None
        if max_tokens <= 0:
            return Proposal()
        if self.index.extend(context):
            self._follow_from = None
        tokens, self._source = self.index.find(max_tokens, self._follow_from)
        return Proposal(tokens, None)

    def feedback(self, result: RoundResult) -> None:
        if self._source is not None and result.num_accepted > 0:
            self._follow_from = self._source + result.num_accepted


# ----------------------------------------------------------------------------------------------------------------
# draft model


#: int8 copies of draft models, keyed weakly by the float model: a copy lives exactly as long as its model
_INT8_COPIES: "weakref.WeakKeyDictionary[PreTrainedModel, PreTrainedModel]" = weakref.WeakKeyDictionary()


def int8_copy(model: PreTrainedModel) -> PreTrainedModel | None:
    """A float32 CPU copy of ``model`` whose decoder linear layers are int8 (dynamic quantisation), or None.

    On a CPU a one-token step is bound by reading the weights, and PyTorch's bfloat16 matrix-vector product is
    slow there; int8 weights make a draft step several times cheaper. Only drafts are quantised: the target, which
    decides every token, is never touched. The LM head stays in float32 (the drafter restricts it). The copy is
    made once per model and process.
    """
    cached = _INT8_COPIES.get(model)
    if cached is not None:
        return cached
    try:
        import copy

        from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic
    except ImportError:  # pragma: no cover - a torch without eager-mode quantisation
        logger.warning("int8 draft unavailable in this torch build; drafting in the model's own dtype")
        return None
    clone = copy.deepcopy(model).float().cpu().eval()
    clone_head = clone.get_output_embeddings()
    spec = {
        name: per_channel_dynamic_qconfig
        for name, module in clone.named_modules()
        if isinstance(module, torch.nn.Linear) and module is not clone_head
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantized = quantize_dynamic(clone, spec, dtype=torch.qint8, inplace=True)  # no second float copy
    _INT8_COPIES[model] = quantized
    return_free_memory()  # the float32 weights the int8 layers replaced
    return quantized


def int8_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.nn.Module:
    """An int8 dynamically quantised linear layer with these float weights."""
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    with torch.no_grad():
        linear.weight.copy_(weight.float())
        if bias is not None:
            linear.bias.copy_(bias.float())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return quantize_dynamic(torch.nn.Sequential(linear), {"0": per_channel_dynamic_qconfig}, dtype=torch.qint8)


#: linear layers scoring leading rows of a model's LM head, weakly keyed by the model (freed with it):
#: {(rows, int8): layer}, rows None = the whole head
_HEAD_ROWS: "weakref.WeakKeyDictionary[PreTrainedModel, dict[tuple[int | None, bool], torch.nn.Module]]" = (
    weakref.WeakKeyDictionary()
)


def head_rows(model: PreTrainedModel, rows: int | None = None, int8: bool = True) -> torch.nn.Module | None:
    """A linear layer scoring the model's first ``rows`` token ids (None: its whole LM head), int8 or in the head's
    own dtype; made once per model, rows and int8 (quantising 32,768 rows of a draft head takes a third of a
    second, the same for every prompt). None if the head is no Linear."""
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        return None
    layers = _HEAD_ROWS.setdefault(model, {})
    if (rows, int8) not in layers:
        ids = None if rows is None else torch.arange(rows, device=head.weight.device)
        layers[(rows, int8)] = linear_rows(head, ids, int8)
    return layers[(rows, int8)]


def linear_rows(head: torch.nn.Linear, ids: torch.Tensor | None, int8: bool) -> torch.nn.Module:
    """A linear layer scoring only these token ids of ``head`` (None: all), int8 or in the head's dtype."""
    with torch.inference_mode():
        weight = head.weight.detach() if ids is None else head.weight.index_select(0, ids)
        bias = head.bias
        if bias is not None and ids is not None:
            bias = bias.index_select(0, ids)
    if int8:
        return int8_linear(weight, bias)
    layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        layer.bias = torch.nn.Parameter(bias, requires_grad=False)
    return layer


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


def _auto_head_tokens(vocab_size: int) -> int:
    """How many of the most frequent token ids the draft head scores by default (0 = the whole vocabulary)."""
    return 32768 if vocab_size > 65536 else 0


def catch_up(lm: CachedLM, feed: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Feed a draft the ids it is behind on (more than the last round's bonus and correction: text written during
    plain steps) in a pass of its own, without an LM head; returns the last id, still to feed, and the seconds the
    pass took. With two ids or fewer behind, nothing is run: ``(feed, 0.0)``."""
    if feed.numel() <= 2:
        return feed, 0.0
    started = now(lm.device)
    lm.hidden_states(feed[:-1])  # the cache is all a catch-up needs: no LM head
    return feed[-1:], now(lm.device) - started


class DraftModelDrafter:
    """A small causal LM with the target's tokenizer drafts k tokens one by one.

    It keeps its own KV cache across rounds and rolls back only the drafted tokens the target rejected. Greedy
    settings draft the argmax; sampling settings sample (with the drafter's own generator) and report the draft
    distribution, as rejection sampling needs.

    ``head_tokens``: score only this many token ids in the draft's LM head (the lowest ids, which in BPE
    vocabularies are the earliest merges, i.e. the most frequent tokens) plus every id of the prompt and the EOS
    ids. With a 151,936-token vocabulary the head is a quarter of a 0.5B draft's weights; restricting it makes
    every draft step cheaper. Verification by the target keeps the output exact either way. 0 = full head,
    None = automatic (32,768 for vocabularies over 65,536).

    ``confidence_stop``: stop drafting this round once the draft's probability of its own token falls below this
    value (0 = never); it only looks at the draft's side, so exactness holds.

    ``int8``: draft with an int8 copy of the model (see :func:`int8_copy`); None = automatic (on for a CPU draft).
    """

    name = "draft"

    def __init__(
        self,
        model: PreTrainedModel,
        sampling: SamplingSettings,
        target_vocab_size: int,
        eos_token_ids: Sequence[int] = (),
        head_tokens: int | None = None,
        confidence_stop: float = 0.0,
        generator: torch.Generator | None = None,
        int8: bool | None = None,
    ) -> None:
        device = next(model.parameters()).device
        if int8 is None:
            int8 = device.type == "cpu"
        quantized = int8_copy(model) if int8 else None
        self.int8 = quantized is not None
        if quantized is not None:
            model = quantized
        self.lm = CachedLM(model)
        self.sampling = sampling
        self.target_vocab_size = target_vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.confidence_stop = confidence_stop
        self.generator = generator
        head = model.get_output_embeddings()
        self._head = head if isinstance(head, torch.nn.Linear) else None
        draft_vocab = self._head.weight.shape[0] if self._head is not None else target_vocab_size
        self.head_tokens = _auto_head_tokens(draft_vocab) if head_tokens is None else head_tokens
        if self._head is None:
            self.head_tokens = 0
        # a restricted head: the frequent ids' rows (the same for every prompt) and the prompt's rarer ids' rows
        self._sub_ids: torch.Tensor | None = None
        self._frequent_head: torch.nn.Module | None = None
        self._rare_head: torch.nn.Module | None = None
        self._cached_ids: list[int] = []

    # -- sequence state ------------------------------------------------------------------------------------------
    def start(self, prompt_ids: Sequence[int], prefill: TargetPass | None = None) -> None:
        self.lm.reset()
        self._cached_ids = []
        self._sub_ids = None
        if not self.head_tokens or self._head is None:
            return
        draft_vocab = self._head.weight.shape[0]
        if self.head_tokens >= draft_vocab:
            return
        usable = min(draft_vocab, self.target_vocab_size)
        frequent = min(self.head_tokens, usable)
        # the same rows for every prompt: built once per model, not per request
        self._frequent_head = head_rows(self.lm.model, frequent, self.int8)
        ids = head_token_ids(self.head_tokens, usable, prompt_ids, self.eos_token_ids)
        rare = torch.tensor(ids[frequent:], dtype=torch.long, device=self.lm.device)  # ids beyond the frequent ones
        self._rare_head = linear_rows(self._head, rare, self.int8) if rare.numel() else None
        self._sub_ids = torch.tensor(ids, dtype=torch.long, device=self.lm.device)

    def _sync(self, context: Sequence[int]) -> torch.Tensor:
        """Roll the draft cache back to the longest prefix it shares with ``context``; return the ids to feed."""
        cached = self._cached_ids
        keep = min(len(cached), len(context) - 1)
        # the context only grows between rounds, so only the tail (last round's drafts) can differ
        start = max(0, keep - 64)
        if start > 0 and int(context[start - 1]) != cached[start - 1]:
            keep = 0
        else:
            for i in range(start, keep):
                if cached[i] != context[i]:
                    keep = i
                    break
        self.lm.rollback(self.lm.length - keep)
        del cached[keep:]
        fresh = [int(t) for t in context[keep:]]
        cached.extend(fresh)
        return torch.tensor(fresh, dtype=torch.long, device=self.lm.device)

    # -- drafting ------------------------------------------------------------------------------------------------
    def _logits(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits at the last position (over the sub-vocabulary when the head is restricted) and its id map."""
        if self._sub_ids is None:
            logits = self.lm.forward(input_ids, all_logits=False)[-1]
            if logits.shape[0] > self.target_vocab_size:  # padded draft embeddings: never propose those ids
                logits = logits[: self.target_vocab_size]
            return logits, None
        hidden = self.lm.hidden_states(input_ids)[-1]
        assert self._frequent_head is not None
        with torch.inference_mode():
            logits = self._frequent_head(hidden.unsqueeze(0))[0]
            if self._rare_head is not None:
                logits = torch.cat([logits, self._rare_head(hidden.unsqueeze(0))[0]])
        return logits, self._sub_ids

    @torch.inference_mode()
    def propose(self, context: Sequence[int], max_tokens: int) -> Proposal:
        if max_tokens <= 0:
            return Proposal()
        feed, catch_up_seconds = catch_up(self.lm, self._sync(context))
        tokens: list[int] = []
        prob_rows: list[torch.Tensor] = []
        for step in range(max_tokens):
            logits, id_map = self._logits(feed)
            if self.sampling.greedy:
                choice = int(logits.argmax().item())
                if self.confidence_stop > 0.0 and step > 0:
                    confidence = float(logits.float().softmax(-1)[choice])
                    if confidence < self.confidence_stop:
                        break
            else:
                probs = target_distribution(logits, self.sampling)
                choice = int(torch.multinomial(probs, 1, generator=self.generator).item())
                if self.confidence_stop > 0.0 and step > 0 and float(probs[choice]) < self.confidence_stop:
                    break
                prob_rows.append(to_target_vocab(probs, id_map, self.target_vocab_size))
            token = choice if id_map is None else int(id_map[choice])
            tokens.append(token)
            if step + 1 < max_tokens:
                feed = torch.tensor([token], dtype=torch.long, device=self.lm.device)
                self._cached_ids.append(token)
        draft_probs = torch.stack(prob_rows) if prob_rows else None
        return Proposal(tokens, draft_probs, catch_up_seconds)

    def feedback(self, result: RoundResult) -> None:
        pass
