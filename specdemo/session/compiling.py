"""Whether a run's target passes are compiled: the ``--compile auto|on|off`` choice, made once per run before
anything is timed, and the warm-up that makes the graphs.

``off`` is the eager path every earlier figure was measured on (:class:`~specdemo.backends.transformers_lm.CachedLM`);
``on`` runs both sides of a race on :class:`~specdemo.backends.static_lm.StaticLM`, compiled with ``torch.compile``
(CUDA graphs on a GPU, inductor with frozen weights on a CPU); ``auto`` compiles on a GPU, and on a CPU only where a
measurement (:func:`measure_compiled`: a one-token pass compiled against an eager one, once per machine, model and
format, cached beside the cost curves) found compiled passes faster. Whatever is chosen, a compilation that cannot
happen (no C++ compiler for inductor, a model without a static cache, ZeroGPU, an error while compiling) falls back
to eager with one line saying why, before the race starts.
"""

from __future__ import annotations

import json
import logging
import shutil
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Collection, Sequence

import torch
from transformers import PreTrainedModel

from ..backends.eagle3_head import EagleHead
from ..backends.eagle3_static import COMPILED_ROWS, StaticHeadCache
from ..backends.formats import is_int8_format
from ..backends.loading import LoadedModel
from ..backends.medusa_heads import MedusaHeads
from ..backends.passes import EAGER, PLAIN_ROLE, SPEC_ROLE, Passes
from ..backends.static_lm import (
    CUDA_GRAPHS,
    INDUCTOR,
    PASS_SIZES,
    StaticLM,
    forget_compiled,
    pass_size,
    supports_static_cache,
)
from ..backends.transformers_lm import CachedLM
from ..core.clock import now
from ..core.errors import InputError, first_line
from ..core.files import write_json_atomic
from ..core.protocol import LanguageModel
from ..core.settings import COMPILE_CHOICES, GenerationSettings
from ..methods import SpecSettings
from .calibration import cache_path

logger = logging.getLogger(__name__)



@dataclass
class CompileOutcome:
    """What ``--compile`` gave: the passes a run uses, why, and what compiling them cost."""

    choice: str
    passes: Passes = EAGER
    reason: str = ""
    seconds: float = 0.0
    #: the pass sizes compiled (rows), per side
    compiled: dict[str, list[int]] = field(default_factory=dict)

    @property
    def compiled_passes(self) -> bool:
        return self.passes.compile_mode is not None

    def describe(self) -> str:
        """One line for a header or a page: compiled or eager, why, and how long compiling took."""
        if not self.compiled_passes:
            return f"eager passes (--compile {self.choice}): {self.reason}"
        parts = "; ".join(f"{part}: {', '.join(map(str, sizes))}" for part, sizes in self.compiled.items())
        timing = f", {self.seconds:.1f} s compiling the rows of each pass ({parts})" if self.compiled else ""
        return f"compiled passes ({self.passes.compile_mode}, --compile {self.choice}): {self.reason}{timing}"

    def as_record(self) -> dict:
        """The outcome for a results JSON or a race log."""
        return {"choice": self.choice, "compile_mode": self.passes.compile_mode, "reason": self.reason,
                "compile_seconds": round(self.seconds, 2), "compiled_pass_sizes": self.compiled}


def check_compile_choice(choice: str) -> str:
    if choice not in COMPILE_CHOICES:
        raise InputError(f"--compile must be one of {', '.join(COMPILE_CHOICES)}, got {choice!r}")
    return choice


