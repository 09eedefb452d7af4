"""The settings of a decoding run: how tokens are chosen, how many are written, and the longest draft.

No torch here: front ends validate settings before any model is loaded.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

#: the most tokens one round may draft. It comes from verification: a verify pass covers the last token and the
#: draft, and the int8 formats' row-wise attention takes at most 65 queries per pass
#: (``backends.formats.ROW_WISE_MAX_QUERIES``, which is derived from this constant: core imports no backend)
MAX_NUM_DRAFT_TOKENS = 64
#: the most new tokens a run may write
MAX_NEW_TOKENS = 32768
#: how the target's passes run (``--compile``): compiled where it pays (auto), compiled, or eager
COMPILE_CHOICES = ("auto", "on", "off")


@dataclass(frozen=True)
class SamplingSettings:
    """How the next token is chosen. ``temperature == 0`` means greedy (argmax)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def validate(self) -> None:
        if not (self.temperature >= 0.0) or self.temperature > 100.0:
            raise ValueError(f"temperature must be between 0 and 100, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass(frozen=True)
class GenerationSettings:
    """One run's length limit, sampling and stopping; ``collect_probs``: compute each shown token's draft/target
    probability for display (outside the timed work)."""

    max_new_tokens: int = 128
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    stop_on_eos: bool = True
    collect_probs: bool = True

    def validate(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a whole number >= 1, got {self.max_new_tokens!r}")
        if self.max_new_tokens > MAX_NEW_TOKENS:
            raise ValueError(f"max_new_tokens must be at most {MAX_NEW_TOKENS}, got {self.max_new_tokens}")
        self.sampling.validate()
