"""``python -m specdemo.bench``: measure plain vs speculative decoding on a prompt set, fairly.

Every mode runs on every prompt with the same settings, modes interleaved per prompt (their order rotates), after
a warm-up; each side is timed only around its own work. Results: a table, a JSON file and optionally a plot.

The bench goes through the session as the app and the recorder do: the same parsers and limits
(:mod:`specdemo.session.request`), the same warm-up, calibration call and divergence check
(:mod:`specdemo.session.racer`), and each per-prompt entry is the one results schema
(:class:`~specdemo.session.results.RunResult`) with the bench's own fields around it. This module is the command
line; the runs are :mod:`specdemo.bench_run`'s, the aggregates, table and chart :mod:`specdemo.bench_report`'s.
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

from tqdm.auto import tqdm

from .backends.loading import (
    LoadedModel,
    LoadSettings,
    ModelLoadError,
    draft_dtype,
    load_model,
    resolve_device,
    resolve_format,
)
from .backends.offline import OfflinePackError
from .bench_checkpoint import BenchCheckpoint, run_key
from .bench_report import (
    aggregate,
    format_table,
    format_verify_costs,
    plain_step_seconds,
    plot,
    split_mode,
    with_variant,
)
from .bench_run import BenchConfig, drafts_with_other_tokenizer, mode_draft, needs_draft_model, run_benchmark
from .core.economics import CostCurve
from .core.errors import InputError
from .core.files import write_json_atomic
from .core.settings import COMPILE_CHOICES, SamplingSettings
from .methods import MAX_NUM_DRAFT_TOKENS, METHODS, SpecSettings, check_pair, describe_methods
from .methods.ngram import NGRAM_PREFERENCES
from .session.calibration import FormatChoice, choose_format, detect_hardware, measures_formats, refresh_if_stale
from .session.format_probe import quick_curves
from .session.preparation import LOADING_DRAFT, LOADING_TARGET, MEASURING_FORMATS, StepProgress, loading_steps
from .session.compiling import check_compile_choice, choose_passes
from .session.presets import PRESETS, default_preset_key, get_preset, preset_eagle_head
from .session.prompts import Prompt, PromptFileError, load_prompts
from .session.racer import calibrate_pair
from .session.request import (
    DTYPES,
    MAX_NEW_TOKENS,
    QUANTIZATIONS,
    parse_draft_length,
    parse_max_new_tokens,
)
from .session.stock import STOCK_MODES

logger = logging.getLogger(__name__)

#: every mode the bench runs: plain decoding, the engine's speculative modes, transformers' own generate
ALL_MODES = ["plain", *METHODS, *STOCK_MODES]

#: the bench's public names; aggregate and format_table live in bench_report and stay importable from here
__all__ = ["ALL_MODES", "aggregate", "build_parser", "format_table", "main", "run_benchmark"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m specdemo.bench",
        description="Benchmark plain vs speculative decoding (exact output, fair timing).",
    )
    parser.add_argument("--pair", help=f"pair preset: {', '.join(PRESETS)} (default: offline pair if installed)")
    parser.add_argument("--target", help="target model: offline:NAME, Hub id, local folder or .gguf file")
    parser.add_argument("--draft", help="draft model (same sources as --target)")
    parser.add_argument("--uag-draft", help="draft for the uag/hf-uag modes when it differs from --draft (a model with another tokenizer)")
    parser.add_argument("--modes", default="plain,draft,ngram", help=f"comma list from: {', '.join(ALL_MODES)}")
    parser.add_argument("--prompts", help="JSON-lines prompt file (Spec-Bench or {id,category,prompt}); default: bundled set")
    parser.add_argument("--categories", help="comma list of categories to keep")
    parser.add_argument("--per-category", type=int, help="keep the first N prompts of each category (a balanced sample)")
    parser.add_argument("--limit", type=int, help="keep the first N prompts (after --categories and --per-category)")
    parser.add_argument("--max-new-tokens", default="128", help=f"new tokens per run (1 to {MAX_NEW_TOKENS})")
    parser.add_argument(
        "--num-draft-tokens-schedule", metavar="{fixed,adaptive,heuristic}",
        help="how many tokens each round drafts: fixed (--num-draft-tokens every round), adaptive (cost-aware, up "
        "to --max-num-draft-tokens; the default) or heuristic (+2/-1, up to the same)",
    )
    parser.add_argument(
        "--num-draft-tokens", metavar="K",
        help=f"fixed: the tokens drafted every round (1 to {MAX_NUM_DRAFT_TOKENS}); adaptive, heuristic: the first "
        "round's (default: the schedule's own). Given without --num-draft-tokens-schedule, the schedule is fixed",
    )
    parser.add_argument(
        "--max-num-draft-tokens", type=int, default=12,
        help=f"the most an adaptive or heuristic schedule drafts in one round (at most {MAX_NUM_DRAFT_TOKENS})",
    )
    parser.add_argument("--draft-head-tokens", type=int, default=None, help="restrict the draft LM head to N frequent ids (0 = full; default auto)")
    parser.add_argument("--draft-int8", choices=["auto", "on", "off"], default="auto", help="draft with an int8 copy of the draft model (auto: on for a CPU draft; for uag, only beside an int8 target)")
    parser.add_argument("--ngram-max", type=int, default=4)
    parser.add_argument("--ngram-min", type=int, default=1)
    parser.add_argument(
        "--ngram-prefer", choices=list(NGRAM_PREFERENCES), default="follow",
        help="which earlier occurrence an n-gram draft copies: follow (continue the last accepted copy, else the "
        "most recent), recent, or first (as transformers' prompt lookup)",
    )
    parser.add_argument(
        "--medusa-heads", help="folder of Medusa heads for the medusa modes (default: the heads shipped for the "
        "offline target); FasterDecoding's layout is accepted",
    )
    parser.add_argument(
        "--eagle-head", help="EAGLE-3 head for the eagle modes: a folder (this project's, EAGLE-3's or speculators' "
        "layout) or a Hub id (default: the head shipped for the target, or the pair preset's)",
    )
    parser.add_argument(
        "--eagle-lookup", choices=["on", "off"], default="on", help="the eagle mode's tree also holds prompt lookup's "
        "continuation as one more branch (the --ngram-* settings choose it); off: the head's candidates alone",
    )
    parser.add_argument(
        "--suffix-memory", choices=["on", "off"], default="on", help="the suffix mode drafts from the answers of the "
        "prompts before too (the prompts run in file order, each answer remembered after its runs); off: from each "
        "prompt's own text alone",
    )
    parser.add_argument("--suffix-factor", type=float, default=SpecSettings.suffix_factor,
                        help="suffix trees draft at most this many tokens per token of context they matched")
    parser.add_argument("--suffix-min-token-prob", type=float, default=SpecSettings.suffix_min_token_prob,
                        help="suffix trees draft no token whose estimated probability is below this")
    parser.add_argument(
        "--suffix-lookup", choices=["on", "off"], default="on", help="the suffix mode's tree also holds prompt "
        "lookup's continuation as one more branch (the --ngram-* settings choose it); off: the suffix trees alone",
    )
    parser.add_argument(
        "--passes", type=int, default=1, help="race the prompt set this many times in a row (1 to 4): with "
        "--suffix-memory on, later passes draft from the answers of earlier ones; the report gains by_pass",
    )
    parser.add_argument("--hf-lookup-tokens", type=int, default=10, help="prompt_lookup_num_tokens for hf-lookup")
    parser.add_argument(
        "--compile", default="auto", help="how the target's passes run: auto (compiled on a GPU, eager on a CPU), on "
        "(a static cache and torch.compile: CUDA graphs on a GPU, inductor on a CPU; compiled in the warm-up), off "
        "(eager); a comma list such as on,off runs every mode in each, named draft@on, draft@off",
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=list(DTYPES),
        help="the target's format: auto (on a CPU, measured: the fastest plain decoding among w8a8, int8 and bfloat16 "
        "where speculation can pay), bfloat16, float16, float32, int8 (CPU: int8 weights, bfloat16 activations), "
        "w8a8 (CPU: int8 weights, int8 activations with a scale per token, FBGEMM)",
    )
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N, mps")
    parser.add_argument(
        "--quantization", choices=list(QUANTIZATIONS), default="none",
        help="bitsandbytes quantisation of the target (CUDA)",
    )
    parser.add_argument("--warmup", type=int, default=1, help="warm-up runs of every mode before timing")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per prompt and mode (the median is kept)")
    parser.add_argument("--raw", action="store_true", help="send prompts as raw text, without the chat template")
    parser.add_argument("--json", type=Path, help="write all results to this JSON file")
    parser.add_argument("--plot", type=Path, help="write a PNG chart of speedup and acceptance per category")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.add_argument(
        "--calibration",
        choices=["cached", "refresh", "off"],
        default="cached",
        help="the machine's cost curve (a target pass over k tokens, a draft step), printed first and written to the "
        "JSON: cached (measure once per machine, model and format, about 15 s), refresh (measure again) or off",
    )
    return parser


def _parse_modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in modes if m not in ALL_MODES]
    if unknown or not modes:
        raise InputError(f"unknown mode(s) {', '.join(unknown) or '(none)'}; choose from: {', '.join(ALL_MODES)}")
    if "plain" in modes:
        modes.remove("plain")
    return ["plain", *dict.fromkeys(modes)]  # plain always runs: every figure is relative to it


def _parse_compile(text: str) -> list[str]:
    choices = list(dict.fromkeys(c.strip() for c in text.split(",") if c.strip()))
    if not choices:
        raise InputError(f"--compile: choose from {', '.join(COMPILE_CHOICES)}")
    for choice in choices:
        _parsed("--compile", check_compile_choice, choice)
    return choices


def _variant_modes(modes: list[str], choices: list[str]) -> list[str]:
    """The bench's modes with ``--compile``'s choices: unchanged for one choice; for several, every engine mode once
    per choice (``plain@on``, ``draft@on``, ``plain@off``, ...) and transformers' own modes once."""
    if len(choices) == 1:
        return modes
    engine = [m for m in modes if m not in STOCK_MODES]
    return [with_variant(m, c) for c in choices for m in engine] + [m for m in modes if m in STOCK_MODES]


