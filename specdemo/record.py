"""``python -m specdemo.record``: race headless and write the race as MP4, GIF, HTML replay and/or JSON log.

The race is the session's own (:class:`specdemo.session.racer.Racer`: the app's validation, loading, warm-up, fair
interleaving and divergence check), taking the bench's and the app's settings under the same names. ``--from FILE``
re-renders a saved log (``--json``, the app's download, or a saved ``/race`` response) instead of racing: that path
imports neither torch nor Gradio (the racing parts are imported only to race). Every file is written under a
temporary name and renamed when complete (:mod:`specdemo.render.recording`), so a failure leaves no half-written
file behind.
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from tqdm.auto import tqdm

from .core.errors import InputError, first_line
from .core.settings import COMPILE_CHOICES
from .render.recording import FORMATS, write_recording
from .render.video import VideoSettings
from .session.racelog import RaceLog, RaceLogError, load

logger = logging.getLogger(__name__)

#: options that only make sense when racing (refused with --from)
RACE_OPTIONS = ("prompt", "prompt_file", "pair", "target", "draft")


@dataclass
class RecordRequest:
    """What to race (or re-render) and which files to write."""

    outputs: dict[str, Path]  # format -> file
    speed: float = 1.0
    source: Path | None = None  # --from: a saved log instead of a race


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m specdemo.record",
        description="Race plain against speculative decoding (as the app does) and record the race as an MP4, a "
        "GIF, a self-contained HTML replay and/or a JSON log.",
    )
    outputs = parser.add_argument_group("what to write (at least one)")
    outputs.add_argument("--mp4", type=Path, metavar="FILE", help="H.264 video, 1280x720, 30 fps, final card held 2 s")
    outputs.add_argument("--gif", type=Path, metavar="FILE", help="animated GIF, 640x360, 10 fps")
    outputs.add_argument("--html", type=Path, metavar="FILE", help="self-contained HTML replay (play, speed, scrubber)")
    outputs.add_argument("--json", type=Path, metavar="FILE", help="the race log (re-render it later with --from)")
    outputs.add_argument("--speed", type=float, default=1.0, metavar="X",
                         help="video pace: race seconds per video second (default 1: true timing; 2 compresses a "
                         "long race to half)")
    outputs.add_argument("--from", dest="source", type=Path, metavar="FILE",
                         help="re-render a saved race log or /race response instead of racing")
    race = parser.add_argument_group("the race (as in the app and the bench)")
    race.add_argument("--prompt", metavar="TEXT", help="the prompt text")
    race.add_argument("--prompt-file", type=Path, metavar="FILE", help="read the prompt from this text file")
    race.add_argument("--pair", metavar="KEY", help="pair preset (default: the offline pair if installed)")
    race.add_argument("--target", help="target model: offline:NAME, Hub id, local folder or .gguf file")
    race.add_argument("--draft", help="draft model (same sources as --target)")
    race.add_argument(
        "--mode", default="draft",
        help="speculative mode: draft, ngram, suffix, uag, medusa, medusa-chain, eagle or eagle-chain (default draft)",
    )
    race.add_argument("--medusa-heads", help="Medusa heads folder (default: the offline target's shipped heads)")
    race.add_argument("--eagle-head", help="EAGLE-3 head, a folder or Hub id (default: the target's shipped head, or "
                      "the pair preset's)")
    race.add_argument("--num-draft-tokens-schedule", metavar="{fixed,adaptive,heuristic}",
                      help="how many tokens each round drafts: fixed (--num-draft-tokens every round), adaptive "
                      "(cost-aware; the default) or heuristic (+2/-1)")
    race.add_argument("--num-draft-tokens", metavar="K",
                      help="fixed: the tokens drafted every round; adaptive, heuristic: the first round's. Given "
                      "without --num-draft-tokens-schedule, the schedule is fixed")
    race.add_argument("--max-new-tokens", type=int, default=128, metavar="N")
    race.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    race.add_argument("--top-p", type=float, default=1.0)
    race.add_argument("--seed", type=int, default=0)
    race.add_argument(
        "--dtype", default="auto",
        help="the target's format, as in the app and the bench: auto (on a CPU, measured), bfloat16, float16, "
        "float32, int8 or w8a8",
    )
    race.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N, mps")
    race.add_argument(
        "--compile", choices=list(COMPILE_CHOICES), default="auto",
        help="how the target's passes run, as in the app and the bench: auto (compiled on a GPU, eager on a CPU), on "
        "(a static cache and torch.compile, compiled before the race) or off",
    )
    race.add_argument("--raw", action="store_true", help="send the prompt as raw text, without the chat template")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    return parser


def _request(args: argparse.Namespace) -> RecordRequest:
    """Check the options that need no model; InputError-like ValueError with one line otherwise."""
    outputs = {kind: getattr(args, kind) for kind in FORMATS if getattr(args, kind) is not None}
    if not outputs:
        raise ValueError("nothing to write: give at least one of --mp4, --gif, --html, --json")
    for kind, path in outputs.items():
        folder = path.parent if str(path.parent) else Path(".")
        if not folder.is_dir():
            raise ValueError(f"--{kind} {path}: the folder {folder} does not exist")
        if path.is_dir():
            raise ValueError(f"--{kind} {path} is a folder: give a file name")
    if len(set(outputs.values())) < len(outputs):
        raise ValueError("two outputs name the same file")
    VideoSettings(speed=args.speed).validate()
    if args.source is not None:
        given = [f"--{name.replace('_', '-')}" for name in RACE_OPTIONS if getattr(args, name) is not None]
        if given:
            raise ValueError(f"--from re-renders a saved race: drop {', '.join(given)}")
    elif args.prompt is not None and args.prompt_file is not None:
        raise ValueError("give --prompt or --prompt-file, not both")
    elif args.prompt is None and args.prompt_file is None:
        raise ValueError("nothing to race: give --prompt TEXT or --prompt-file FILE (or --from a saved race)")
    return RecordRequest(outputs, args.speed, args.source)


def race_log(args: argparse.Namespace, show_progress: bool) -> RaceLog:
    """Race as the app does (validation, loading, warm-up, calibration, fair interleaving, divergence check); the
    log. Model-loading errors come back as one-line InputErrors."""
    # here, not at the top: re-rendering a saved log (--from) loads no model, so it needs neither torch nor Gradio
    from .backends.loading import ModelLoadError
    from .backends.offline import OfflinePackError
    from .session.config import SessionConfig
    from .session.racer import Racer
    from .session.request import RaceRequest

    if not show_progress:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    if args.prompt_file is not None:
        try:
            prompt = args.prompt_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise InputError(f"cannot read the prompt file {args.prompt_file}: {error}") from None
    else:
        prompt = args.prompt
    config = SessionConfig(
        pair=args.pair, device=args.device, dtype=args.dtype, max_new_tokens_limit=32768,
        medusa_heads=args.medusa_heads, eagle_head=args.eagle_head, compile=args.compile,
    )
    racer = Racer(config)
    request = RaceRequest(
        prompt,
        args.pair,
        args.target or "",
        args.draft or "",
        args.mode,
        args.num_draft_tokens_schedule,
        args.num_draft_tokens,
        args.max_new_tokens,
        args.temperature,
        args.top_p,
        args.seed,
        args.dtype,
        "none",
        not args.raw,
    )
    try:
        with tqdm(total=100, desc="loading", unit="%", disable=not show_progress, leave=False) as bar:

            def report(fraction: float, message: str) -> None:
                bar.set_description_str(message[:90])
                bar.update(max(0, round(100 * fraction) - bar.n))

            prepared = racer.prepare(request, report)
        for warning in prepared.warnings:
            logger.warning("%s", warning)
        state = None
        total = 2 * prepared.settings.max_new_tokens
        with tqdm(total=total, desc="racing", unit="tok", disable=not show_progress) as bar:
            for state in racer.run(prepared):
                bar.update(state.plain.counters.new_tokens + state.spec.counters.new_tokens - bar.n)
    except (ModelLoadError, OfflinePackError) as error:
        raise InputError(first_line(error)) from None
    assert state is not None
    return state.log()


def write_all(log: RaceLog, request: RecordRequest, show_progress: bool) -> None:
    for kind in FORMATS:
        path = request.outputs.get(kind)
        if path is None:
            continue
        with tqdm(desc=kind, unit="frame", disable=not show_progress or kind in ("json", "html")) as bar:

            def on_frame(done: int, total: int) -> None:
                bar.total = total
                bar.update(done - bar.n)

            write_recording(log, kind, path, request.speed, on_frame)
        print(f"wrote {path} ({path.stat().st_size / 1e6:.2f} MB)")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    show_progress = not args.quiet
    try:
        request = _request(args)
        log = load(request.source) if request.source is not None else race_log(args, show_progress)
        write_all(log, request, show_progress)
    except (InputError, RaceLogError, ValueError, OSError, RuntimeError) as error:
        print(f"error: {first_line(error)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: no partial file left behind", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