def _why_not(target: LoadedModel, zero_gpu: bool) -> str | None:
    """Why the target's passes cannot be compiled here (one line), or None."""
    if zero_gpu:
        return "ZeroGPU cannot compile at run time"
    if target.device.type not in ("cuda", "cpu"):
        return f"compiled passes are built for CUDA GPUs and CPUs, not {target.device.type}"
    unsupported = supports_static_cache(target.model)
    if unsupported:
        return unsupported
    if is_int8_format(target.model):
        return (f"the {target.format} format's kernels cannot be traced by the compiler (FBGEMM's packed weights), "
                "so a compiled pass falls apart into a graph per layer: slower than eager, after minutes of compiling")
    if target.device.type == "cpu" and not (shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")):
        return "no C++ compiler for torch.compile's CPU code on this machine"
    return None


def choose_passes(
    choice: str, target: LoadedModel, zero_gpu: bool = False, measure: bool = True, folder: Path | None = None
) -> CompileOutcome:
    """The passes ``--compile choice`` gives for ``target`` on this machine (nothing is compiled for the run yet).
    ``auto`` on a CPU reads the cached verdict of :func:`measure_compiled` for this machine, model and format, and
    measures it when there is none and ``measure`` allows (the bench and the app do when they calibrate)."""
    check_compile_choice(choice)
    if choice == "off":
        return CompileOutcome(choice, EAGER, "as asked")
    why_not = _why_not(target, zero_gpu)
    if why_not:
        if choice == "on":
            logger.warning("--compile on: eager passes instead: %s", why_not)
        return CompileOutcome(choice, EAGER, why_not)
    on_gpu = target.device.type == "cuda"
    mode = CUDA_GRAPHS if on_gpu else INDUCTOR
    reason = "CUDA graphs on the GPU" if on_gpu else "inductor on the CPU"
    if choice == "auto" and not on_gpu:
        verdict = compiled_verdict(target, measure, folder)
        if verdict is None:
            return CompileOutcome(choice, EAGER, "on a CPU, compiled passes are used where measured faster; not "
                                  "measured here (no calibration)")
        if not verdict.pays:
            return CompileOutcome(choice, EAGER, f"on this CPU, {verdict.describe()}")
        reason = f"inductor on the CPU, {verdict.describe()}"
    return CompileOutcome(choice, Passes(mode), reason)


# ----------------------------------------------------------------------------------------------------------------
# auto on a CPU: measured

#: compiled passes pay on a CPU when a compiled one-token pass costs at most this share of an eager one (passes move
#: by several per cent from minute to minute on a shared machine: anything closer stays eager)
PAYS_BELOW = 0.95
#: the version of the measurement and of what compiling means on a CPU (a cached verdict of another is measured again)
VERDICT_VERSION = 1
#: tokens cached before the timed passes, and timed passes of each kind
MEASURE_PREFIX, MEASURE_REPEATS = 64, 7


@dataclass
class CompiledVerdict:
    """A one-token pass of one model and format on one machine, eager and compiled: whether compiling pays."""

    eager_seconds: float
    compiled_seconds: float
    compile_seconds: float
    version: int = VERDICT_VERSION

    @property
    def pays(self) -> bool:
        return self.compiled_seconds <= PAYS_BELOW * self.eager_seconds

    def describe(self) -> str:
        return (f"a compiled one-token pass measured {self.compiled_seconds * 1000:.1f} ms against "
                f"{self.eager_seconds * 1000:.1f} ms eager (compiling it took {self.compile_seconds:.0f} s)")


def _verdict_path(target: LoadedModel, folder: Path | None) -> Path:
    path = cache_path(target, None, folder)
    return path.with_name(f"compile-{path.name}")


def compiled_verdict(target: LoadedModel, measure: bool = True, folder: Path | None = None) -> CompiledVerdict | None:
    """The cached verdict for this machine, model and format; measured and cached when there is none and
    ``measure`` (None: none and not measured)."""
    path = _verdict_path(target, folder)
    try:
        verdict = CompiledVerdict(**json.loads(path.read_text()))
        if verdict.version == VERDICT_VERSION:
            return verdict
    except FileNotFoundError:
        pass
    except (OSError, ValueError, TypeError) as error:
        logger.warning("Measuring compiled passes again: the cached verdict %s is unreadable: %s", path, error)
    if not measure:
        return None
    verdict = measure_compiled(target)
    try:
        write_json_atomic(path, asdict(verdict), indent=1)
    except OSError as error:
        logger.warning("Could not cache %s: %s", path, error)
    return verdict


def measure_compiled(target: LoadedModel) -> CompiledVerdict:
    """A one-token pass after :data:`MEASURE_PREFIX` cached tokens, eager and compiled (inductor), medians of
    :data:`MEASURE_REPEATS` each; a compilation that fails measures as never paying."""
    logger.info("Measuring compiled passes of %s (%s) on this machine (once)", target.source, target.format)
    generator = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, int(target.model.config.vocab_size), (MEASURE_PREFIX + 1,), generator=generator)
    eager = _one_token_seconds(CachedLM(target.model), prefix, target.device)
    started = time.perf_counter()
    try:
        compiled_lm = StaticLM(target.model, MEASURE_PREFIX + 1, INDUCTOR, "measure")
        compiled_lm.reset()
        compiled_lm.run(prefix[:1], all_logits=False, with_hidden=False)
        compiled_lm.run(prefix[1:2], all_logits=False, with_hidden=False)  # compiles the one-token graph
        compile_seconds = time.perf_counter() - started
        compiled = _one_token_seconds(compiled_lm, prefix, target.device)
    except Exception as error:  # noqa: BLE001 - a compiler that fails here never pays
        logger.warning("Compiling a pass failed while measuring: %s", first_line(error))
        forget_compiled()
        return CompiledVerdict(eager, float("inf"), time.perf_counter() - started)
    verdict = CompiledVerdict(eager, compiled, compile_seconds)
    if not verdict.pays:  # no run will use the graph, whose frozen copy of the weights takes gigabytes
        forget_compiled()
    return verdict


