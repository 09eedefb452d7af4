"""``python app.py``: the speculative decoding race in the browser (Gradio). The page lives in ``specdemo/app/``."""

from specdemo.app import spaces as spaces_compat  # noqa: I001  # first: ZeroGPU needs `import spaces` before CUDA is touched

import argparse
import logging
import os
import sys
from typing import Sequence

from specdemo.core.settings import COMPILE_CHOICES
from specdemo.session.presets import PRESETS
from specdemo.session.request import DTYPES


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text}")
    return value


def env_number(name: str, kind: type, default: float | None = None) -> float | None:
    """A number from the environment variable ``name`` (``kind`` is int or float), else ``default``."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = kind(text)
    except ValueError:
        raise SystemExit(f"{name} must be a number, got {text!r}") from None
    if value <= 0:
        raise SystemExit(f"{name} must be more than 0, got {text!r}")
    return value


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def is_hosted(host: str, share: bool) -> bool:
    """Strangers can reach the app: on a Hugging Face Space, with a public share link, or bound beyond loopback."""
    return spaces_compat.ON_SPACES or share or host.strip().lower() not in LOOPBACK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Speculative decoding race: plain vs speculative, side by side.")
    parser.add_argument(
        "--host",
        default=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"),
        help="address to bind (default 127.0.0.1; 0.0.0.0 to serve your network)",
    )
    port = os.environ.get("GRADIO_SERVER_PORT")
    parser.add_argument("--port", type=int, default=int(port) if port else None, help="port (default: 7860 or next free)")
    parser.add_argument("--share", action="store_true", help="also make a public gradio.live link")
    parser.add_argument("--pair", choices=list(PRESETS), help="default pair preset (default: offline pair if installed)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps")
    parser.add_argument(
        "--dtype", default="auto", choices=list(DTYPES),
        help="the target's format, as in the bench (the app's dropdown starts there); auto: on a CPU, the fastest "
        "measured",
    )
    parser.add_argument(
        "--compile", choices=list(COMPILE_CHOICES), default="auto",
        help="how the target's passes run, as in the bench: auto (compiled on a GPU, eager on a CPU and on ZeroGPU), "
        "on (a static cache and torch.compile, compiled before a pair and mode's first race) or off",
    )
    custom = os.environ.get("SPECDEMO_CUSTOM_MODELS", "").strip()
    custom_models = parser.add_mutually_exclusive_group()
    custom_models.add_argument(
        "--custom-models",
        dest="custom_models",
        action="store_const",
        const=True,
        default=None if not custom else custom != "0",
        help="offer the custom target/draft boxes (or SPECDEMO_CUSTOM_MODELS=1). Default: on when served on "
        "loopback only, off on a Space, with --share or bound beyond loopback; when on there, custom models are Hub "
        "ids only (or folders under --model-root), downloads capped by --max-download-gb",
    )
    custom_models.add_argument(
        "--no-custom-models", dest="custom_models", action="store_const", const=False,
        help="presets only (or SPECDEMO_CUSTOM_MODELS=0)",
    )
    roots = [root for root in os.environ.get("SPECDEMO_MODEL_ROOTS", "").split(os.pathsep) if root.strip()]
    parser.add_argument(
        "--model-root", action="append", default=roots, metavar="DIR",
        help="a folder whose models (folders, .gguf files) a hosted app's visitors may name; repeatable (or "
        "SPECDEMO_MODEL_ROOTS, separated by %r)" % os.pathsep,
    )
    parser.add_argument(
        "--max-download-gb", type=positive_float, default=env_number("SPECDEMO_MAX_DOWNLOAD_GB", float, 16.0),
        help="the largest Hub model a hosted app's visitor may have downloaded (default 16; or "
        "SPECDEMO_MAX_DOWNLOAD_GB)",
    )
    parser.add_argument(
        "--preload",
        action="store_true",
        default=spaces_compat.ZERO_GPU or spaces_compat.ON_SPACES,
        help="load the default pair before serving, with --dtype auto choosing its format and measuring its cost "
        "curve first (on by default on Spaces)",
    )
    parser.add_argument("--max-new-tokens-limit", type=int, default=2048, help="largest max new tokens allowed")
    parser.add_argument(
        "--max-prompt-tokens",
        type=positive_int,
        default=env_number("SPECDEMO_MAX_PROMPT_TOKENS", int),
        help="longest prompt accepted, in tokens (or set SPECDEMO_MAX_PROMPT_TOKENS; default 2048 on a CPU, 8192 "
        "on a GPU): a longer one is refused before any model work",
    )
    parser.add_argument(
        "--race-time-budget",
        type=positive_float,
        default=env_number("SPECDEMO_RACE_TIME_BUDGET", float, 300.0 if spaces_compat.ON_SPACES else None),
        help="seconds of wall clock a race may take before it stops with its figures so far (or set "
        "SPECDEMO_RACE_TIME_BUDGET; default: none, 300 on a Hugging Face Space)",
    )
    parser.add_argument(
        "--medusa-heads",
        help="folder of Medusa heads for the medusa modes (default: the heads shipped for the offline target; "
        "FasterDecoding's layout is accepted)",
    )
    parser.add_argument(
        "--eagle-head",
        help="EAGLE-3 head for the eagle modes: a folder (this project's, EAGLE-3's or speculators' layout) or a Hub "
        "id (default: the head shipped for the offline target, or the pair preset's)",
    )
    parser.add_argument("--verbose", action="store_true", help="debug logging")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    for noisy in ("httpx", "httpcore", "urllib3", "matplotlib"):
        logging.getLogger(noisy).setLevel(logging.WARNING)

    from specdemo.app.config import AppConfig
    from specdemo.app.ui import build_app, launch, preload

    hosted = is_hosted(args.host, args.share)
    config = AppConfig(
        pair=args.pair,
        device=args.device,
        dtype=args.dtype,
        custom_models=(not hosted) if args.custom_models is None else args.custom_models,
        hosted=hosted,
        model_roots=tuple(args.model_root),
        max_download_gb=args.max_download_gb,
        max_new_tokens_limit=args.max_new_tokens_limit,
        max_prompt_tokens=args.max_prompt_tokens,
        race_time_budget=args.race_time_budget,
        medusa_heads=args.medusa_heads,
        eagle_head=args.eagle_head,
        compile=args.compile,
        zero_gpu=spaces_compat.ZERO_GPU,
    )
    demo = build_app(config)
    if args.preload:
        preload(demo)
    launch(demo, server_name=args.host, server_port=args.port, share=args.share)
    return 0


if __name__ == "__main__":
    sys.exit(main())
