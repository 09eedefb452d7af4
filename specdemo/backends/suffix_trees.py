"""Suffix trees over token sequences, what suffix decoding drafts from (Oliaro et al. 2024, arXiv 2411.04975): one
over a race's prompt and its output so far (:class:`PromptTree`), one over the answers of earlier races
(:class:`SuffixMemory`).

The trees are Snowflake's arctic-inference ``SuffixTree`` (C++, the structure vLLM's ``suffix`` method calls): each
node counts how often its continuation followed the matched context, and a draft is the likeliest continuations of
the context's longest matches, a tree of at most ``match length x factor`` tokens whose every node's estimated
probability (its count over its parent's, multiplied along the path) is at least ``min_token_prob``. The package
is built from source against the installed torch (``SUFFIX_INSTALL``); without it the mode refuses to start in one
line.

What the C++ tree does not say, these classes add: which remembered answer a drafted token came from (for the
token hover), bounds on what the memory holds (answers and tokens, the oldest forgotten first) and a lock, since a
hosted app's visitors may forget their memory while a race reads another's.
"""

from __future__ import annotations

import logging
import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from ..core.errors import InputError, first_line

logger = logging.getLogger(__name__)

#: the command that builds and installs the suffix trees (a C++ extension) against the torch already installed
SUFFIX_INSTALL = "python3 -m pip install --no-build-isolation --no-deps -r requirements-suffix.txt"
#: the longest context a tree matches and the deepest draft it proposes (vLLM's default tree depth)
DEFAULT_MAX_DEPTH = 24
#: tokens (the drafted token and the matched context and path before it) that name where a drafted token came from
PROVENANCE_TOKENS = 4
#: a memory's default bounds: the earlier answers it keeps, and their tokens in all
DEFAULT_MAX_ANSWERS = 256
DEFAULT_MAX_TOKENS = 262_144


def suffix_tree(max_depth: int) -> Any:
    """A new, empty C++ suffix tree of ``max_depth``; InputError (how to install it) without the package."""
    try:
        from arctic_inference.suffix_decoding._C import SuffixTree
    except ImportError as error:
        raise InputError(
            f"suffix decoding needs the arctic-inference package ({first_line(error)}); install it with "
            f"{SUFFIX_INSTALL}"
        ) from None
    return SuffixTree(max_depth)


def suffix_trees_available() -> bool:
    """Whether the suffix trees can be built here."""
    try:
        suffix_tree(1)
    except InputError:
        return False
    return True


@dataclass(frozen=True)
class DraftLimits:
    """How much a tree drafts after a match: at most ``num_draft_tokens`` tokens and ``factor`` per matched token,
    none less likely than ``min_token_prob``; a tree of candidates or one path."""

    num_draft_tokens: int
    factor: float = 1.0
    min_token_prob: float = 0.1
    tree: bool = True


@dataclass
class SuffixDraft:
    """A tree's draft: tokens best first (parents before children, -1 a root), each node's estimated path
    probability, and the length of the context match it continues."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    match_len: int = 0

    @property
    def score(self) -> float:
        """The expected number of accepted tokens, by the tree's own estimates (what picks between trees)."""
        return sum(self.probs)

    def keys(self, context: Sequence[int]) -> list[tuple[int, ...]]:
        """For each node, the last :data:`PROVENANCE_TOKENS` tokens of the matched context and its path up to and
        including the node (fewer when they are fewer): a run of tokens the tree holds, which names where the
        node came from."""
        paths: list[list[int]] = []
        for token, parent in zip(self.tokens, self.parents):
            paths.append((paths[parent] if parent >= 0 else []) + [token])
        matched = [int(token) for token in context[len(context) - self.match_len :]] if self.match_len else []
        return [tuple((matched + path)[-PROVENANCE_TOKENS:]) for path in paths]


def speculate(tree: Any, context: Sequence[int], limits: DraftLimits, max_depth: int) -> SuffixDraft:
    """The draft ``tree`` (of ``max_depth``) proposes after ``context``, of which it matches the last ``max_depth``
    tokens at most."""
    if limits.num_draft_tokens <= 0 or len(context) < 2:
        return SuffixDraft()
    native = tree.speculate(
        [int(token) for token in context[-max_depth:]], limits.num_draft_tokens, limits.factor, 0.0,
        limits.min_token_prob, limits.tree,
    )
    return SuffixDraft(list(native.token_ids), list(native.parents), list(native.probs), int(native.match_len))


def packed(tokens: Sequence[int]) -> bytes:
    """Token ids as 32-bit integers, for :func:`holds`."""
    return array("i", [int(token) for token in tokens]).tobytes()


def holds(sequence: bytes, run: Sequence[int]) -> bool:
    """Whether the packed ``sequence`` holds the tokens ``run`` in a row (a search at C speed, aligned to whole
    tokens)."""
    needle = packed(run)
    at = sequence.find(needle)
    while at >= 0 and at % 4:
        at = sequence.find(needle, at + 1)
    return at >= 0