def _parsed(option: str, parse: Callable[[Any], Any], value: Any) -> Any:
    """``parse(value)``, its InputError naming ``option``."""
    try:
        return parse(value)
    except InputError as error:
        raise InputError(f"{option}: {error}") from None


def _draft_length(args: argparse.Namespace) -> tuple[str, int | None]:
    """(schedule, num_draft_tokens) of the command line, its InputError naming the option at fault."""
    try:
        return parse_draft_length(args.num_draft_tokens_schedule, args.num_draft_tokens)
    except InputError as error:
        option = "--" + (error.field or "num_draft_tokens").replace("_", "-")
        raise InputError(f"{option}: {error}") from None


@dataclass
class _Request:
    """What the command line asks, parsed and checked, its prompts loaded."""

    modes: list[str]
    compile: list[str]
    max_new_tokens: int
    target: str
    draft: str | None
    needs_draft: bool  # a mode asked drafts with --draft
    categories: list[str] | None
    prompts: list[Prompt]
    spec: SpecSettings


@dataclass
class _Models:
    """The target's format, chosen, and the models loaded for the modes asked."""

    choice: FormatChoice
    target: LoadedModel
    draft: LoadedModel | None
    uag_draft: LoadedModel | None


def _sources(args: argparse.Namespace) -> tuple[str, str | None, str | None]:
    """The target, the draft and the EAGLE head: as given, else the pair preset's (``--pair`` or the default)."""
    target, draft, eagle_head = args.target, args.draft, args.eagle_head
    if args.pair or not target:
        preset = get_preset(args.pair or default_preset_key())
        target = target or preset.target
        draft = draft or preset.draft
        eagle_head = eagle_head or preset_eagle_head(preset, target)
    return target, draft, eagle_head