def _one_token_seconds(lm: LanguageModel, prefix: torch.Tensor, device: torch.device) -> float:
    """The median seconds of a one-token pass after ``prefix[:-1]``, eager or compiled alike."""
    times = []
    with torch.inference_mode():
        for _ in range(MEASURE_REPEATS + 1):
            lm.reset()
            lm.run(prefix[:-1], all_logits=False, with_hidden=False)
            started = now(device)
            lm.run(prefix[-1:], all_logits=False, with_hidden=False)
            times.append(now(device) - started)
    return statistics.median(times[1:])


def longest_draft_of(spec: SpecSettings) -> int:
    """The most tokens one round of ``spec`` drafts: its fixed draft length, else its policy's longest."""
    if spec.num_draft_tokens_schedule == "fixed" and spec.num_draft_tokens is not None:
        return spec.num_draft_tokens
    return max(spec.max_num_draft_tokens, spec.num_draft_tokens or 0)


def sizes_up_to(max_rows: int) -> list[int]:
    """The padded pass sizes a run whose passes hold at most ``max_rows`` rows meets (a larger pass than the
    largest size runs eagerly)."""
    largest = pass_size(max(max_rows, 1)) or PASS_SIZES[-1]
    return [size for size in PASS_SIZES if size <= largest]


def drafting_model_of(spec: SpecSettings, target: LoadedModel, draft: LoadedModel | None) -> torch.nn.Module | None:
    """The model or head ``spec``'s drafter runs through the run's passes (the draft model as it drafts, an int8
    copy or itself; an EAGLE head), or None when it runs none."""
    method = spec.method
    if method.drafting_model is None:
        return None
    return method.drafting_model(target, draft, spec.options())


