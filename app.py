"""``python app.py``: the speculative decoding race in the browser (Gradio). The UI lives in ``specdemo/ui.py``."""

from specdemo import spaces_compat  # noqa: I001  # first: ZeroGPU needs `import spaces` before CUDA is touched

import argparse
import logging
import os
import sys
from typing import Sequence

from specdemo.presets import PRESETS


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
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    parser.add_argument(
        "--no-custom-models",
        dest="custom_models",
        action="store_false",
        default=os.environ.get("SPECDEMO_CUSTOM_MODELS", "1").strip() != "0",
        help="hide the custom target/draft boxes (for hosted use; or set SPECDEMO_CUSTOM_MODELS=0, e.g. on a "
        "Space): only the presets can be raced",
    )
    parser.add_argument(
        "--preload",
        action="store_true",
        default=spaces_compat.ZERO_GPU,
        help="load the default pair before serving (on by default on ZeroGPU Spaces)",
    )
    parser.add_argument("--max-new-tokens-limit", type=int, default=2048, help="largest max new tokens allowed")
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

    from specdemo.ui import AppConfig, build_app, launch, preload

    config = AppConfig(
        pair=args.pair,
        device=args.device,
        dtype=args.dtype,
        custom_models=args.custom_models,
        max_new_tokens_limit=args.max_new_tokens_limit,
    )
    demo = build_app(config)
    if args.preload:
        preload(demo)
    launch(demo, server_name=args.host, server_port=args.port, share=args.share)
    return 0


if __name__ == "__main__":
    sys.exit(main())
