"""Where a w8a8 pass spends its time: the integer kernels alone, and the real target's pass by part.

Not a test (nothing is asserted): a probe for a quiet machine, alone on the cores, whose figures go to
``docs/number-formats.md``.

    python tests/w8a8_pass_probe.py kernels            # every linear shape of the offline 1.5B target, 28 copies
    python tests/w8a8_pass_probe.py kernels --shape down --rows 2,8,16,17,24,32
    python tests/w8a8_pass_probe.py pass --kernel onednn   # needs the offline pack

``kernels`` times each integer kernel over int8 weights of the target's shapes (query/key/value stacked, output,
gate/up stacked, down, LM head; random values, each shape's copies in turn so that nothing stays in cache) through
the layer's own ``_integer_sums``, the rounded activation rows made before the clock starts, medians of 7. Rows
are per call: the two-part layers (down, head) take twice a pass's tokens. ``pass`` loads the offline target in w8a8 with the named kernel and times passes over k tokens
after 128 cached ones, with the w8a8 layers' calls, their integer kernels and the attention timed apart.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time
from collections.abc import Callable

import torch

from specdemo.backends import formats

#: the offline target's linear layers as (in, out, copies): Qwen2.5-Coder-1.5B, inputs shared as w8a8 shares them
SHAPES = {
    "qkv": (1536, 2048, 28), "o": (1536, 1536, 28), "gate/up": (1536, 17920, 28), "down": (8960, 1536, 28),
    "head": (1536, 151936, 1),
}
KERNELS = (formats.FBGEMM, formats.ONEDNN, "int_mm")


def _median_ms(run: Callable[[], object], repeats: int = 7) -> float:
    run()
    timings = []
    for _ in range(repeats):
        begin = time.perf_counter()
        run()
        timings.append(time.perf_counter() - begin)
    return statistics.median(timings) * 1000


def _layer(weight: torch.Tensor, kernel: str) -> formats.W8A8Linear:
    """The w8a8 layer over ``weight`` (int8 values) that multiplies with ``kernel`` at every row count."""
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = torch.nn.Parameter(weight.float(), requires_grad=False)
    return formats.W8A8Linear(linear, kernel=kernel)


def _kernel_calls(kernel: str, weights: list[torch.Tensor], rows: int) -> Callable[[], None]:
    """One call per weight of ``rows`` activation rows: the integer sums :class:`formats.W8A8Linear` asks its
    kernel for, or ``torch._int_mm``'s."""
    in_features = weights[0].shape[1]
    steps = torch.randint(-formats.W8A8_STEPS, formats.W8A8_STEPS + 1, (rows, in_features)).float()
    if kernel in formats.W8A8_KERNELS:
        layers = [_layer(weight, kernel) for weight in weights]

        def run() -> None:
            for layer in layers:
                layer._integer_sums(steps)
        return run
    transposed = [weight.t() for weight in weights]
    padded = torch.zeros(max(rows, 17), in_features, dtype=torch.int8)  # torch._int_mm wants over 16 rows
    padded[:rows] = steps.to(torch.int8)

    def run_int_mm() -> None:
        for one in transposed:
            torch._int_mm(padded, one)
    return run_int_mm


def probe_kernels(names: list[str], row_counts: list[int], kernels: list[str]) -> None:
    torch.manual_seed(0)
    for kernel in kernels:
        totals = collections.Counter()
        for name in names:
            in_features, out_features, copies = SHAPES[name]
            weights = [torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8) for _ in range(copies)]
            costs = {rows: _median_ms(_kernel_calls(kernel, weights, rows)) for rows in row_counts}
            totals.update(costs)
            rate = copies * in_features * out_features / costs[row_counts[0]] / 1e6
            print(f"{kernel:7s} {name:8s} {row_counts[0]} row(s) {costs[row_counts[0]]:6.1f} ms ({rate:4.0f} GB/s); "
                  + " ".join(f"{rows}: {costs[rows] / costs[row_counts[0]]:.2f}" for rows in row_counts[1:]),
                  flush=True)
        print(f"{kernel:7s} all      " + " ".join(f"{rows}: {totals[rows]:.1f} ms" for rows in row_counts), flush=True)