def compile_graphs(
    outcome: CompileOutcome, target: LoadedModel, spec_hidden: Collection[bool], max_rows: int, max_tokens: int,
    drafting: Sequence[torch.nn.Module] = (),
) -> CompileOutcome:
    """Make every graph a run may use, before anything is timed: the plain side's one-token step and, for each
    value in ``spec_hidden`` (the speculative modes to run ask for the target's hidden states or not), every pass
    size up to ``max_rows`` rows, on buffers that hold ``max_tokens`` (the longest prompt and answer to come); and
    the passes of each of ``drafting`` (draft models, EAGLE heads: see :func:`drafting_model_of`) that compiles. A
    compilation that fails gives eager passes and the reason; the outcome records the seconds it took and the sizes
    compiled."""
    if not outcome.compiled_passes:
        return outcome
    started = time.perf_counter()
    spec_sizes = sizes_up_to(max_rows)
    plan = [(PLAIN_ROLE, [1], False)] + [(SPEC_ROLE, spec_sizes, hidden) for hidden in sorted(set(spec_hidden))]
    compiled: dict[str, list[int]] = {}
    try:
        for role, sizes, hidden in plan:
            _run_every_size(target, outcome.passes, role, sizes, hidden, max_tokens)
            compiled[role + (" with hidden states" if hidden else "")] = sizes
        for model in drafting:
            if isinstance(model, EagleHead):
                head_sizes = _run_every_head_size(model, outcome.passes, max_tokens)
                if head_sizes:
                    compiled["EAGLE head"] = head_sizes
            elif isinstance(model, MedusaHeads):
                _run_medusa_features(model, outcome.passes)
                compiled["Medusa heads"] = [1]
            elif isinstance(model, PreTrainedModel):
                draft_sizes = _run_every_draft_size(model, outcome.passes, max_tokens)
                if draft_sizes:
                    compiled["draft model"] = draft_sizes
    except Exception as error:  # noqa: BLE001 - any compiler failure falls back to eager, before the race
        logger.warning("compiling the target's passes failed, eager passes instead: %s", first_line(error))
        return replace(outcome, passes=EAGER, reason=f"compiling failed: {first_line(error)}",
                       seconds=time.perf_counter() - started, compiled={})
    seconds = time.perf_counter() - started
    logger.info("compiled the target's passes in %.1f s: %s", seconds, compiled)
    return replace(outcome, seconds=seconds, compiled=compiled)


def _run_every_size(
    target: LoadedModel, passes: Passes, role: str, sizes: Sequence[int], with_hidden: bool, max_tokens: int
) -> None:
    """One pass of every size in ``sizes`` after a one-token prompt, on ``role``'s buffers for ``max_tokens``
    (then forgotten)."""
    settings = GenerationSettings(max_new_tokens=max(max_tokens, max(sizes) + 1))
    lm = passes.language_model(target, [], settings, role)
    with torch.inference_mode():
        for size in sizes:
            lm.reset()
            lm.run(torch.zeros(1, dtype=torch.long), all_logits=False, with_hidden=False)
            lm.run(torch.zeros(size, dtype=torch.long), with_hidden=with_hidden)
        lm.reset()


def _run_every_draft_size(model: PreTrainedModel, passes: Passes, max_tokens: int) -> list[int]:
    """The passes a draft model meets in a race, once each: a step and its feed of one or two tokens (logits of
    the last row), and a catch-up or a restricted head's pass of the base model over every pass size (hidden
    states); returns the sizes compiled (none where the draft stays eager)."""
    lm = passes.draft_language_model(model, max_tokens)
    if not isinstance(lm, StaticLM) or lm.compile_mode is None:
        return []
    sizes = list(PASS_SIZES) if lm.pads else [1, 2]
    with torch.inference_mode():
        for size in sizes:
            for logits in (True, False) if size <= 2 else (False,):
                lm.reset()
                lm.run(torch.zeros(1, dtype=torch.long), all_logits=False, with_hidden=False)
                ids = torch.zeros(size, dtype=torch.long)
                lm.forward(ids, all_logits=False) if logits else lm.hidden_states(ids)
        lm.reset()
    return sizes


def _run_every_head_size(head: EagleHead, passes: Passes, max_tokens: int) -> list[int]:
    """The steps an EAGLE head meets in a race, once each: every row count it compiles (a chain's one token, a
    tree's frontier, a short catch-up); returns the sizes compiled (none where the head stays eager)."""
    cache = passes.head_cache(head, max_tokens)
    if not isinstance(cache, StaticHeadCache) or cache.compile_mode is None:
        return []
    sizes = list(COMPILED_ROWS)
    width = head.config.hidden_size
    with torch.inference_mode():
        for size in sizes:
            cache.crop(0)
            rows = torch.zeros(size, width, dtype=head.dtype, device=head.device)
            cache.step(head, rows, rows, torch.arange(size, device=head.device))
        cache.crop(0)
    return sizes


def _run_medusa_features(heads: MedusaHeads, passes: Passes) -> None:
    """The heads' one compiled step (their features of one hidden state)."""
    parameter = next(heads.parameters())
    with torch.inference_mode():
        passes.medusa_features(heads)(torch.zeros(1, heads.config.hidden_size, dtype=parameter.dtype,
                                                  device=parameter.device))
