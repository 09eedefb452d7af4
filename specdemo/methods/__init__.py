"""The drafting methods, one file each, and the one registry of speculative modes.

Every front end (the app, ``/race``, the bench, the recorder, the replay) and the session ask this registry what a
mode is (:class:`~specdemo.methods.base.Method`). Adding a method is one new file in this folder that declares its
``METHOD`` (or ``METHODS``, for a file that offers several modes): the registry finds it, in the order of the file
names.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any, Sequence

from ..core.errors import InputError
from ..core.protocol import Drafter, DraftLengthPolicy
from ..core.settings import MAX_NUM_DRAFT_TOKENS
from ..backends.passes import EAGER, Passes
from .base import BuildContext, Method, PolicyContext
from .draft_length import make_policy
from .ngram import NgramOptions
from .suffix import SuffixOptions

if TYPE_CHECKING:
    from ..backends.loading import LoadedModel
    from ..backends.suffix_trees import SuffixMemory
    from ..core.economics import CostCurve
    from ..core.settings import GenerationSettings

#: the n-gram settings' defaults, declared once by the n-gram mode's options (the suffix mode's likewise)
_NGRAM = NgramOptions()
_SUFFIX = SuffixOptions()
#: the files of this folder that hold no method
_NOT_METHODS = frozenset({"base", "draft_length"})


def _collect() -> dict[str, Method]:
    """Every method the files of this folder declare, by name, in the order of the file names."""
    methods: dict[str, Method] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda info: info.name):
        if info.name in _NOT_METHODS:
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        declared = getattr(module, "METHODS", None) or (getattr(module, "METHOD", None),)
        for method in declared:
            if not isinstance(method, Method):
                raise RuntimeError(f"{module.__name__} declares no METHOD or METHODS")
            if method.name in methods or method.name == "plain":
                raise RuntimeError(f"two methods are called {method.name!r}")
            methods[method.name] = method
    return methods


#: every speculative mode by name; "plain" (the baseline every mode is compared with) is none of them
METHODS: dict[str, Method] = _collect()


def get_method(name: str) -> Method:
    """The method called ``name``; InputError naming the known ones otherwise."""
    try:
        return METHODS[name]
    except (KeyError, TypeError):
        raise InputError(f"unknown mode {name!r}; choose one of: {', '.join(METHODS)}", field="mode") from None


@dataclass(frozen=True)
class SpecSettings:
    """How the speculative side drafts: the mode, the draft length and every method's options (each method reads
    the fields its options dataclass names)."""

    mode: str = "draft"
    num_draft_tokens_schedule: str = "adaptive"  # "fixed", "adaptive" (cost-aware) or "heuristic" (+2/-1)
    #: fixed: the tokens drafted every round (required); adaptive, heuristic: the first round's (None: the
    #: schedule's own start, see :func:`~specdemo.methods.draft_length.make_policy`)
    num_draft_tokens: int | None = None
    max_num_draft_tokens: int = 12  # the most an adaptive or heuristic policy drafts in one round
    draft_head_tokens: int | None = None  # draft LM head restricted to this many frequent ids; None = auto, 0 = full
    confidence_stop: float = 0.0
    draft_int8: bool | None = None  # int8 draft copy; None = the method decides (see Method.draft_int8)
    ngram_min: int = _NGRAM.ngram_min
    ngram_max: int = _NGRAM.ngram_max
    ngram_prefer: str = _NGRAM.ngram_prefer  # which earlier occurrence an n-gram draft copies (NGRAM_PREFERENCES)
    medusa_heads: str | None = None  # folder of Medusa heads; None = the heads shipped for the target
    eagle_head: str | None = None  # EAGLE-3 head: a folder or Hub id; None = the head shipped for the target
    eagle_lookup: bool = True  # the EAGLE tree also holds prompt lookup's continuation (greedy runs)
    suffix_factor: float = _SUFFIX.suffix_factor  # suffix trees draft at most this many tokens per matched token
    suffix_min_token_prob: float = _SUFFIX.suffix_min_token_prob  # ... none less likely than this
    suffix_lookup: bool = _SUFFIX.suffix_lookup  # the suffix tree also holds prompt lookup's continuation (greedy)

    @property
    def method(self) -> Method:
        return get_method(self.mode)

    def options(self, method: Method | None = None) -> Any:
        """The options dataclass of ``method`` (default: this mode's), filled from these settings."""
        method = method or self.method
        if method.options is None:
            return None
        return method.options(**{f.name: getattr(self, f.name) for f in fields(method.options)})

    def validate(self) -> None:
        get_method(self.mode)
        if not 1 <= self.max_num_draft_tokens <= MAX_NUM_DRAFT_TOKENS:
            raise InputError(
                f"max_num_draft_tokens (the longest draft) must be between 1 and {MAX_NUM_DRAFT_TOKENS} tokens, got "
                f"{self.max_num_draft_tokens}",
                field="max_num_draft_tokens",
            )
        make_policy(self.num_draft_tokens_schedule, self.num_draft_tokens, self.max_num_draft_tokens)
        first = self.num_draft_tokens
        if self.num_draft_tokens_schedule != "fixed" and first is not None and first > self.max_num_draft_tokens:
            raise InputError(
                f"num_draft_tokens (the first round's draft, {first}) must be at most max_num_draft_tokens "
                f"({self.max_num_draft_tokens}) with the {self.num_draft_tokens_schedule} schedule",
                field="num_draft_tokens",
            )
        for method in METHODS.values():  # every knob is checked, whichever mode runs
            options = self.options(method)
            if options is not None:
                options.validate()

    def draft_runs_int8(self, target: "LoadedModel", draft: "LoadedModel | None") -> bool | None:
        """Whether this mode's draft model runs as an int8 copy (None: the drafter decides)."""
        method = self.method
        return method.draft_int8(self.options(), target, draft) if method.draft_int8 is not None else None


def check_pair(spec: SpecSettings, target: "LoadedModel", draft: "LoadedModel | None") -> None:
    """Refuse, in one line and before any decoding, a pair the mode cannot work with."""
    method = spec.method
    if method.needs_draft_model and draft is None:
        raise InputError(f"mode {spec.mode!r} needs a draft model")
    if method.check is not None:
        method.check(target, draft, spec.options())


def describe_methods(spec: SpecSettings, target: "LoadedModel", modes: Sequence[str]) -> dict[str, dict[str, Any]]:
    """What each of ``modes`` records about its own parts beside ``target`` (with ``spec``'s options), by mode; the
    modes that record nothing, and those that are not methods here (plain, transformers' own), left out."""
    described = {}
    for mode in modes:
        method = METHODS.get(mode)
        if method is not None and method.describe is not None:
            described[mode] = method.describe(target, replace(spec, mode=mode).options())
    return described


def make_spec_policy(
    spec: SpecSettings, target: "LoadedModel", settings: "GenerationSettings", prior: "CostCurve | None" = None
) -> DraftLengthPolicy:
    """The draft-length policy of one speculative run."""
    method = spec.method
    if method.make_policy is not None:
        context = PolicyContext(
            target, settings, spec.options(), spec.num_draft_tokens_schedule, spec.num_draft_tokens,
            spec.max_num_draft_tokens, prior,
        )
        return method.make_policy(context)
    return make_policy(spec.num_draft_tokens_schedule, spec.num_draft_tokens, spec.max_num_draft_tokens,
                       free_drafts=method.drafts_for_free, prior=prior)


def make_drafter(
    spec: SpecSettings,
    target: "LoadedModel",
    draft: "LoadedModel | None",
    settings: "GenerationSettings",
    policy: DraftLengthPolicy | None = None,
    memory: "SuffixMemory | None" = None,
    passes: Passes = EAGER,
) -> Drafter:
    """The drafter of one speculative run (the pair checked first); ``memory``: the answers of earlier races, for
    a mode that drafts from them (suffix decoding); ``passes``: how the run's passes run (a draft model's, a
    head's)."""
    spec.validate()
    check_pair(spec, target, draft)
    return spec.method.build(BuildContext(target, draft, settings, spec.options(), policy, memory,
                                          passes=passes))

