"""Near-identical texts: the share of word 3-grams two texts have in common (Jaccard similarity of their shingle
sets), found among thousands of texts without comparing every pair.

Each text is sketched by the :data:`SKETCH_SIZE` of its shingles with the smallest hashes (a bottom-k sketch);
two texts whose shingle sets overlap by most of their shingles very likely share one of those, so only texts that
share a sketched shingle are compared, and the comparison is exact. (datasketch's MinHash LSH does the same job
with estimated similarities; a pool of some ten thousand prompts needs neither its estimates nor its numpy and
scipy dependencies at run time.)
"""

from __future__ import annotations

import hashlib
import logging
import re
from typing import Iterable, Sequence

logger = logging.getLogger(__name__)

#: two texts are near-identical at or above this Jaccard similarity of their word 3-grams
NEAR_IDENTICAL = 0.8
#: shingles per sketch
SKETCH_SIZE = 12
#: a sketched shingle held by more texts than this is too common to find pairs by (a template's words)
MAX_BUCKET = 2000
_WORD = re.compile(r"\w+")


def shingles(text: str, size: int = 3) -> frozenset[str]:
    """The text's lowercased word ``size``-grams (the whole text as one shingle when it is shorter)."""
    words = _WORD.findall(text.lower())
    if len(words) <= size:
        return frozenset([" ".join(words)]) if words else frozenset()
    return frozenset(" ".join(words[i : i + size]) for i in range(len(words) - size + 1))


def jaccard(first: frozenset[str], second: frozenset[str]) -> float:
    if not first and not second:
        return 1.0
    return len(first & second) / len(first | second)


def _sketch(shingle_set: frozenset[str]) -> list[str]:
    return sorted(shingle_set, key=lambda s: hashlib.blake2b(s.encode(), digest_size=8).digest())[:SKETCH_SIZE]


class ShingleIndex:
    """Texts added one by one; :meth:`closest` finds an added text near-identical to a new one."""

    def __init__(self, threshold: float = NEAR_IDENTICAL) -> None:
        self.threshold = threshold
        self._sets: list[frozenset[str]] = []
        self._buckets: dict[str, list[int]] = {}

    def __len__(self) -> int:
        return len(self._sets)

    def closest(self, text: str) -> tuple[int, float] | None:
        """The added text most similar to ``text`` at or above the threshold, as (its number, similarity)."""
        candidate_set = shingles(text)
        best: tuple[int, float] | None = None
        seen: set[int] = set()
        for shingle in _sketch(candidate_set):
            bucket = self._buckets.get(shingle, ())
            if len(bucket) > MAX_BUCKET:
                continue
            for number in bucket:
                if number in seen:
                    continue
                seen.add(number)
                similarity = jaccard(candidate_set, self._sets[number])
                if similarity >= self.threshold and (best is None or similarity > best[1]):
                    best = (number, similarity)
        return best

    def add(self, text: str) -> int:
        number = len(self._sets)
        shingle_set = shingles(text)
        self._sets.append(shingle_set)
        for shingle in _sketch(shingle_set):
            self._buckets.setdefault(shingle, []).append(number)
        return number


def distinct(texts: Iterable[str], threshold: float = NEAR_IDENTICAL, against: Sequence[str] = ()) -> list[int]:
    """The positions of the texts kept when each one near-identical to an earlier kept one (or to one of
    ``against``) is dropped."""
    index = ShingleIndex(threshold)
    for text in against:
        index.add(text)
    kept = []
    for position, text in enumerate(texts):
        if index.closest(text) is None:
            kept.append(position)
            index.add(text)
    return kept
