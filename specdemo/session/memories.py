"""One suffix memory per visitor: the answers of a visitor's earlier races, which the suffix mode drafts from.

A hosted app's visitors never share a memory (a drafted token's hover names the answer it came from, and no visitor
may learn anything of another's); each memory is bounded in answers and tokens, and so is the number of visitors
remembered (the one idle longest is forgotten first). The app keys memories by Gradio's session, so a page reload
starts with an empty memory.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass

from ..backends.suffix_trees import SuffixMemory

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MemoryLimits:
    """How much the memories hold: earlier answers and their tokens per visitor, and visitors."""

    answers: int = 256
    tokens: int = 65_536
    visitors: int = 64


#: a local app's limits (one visitor, usually) and a hosted app's (strangers: small memories, a bounded total)
LOCAL_MEMORY = MemoryLimits()
HOSTED_MEMORY = MemoryLimits(answers=16, tokens=8192, visitors=32)


class SuffixMemories:
    """The visitors' memories, by visitor key (the most recently used last); thread-safe."""

    def __init__(self, limits: MemoryLimits = LOCAL_MEMORY) -> None:
        self.limits = limits
        self._lock = threading.Lock()
        self._memories: OrderedDict[str, SuffixMemory] = OrderedDict()

    def get(self, visitor: str) -> SuffixMemory:
        """The visitor's memory, a new empty one the first time (forgetting the visitor idle longest beyond the
        limit)."""
        with self._lock:
            memory = self._memories.pop(visitor, None)
            if memory is None:
                memory = SuffixMemory(self.limits.answers, self.limits.tokens)
            self._memories[visitor] = memory
            while len(self._memories) > self.limits.visitors:
                self._memories.popitem(last=False)
            return memory

    def describe(self, visitor: str) -> dict[str, int]:
        """What the visitor's memory holds (nothing, for a visitor without one)."""
        with self._lock:
            memory = self._memories.get(visitor)
        if memory is None:  # an empty one describes it (no tree is built before an answer)
            memory = SuffixMemory(self.limits.answers, self.limits.tokens)
        return memory.describe()

    def remember(self, visitor: str, answer: list[int]) -> None:
        """Add an answer to the visitor's memory."""
        self.get(visitor).remember(answer)

    def forget(self, visitor: str) -> None:
        """Forget the visitor's earlier answers (the Forget button; the numbering of answers goes on)."""
        with self._lock:
            memory = self._memories.get(visitor)
        if memory is not None:
            memory.forget()

    def drop(self, visitor: str) -> None:
        """Drop the visitor's memory altogether (a closed page)."""
        with self._lock:
            self._memories.pop(visitor, None)

    def __len__(self) -> int:
        return len(self._memories)
