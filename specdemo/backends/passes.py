"""How a run's passes run: eagerly on growing caches, or on static caches, compiled (``--compile``; the choice is
made in :mod:`specdemo.session.compiling`). One :class:`Passes` serves a whole race: the target's two sides, a draft
model's passes, an EAGLE head's steps and Medusa heads' features, so a drafter never decides on its own whether it
compiles.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable, Sequence

import torch
from transformers import PreTrainedModel

from ..core.protocol import LanguageModel
from ..core.settings import GenerationSettings
from .eagle3_head import EagleHead, HeadKVCache
from .eagle3_static import StaticHeadCache
from .formats import W8A8, is_int8_format
from .int8 import is_int8_copy
from .loading import LoadedModel
from .medusa_heads import MedusaHeads
from .static_lm import GRAPHS, StaticLM, compiled, kept, supports_static_cache
from .transformers_lm import CachedLM

#: the roles of a target's sequences in a race (each keeps its own static buffers and graphs), and a draft model's
PLAIN_ROLE, SPEC_ROLE, DRAFT_ROLE = "plain", "spec", "draft"


@dataclass(frozen=True)
class Passes:
    """How a run's passes run, the same for both sides of a race and for what drafts: ``compile_mode`` None: eager
    on a growing cache (or, ``static``, on a static cache: the compiled passes' cache handling without a compiler);
    else on a static cache, compiled with this ``torch.compile`` mode."""

    compile_mode: str | None = None
    static: bool = False

    @property
    def eager(self) -> bool:
        return self.compile_mode is None and not self.static

    def language_model(
        self, target: LoadedModel, prompt_ids: Sequence[int], settings: GenerationSettings, role: str
    ) -> LanguageModel:
        """The target as the decoding loop sees it, for one run of ``settings`` after ``prompt_ids``."""
        if self.eager:
            return CachedLM(target.model)
        return StaticLM(target.model, len(prompt_ids) + settings.max_new_tokens, self.compile_mode, role)

    def draft_language_model(self, model: PreTrainedModel, max_tokens: int) -> CachedLM | StaticLM:
        """A draft model's sequence of at most ``max_tokens``: as the target's passes run, except that a draft in a
        format the compiler cannot trace (an int8 copy, say) or without a static cache stays eager."""
        if self.eager or why_not_draft(model):
            return CachedLM(model)
        return StaticLM(model, max_tokens, self.compile_mode, DRAFT_ROLE)

    def head_cache(self, head: EagleHead, max_tokens: int) -> HeadKVCache | StaticHeadCache:
        """An EAGLE head's cache for a sequence of at most ``max_tokens``: its steps as the target's passes run,
        except that a head in w8a8 (integer kernels the compiler cannot trace) stays eager."""
        if self.eager or head.number_format == W8A8:
            return HeadKVCache()
        return StaticHeadCache(head, max_tokens, self.compile_mode)

    def medusa_features(self, heads: MedusaHeads) -> Callable[[torch.Tensor], torch.Tensor]:
        """Medusa heads' features of one hidden state [1, H] -> [K, 1, H] (their residual blocks, the part of a
        round's drafting whose shape never changes): as the target's passes run, one graph when compiled."""
        if self.compile_mode is None:
            return heads.features
        return partial(_compiled_features, heads, self.compile_mode)


EAGER = Passes()


def _features(heads: MedusaHeads, hidden: torch.Tensor) -> torch.Tensor:
    return heads.features(hidden)


def _compiled_features(heads: MedusaHeads, mode: str, hidden: torch.Tensor) -> torch.Tensor:
    """``heads.features(hidden)`` compiled (static shapes) while the graph bound allows, else eager."""
    if not GRAPHS.admit(("medusa heads", id(heads), tuple(hidden.shape), mode)):
        return heads.features(hidden)
    return kept(compiled(_features, mode, dynamic=False)(heads, hidden), mode)


def why_not_draft(model: PreTrainedModel) -> str | None:
    """Why a draft model's passes stay eager beside compiled target passes (one line), or None."""
    if is_int8_format(model) or is_int8_copy(model):
        return "the draft runs in an int8 format, whose kernels the compiler cannot trace"
    return supports_static_cache(model)