def _spec_settings(
    args: argparse.Namespace, draft_length: tuple[str, int | None], eagle_head: str | None
) -> SpecSettings:
    """The drafting settings every speculative mode shares (each run sets its own mode), validated."""
    schedule, num_draft_tokens = draft_length
    spec = SpecSettings(
        mode="draft",
        num_draft_tokens_schedule=schedule,
        num_draft_tokens=num_draft_tokens,
        max_num_draft_tokens=args.max_num_draft_tokens,
        draft_head_tokens=args.draft_head_tokens,
        draft_int8={"auto": None, "on": True, "off": False}[args.draft_int8],
        ngram_min=args.ngram_min,
        ngram_prefer=args.ngram_prefer,
        ngram_max=args.ngram_max,
        medusa_heads=args.medusa_heads,
        eagle_head=eagle_head,
        eagle_lookup=args.eagle_lookup == "on",
        suffix_factor=args.suffix_factor,
        suffix_min_token_prob=args.suffix_min_token_prob,
        suffix_lookup=args.suffix_lookup == "on",
    )
    spec.validate()
    return spec


def _read_request(args: argparse.Namespace) -> _Request:
    """The arguments through the session's parsers (the values and limits of the app and the recorder)."""
    compile_choices = _parse_compile(args.compile)
    modes = _variant_modes(_parse_modes(args.modes), compile_choices)
    max_new_tokens = _parsed("--max-new-tokens", parse_max_new_tokens, args.max_new_tokens)
    draft_length = _draft_length(args)
    if args.warmup < 0 or args.repeats < 1:
        raise InputError("--warmup must be >= 0 and --repeats >= 1")
    if not 1 <= args.passes <= 4:
        raise InputError(f"--passes must be from 1 to 4, got {args.passes}")
    for option, path in (("--json", args.json), ("--plot", args.plot)):
        if path is not None and not path.parent.is_dir():  # before the models load, not after the run
            raise InputError(f"{option}: no folder {path.parent}")
    target, draft, eagle_head = _sources(args)
    needs_draft = any(needs_draft_model(m) and not (drafts_with_other_tokenizer(m) and args.uag_draft) for m in modes)
    categories = [c.strip() for c in args.categories.split(",")] if args.categories else None
    prompts = load_prompts(args.prompts, categories=categories, limit=args.limit, per_category=args.per_category)
    spec = _spec_settings(args, draft_length, eagle_head)
    SamplingSettings(args.temperature, args.top_k, args.top_p, args.seed).validate()
    return _Request(modes, compile_choices, max_new_tokens, target, draft, needs_draft, categories, prompts, spec)