def _timed(spent: dict[str, float], key: Callable[..., str], function: Callable) -> Callable:
    def wrapper(self_or_first, *args, **kwargs):
        begin = time.perf_counter()
        result = function(self_or_first, *args, **kwargs)
        spent[key(self_or_first)] += time.perf_counter() - begin
        return result
    return wrapper


def probe_pass(kernel: str, token_counts: list[int], repeats: int = 6) -> None:
    from transformers import AttentionInterface

    from specdemo.backends.loading import LoadSettings, load_model
    from specdemo.backends.transformers_lm import CachedLM

    model = load_model("offline:qwen2.5-coder-1.5b", LoadSettings(dtype="bfloat16"), progress=False).model
    formats.to_int8_format(model, formats.W8A8, kernel=kernel)
    spent: dict[str, float] = collections.defaultdict(float)
    layer = formats.W8A8Linear
    layer.forward = _timed(spent, lambda self: "layers", layer.forward)
    layer._integer_sums = _timed(spent, lambda self: "kernels, two-part" if self.two_parts else "kernels, one-part",
                                 layer._integer_sums)
    mapping = AttentionInterface._global_mapping
    mapping[formats.ROW_WISE_ATTENTION] = _timed(spent, lambda _: "attention", mapping[formats.ROW_WISE_ATTENTION])
    generator = torch.Generator().manual_seed(0)
    lm = CachedLM(model)
    lm.reset()
    vocab_size = formats.output_rows(model)
    lm.forward(torch.randint(0, vocab_size, (128,), generator=generator), all_logits=False)
    for tokens in token_counts:
        parts: dict[str, list[float]] = collections.defaultdict(list)
        for repeat in range(repeats + 1):
            spent.clear()
            ids = torch.randint(0, vocab_size, (tokens,), generator=generator)
            begin = time.perf_counter()
            lm.forward(ids, all_logits=True)
            seconds = time.perf_counter() - begin
            lm.rollback(tokens)
            if repeat:  # the first pass of each size warms up
                parts["pass"].append(seconds)
                for name, value in spent.items():
                    parts[name].append(value)
        ms = {name: statistics.median(values) * 1000 for name, values in parts.items()}
        kernels = ms.get("kernels, one-part", 0.0) + ms.get("kernels, two-part", 0.0)
        ms["activation steps"] = ms["layers"] - kernels
        ms["the rest"] = ms["pass"] - ms["layers"] - ms.get("attention", 0.0)
        del ms["layers"]
        print(f"{tokens:2d} token(s): " + ", ".join(f"{name} {value:.1f}" for name, value in ms.items()), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=("kernels", "pass"))
    parser.add_argument("--shape", default=",".join(SHAPES), help=f"kernels: comma list of {', '.join(SHAPES)}")
    parser.add_argument("--rows", default="1,2,4,8,16,32", help="kernels: rows per call")
    parser.add_argument("--kernels", default=",".join(KERNELS), help=f"kernels: comma list of {', '.join(KERNELS)}")
    parser.add_argument("--kernel", default=None, help=f"pass: one of {', '.join(formats.W8A8_KERNELS)}")
    parser.add_argument("--tokens", default="1,2,4,8,16", help="pass: tokens per pass")
    args = parser.parse_args()
    if args.what == "kernels":
        probe_kernels(args.shape.split(","), [int(rows) for rows in args.rows.split(",")], args.kernels.split(","))
    else:
        probe_pass(args.kernel or formats.w8a8_kernel(), [int(tokens) for tokens in args.tokens.split(",")])


if __name__ == "__main__":
    main()