class PromptTree:
    """One race's own tree: its prompt, then its output as it grows (one sequence, so a match may run from the
    prompt into the output). Tells whether a drafted token came from the prompt or from the output so far."""

    def __init__(self, max_depth: int = DEFAULT_MAX_DEPTH) -> None:
        self.max_depth = max_depth
        self._tree: Any = None
        self._length = 0
        self._prompt = b""

    def start(self, prompt_ids: Sequence[int]) -> None:
        """A new race: a tree over ``prompt_ids`` alone."""
        self._tree = suffix_tree(self.max_depth)
        self._length = 0
        self._prompt = packed(prompt_ids)
        self.extend(prompt_ids)

    def extend(self, context: Sequence[int]) -> None:
        """Add what ``context`` (the prompt and output so far) holds beyond what the tree has seen."""
        if len(context) > self._length:
            self._tree.extend(0, [int(token) for token in context[self._length :]])
            self._length = len(context)

    def speculate(self, context: Sequence[int], limits: DraftLimits) -> SuffixDraft:
        return speculate(self._tree, context, limits, self.max_depth)

    def from_prompt(self, key: Sequence[int]) -> bool:
        """Whether the tokens ``key`` (a drafted token after its context, see :meth:`SuffixDraft.keys`) occur in
        the prompt."""
        return holds(self._prompt, key)


class SuffixMemory:
    """The answers of earlier races, in one suffix tree: what suffix decoding drafts from besides the race's own
    prompt and output.

    Answers enter only through :meth:`remember` (after a race, never during one: a warm-up or the other side's
    output never feeds the race it belongs to). Each answer is numbered in the order remembered (1, 2, ...); the
    memory keeps at most ``max_answers`` answers and ``max_tokens`` tokens, forgetting the oldest first, and an
    answer longer than that keeps its first ``max_tokens``. All methods are thread-safe.
    """

    def __init__(
        self, max_answers: int = DEFAULT_MAX_ANSWERS, max_tokens: int = DEFAULT_MAX_TOKENS,
        max_depth: int = DEFAULT_MAX_DEPTH,
    ) -> None:
        if max_answers < 1 or max_tokens < 1:
            raise ValueError(f"a memory holds at least one answer of one token, got {max_answers}, {max_tokens}")
        self.max_answers, self.max_tokens, self.max_depth = max_answers, max_tokens, max_depth
        self._lock = threading.Lock()
        self._tree: Any = None
        self._answers: OrderedDict[int, bytes] = OrderedDict()  # number -> its tokens (packed), oldest first
        self._tokens = 0
        self._numbered = 0  # answers remembered so far (forgotten ones included)

    @property
    def answers(self) -> int:
        """How many earlier answers the memory holds."""
        return len(self._answers)

    @property
    def tokens(self) -> int:
        """Their tokens, in all."""
        return self._tokens

    def describe(self) -> dict[str, int]:
        """What the memory holds, as JSON-ready numbers."""
        with self._lock:
            return {"answers": len(self._answers), "tokens": self._tokens, "max_answers": self.max_answers,
                    "max_tokens": self.max_tokens}

    def remember(self, answer: Sequence[int]) -> int | None:
        """Remember an answer (token ids); its number, None for an empty one."""
        ids = [int(token) for token in answer][: self.max_tokens]
        if not ids:
            return None
        with self._lock:
            if self._tree is None:
                self._tree = suffix_tree(self.max_depth)
            self._numbered += 1
            number = self._numbered
            self._tree.extend(number, ids)
            self._answers[number] = packed(ids)
            self._tokens += len(ids)
            self._evict()
        logger.debug("Remembered answer %d (%d tokens): %d answers, %d tokens", number, len(ids), self.answers,
                     self.tokens)
        return number

    def forget(self) -> None:
        """Forget every answer (the numbering goes on, so a hover never names two answers alike)."""
        with self._lock:
            self._tree = None
            self._answers.clear()
            self._tokens = 0

    def speculate(self, context: Sequence[int], limits: DraftLimits) -> SuffixDraft:
        """The memory's draft after ``context``."""
        with self._lock:
            if self._tree is None:
                return SuffixDraft()
            return speculate(self._tree, context, limits, self.max_depth)

    def answers_holding(self, draft: SuffixDraft, context: Sequence[int], nodes: Iterable[int]
                        ) -> dict[int, int | None]:
        """For each of ``nodes`` of a draft of this memory's after ``context``, the number of the remembered
        answer holding it after its matched context (its parent's answer first, else the latest that does; None
        where none does, as after an eviction). Asked only of the nodes a round keeps: it searches the answers."""
        keys = draft.keys(context)
        numbers: dict[int, int | None] = {}
        with self._lock:
            for node in sorted(nodes):  # parents first
                parent = draft.parents[node]
                numbers[node] = self._holding(keys[node], numbers.get(parent) if parent >= 0 else None)
        return numbers

    def _holding(self, key: Sequence[int], hint: int | None) -> int | None:
        """The remembered answer holding the tokens ``key``: ``hint`` when it does, else the latest that does."""
        if hint is not None and hint in self._answers and holds(self._answers[hint], key):
            return hint
        return next((number for number in reversed(self._answers) if holds(self._answers[number], key)), None)

    def _evict(self) -> None:
        """Forget the oldest answers beyond the bounds (the newest always stays)."""
        while len(self._answers) > 1 and (len(self._answers) > self.max_answers or self._tokens > self.max_tokens):
            number, ids = self._answers.popitem(last=False)
            self._tree.remove(number)
            self._tokens -= len(ids) // 4