#: the step of loading the draft with another tokenizer
LOADING_UAG_DRAFT = "loading the uag draft"


def _load_models(args: argparse.Namespace, request: _Request) -> _Models:
    """Choose the target's format (printed), load the models the modes need, and refuse a misfit pair; one progress
    line with named steps and the seconds left (unless ``--quiet``)."""
    target_settings = LoadSettings(dtype=args.dtype, device=args.device, quantization=QUANTIZATIONS[args.quantization])
    measuring = args.calibration != "off" and measures_formats(request.target, target_settings)
    draft_load = LoadSettings(dtype=draft_dtype(args.dtype), device=args.device)  # the storage is the same
    drafts = [(LOADING_DRAFT, request.draft, draft_load)] if request.needs_draft and request.draft else []
    if args.uag_draft and any(drafts_with_other_tokenizer(m) for m in request.modes):
        drafts.append((LOADING_UAG_DRAFT, args.uag_draft, draft_load))
    with tqdm(total=100, desc="loading", unit="%", disable=args.quiet, leave=False) as bar:

        def report(fraction: float, message: str) -> None:
            bar.set_description_str(message[:90])
            bar.update(max(0, round(100 * fraction) - bar.n))

        steps = StepProgress(report, loading_steps(request.target, target_settings, drafts, measuring))
        if args.calibration == "off":
            choice = FormatChoice(resolve_format(args.dtype, resolve_device(args.device)), "without calibration")
        else:
            if measuring:
                steps.start(MEASURING_FORMATS, "on a few layers of the real weights (once per machine)")
            choice = choose_format(request.target, target_settings, refresh=args.calibration == "refresh",
                                   measure_candidates=quick_curves)
        target_settings = replace(target_settings, dtype=choice.format)
        load = LoadSettings(dtype=draft_dtype(choice.format), device=args.device)
        steps.start(LOADING_TARGET, request.target)
        target = load_model(request.target, target_settings, progress=False, on_progress=steps.within)
        loaded = {}
        for name, source, _ in drafts:
            steps.start(name, source)
            loaded[name] = load_model(source, load, progress=False, on_progress=steps.within)
        steps.finish()
    print(choice.summary(), flush=True)
    draft, uag_draft = loaded.get(LOADING_DRAFT), loaded.get(LOADING_UAG_DRAFT)
    for mode in dict.fromkeys(split_mode(m)[0] for m in request.modes):  # a misfit pair: one line before any run
        if mode in METHODS:
            check_pair(replace(request.spec, mode=mode), target, mode_draft(mode, draft, uag_draft))
    return _Models(choice, target, draft, uag_draft)


def _bench_config(args: argparse.Namespace, request: _Request, target: LoadedModel) -> BenchConfig:
    """The settings the report records."""
    spec = request.spec
    return BenchConfig(
        target=request.target,
        draft=request.draft if request.needs_draft else None,
        uag_draft=args.uag_draft,
        modes=request.modes,
        prompts=str(args.prompts or "bundled"),
        max_new_tokens=request.max_new_tokens,
        num_draft_tokens_schedule=spec.num_draft_tokens_schedule,
        num_draft_tokens=spec.num_draft_tokens,
        max_num_draft_tokens=spec.max_num_draft_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        dtype=target.format,
        device=str(target.device),
        warmup=args.warmup,
        repeats=args.repeats,
        chat=not args.raw,
        hf_lookup_tokens=args.hf_lookup_tokens,
        limit=args.limit,
        per_category=args.per_category,
        categories=request.categories,
        suffix_memory=args.suffix_memory == "on",
        passes=args.passes,
        compile=request.compile,
        draft_settings={
            k: v for k, v in asdict(spec).items()
            if k not in ("mode", "num_draft_tokens_schedule", "num_draft_tokens", "max_num_draft_tokens")
        },
    )


def _calibrate(calibration: str, request: _Request, models: _Models) -> CostCurve | None:
    """The machine's cost curve (printed), None with ``--calibration off``."""
    if calibration == "off":
        return None
    # the session's calibration call: the draft's step as the first mode that drafts with it runs it
    draft = models.draft
    drafting = next((m for m in (split_mode(n)[0] for n in request.modes) if m in METHODS and mode_draft(m, draft, models.uag_draft) is draft
                     and METHODS[m].needs_draft_model), "draft")
    curve = calibrate_pair(models.target, draft, replace(request.spec, mode=drafting), refresh=calibration == "refresh")
    print(curve.summary(), flush=True)
    return curve


def _complete_report(report: dict, curve: CostCurve | None, request: _Request, models: _Models) -> None:
    """Add the cost curve, the format choice and the methods to the report; warn when the cached curve is stale."""
    report["calibration"] = curve.as_dict() if curve is not None else None
    report["format"] = models.choice.as_dict()
    report["methods"] = describe_methods(request.spec, models.target,
                                         list(dict.fromkeys(split_mode(m)[0] for m in request.modes)))
    # the cost curve times eager passes: only an eager plain run can say it is stale
    eager = [variant for variant, record in report["compile"].items() if record["compile_mode"] is None]
    steps = plain_step_seconds(report["results"], with_variant("plain", eager[0])) if eager else None
    report["calibration_stale"] = refresh_if_stale(curve, steps, models.choice)
    if report["calibration_stale"]:
        print(f"warning: the cached cost curve is stale ({report['calibration_stale']}); it is measured again "
              "at the next run", file=sys.stderr)


def _open_checkpoint(json_path: Path | None, config: BenchConfig, request: _Request,
                     target: LoadedModel) -> BenchCheckpoint | None:
    """The run kept for ``json_path`` (resumed when it is this command's on this machine), None without a JSON."""
    if json_path is None:
        return None
    prompts = [(p.id, p.category, p.text) for p in request.prompts]
    return BenchCheckpoint.open(json_path, run_key(asdict(config), prompts, detect_hardware(target.device)))


def _interrupted(checkpoint: BenchCheckpoint | None) -> str:
    """The line a stopped bench prints: what it kept for the same command to resume."""
    if checkpoint is not None and checkpoint.done:
        return (f"interrupted: {len(checkpoint.done)} prompts finished are kept in {checkpoint.path}; the same "
                "command resumes")
    return "interrupted: nothing written"


def _write(report: dict, json_path: Path | None, plot_path: Path | None) -> None:
    """Print the table and the verify costs; write the JSON and the chart where asked."""
    print(format_table(report["summary"], report["by_category"]))
    if report.get("by_pass"):
        print(format_table(report["summary"], report["by_pass"]))
    if report.get("suffix_memory"):
        memory = report["suffix_memory"]
        print(f"suffix memory at the end: {memory['answers']} answers, {memory['tokens']} tokens")
    verify_costs = format_verify_costs(report["summary"], report.get("calibration"))
    if verify_costs:
        print(verify_costs)
    if json_path:
        write_json_atomic(json_path, report, indent=1)
        print(f"wrote {json_path}")
    if plot_path:
        plot(report["summary"], report["by_category"], plot_path)
        print(f"wrote {plot_path}")


def main(argv: Sequence[str] | None = None) -> int:
    """Read the arguments, load the models, calibrate, run the benchmark, and print and write its report."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.quiet:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    checkpoint = None
    try:
        request = _read_request(args)
        models = _load_models(args, request)
        config = _bench_config(args, request, models.target)
        checkpoint = _open_checkpoint(args.json, config, request, models.target)
        curve = _calibrate(args.calibration, request, models)
        variants = {(choice if len(request.compile) > 1 else ""):
                    choose_passes(choice, models.target, measure=args.calibration != "off")
                    for choice in request.compile}
        report = run_benchmark(config, models.target, models.draft, request.prompts, request.spec,
                               progress=not args.quiet, uag_draft=models.uag_draft, calibration=curve,
                               variants=variants, checkpoint=checkpoint)
        _complete_report(report, curve, request, models)
    except (InputError, PromptFileError, ModelLoadError, OfflinePackError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(_interrupted(checkpoint), file=sys.stderr)
        return 130
    _write(report, args.json, args.plot)
    if checkpoint is not None:
        checkpoint.discard()
    return 0


if __name__ == "__main__":
    sys.exit(main())
