"""A report for a machine with a CUDA GPU (not a test: CI has none, and nothing depends on one).

1. Exactness on the GPU: tiny random Llama and Qwen2 targets on CUDA, float32 and bfloat16; every drafter (a small
   draft model, n-gram lookup, Medusa heads as a tree, an EAGLE-3 head as a chain, a tree and a tree with prompt
   lookup's branch) at several draft lengths, each output compared token for token with the target alone (plain
   decoding, and transformers' ``generate`` for float32). In float32 every output must be identical; in bfloat16 a
   parting is reported with its position and the target's top-1 minus top-2 logit margin there.
2. The cost curve of a target pass on the GPU: a Qwen2.5-1.5B-shaped model (random weights, bfloat16) after a
   300-token prompt, a pass over k tokens against a one-token pass, medians of CUDA-event timings.
3. The baseline's speed on the GPU: the same model, 128 new tokens after the 300-token prompt, this project's plain
   decoding against transformers' ``generate`` (greedy, no EOS), medians of repeats, both outputs compared.
4. Compiled passes (``--compile on``: a static cache and ``torch.compile``, CUDA graphs on a GPU): part 1's runs
   again with the target, the draft model and the EAGLE head compiled, against eager plain decoding; then on the
   1.5B shape the seconds compiling took, the cost curve of compiled passes beside eager ones, plain decoding
   compiled against eager, ``generate`` and ``generate`` on a static cache compiled by itself (the bench's
   ``hf-static``), a Qwen2.5-0.5B-shaped draft's one-token pass eager and compiled (what a draft step could cost)
   and an EAGLE head's 4-row tree step eager and compiled.

    python tests/gpu_check.py [--device cuda] [--json FILE] [--quick] [--skip-exactness] [--skip-compiled]

``--device cpu`` runs parts 1 and 4's exactness on the CPU (inductor; to check the script itself); the timings need
CUDA.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from test_eagle import random_head  # noqa: E402
from test_medusa import random_heads  # noqa: E402
from tiny import VOCAB, llama, qwen2, reference_greedy  # noqa: E402

from specdemo.backends.eagle3_head import EagleConfig, EagleHead, HeadKVCache  # noqa: E402
from specdemo.backends.eagle3_static import StaticHeadCache  # noqa: E402
from specdemo.backends.loading import LoadedModel, LoadSettings  # noqa: E402
from specdemo.backends.passes import EAGER, Passes  # noqa: E402
from specdemo.backends.static_lm import PASS_SIZES, StaticLM  # noqa: E402
from specdemo.backends.transformers_lm import CachedLM  # noqa: E402
from specdemo.core.loop import collect, plain_decode, speculative_decode  # noqa: E402
from specdemo.core.settings import GenerationSettings, SamplingSettings  # noqa: E402
from specdemo.methods.draft_length import FixedDraftLength  # noqa: E402
from specdemo.methods.draft_model import DraftModelDrafter  # noqa: E402
from specdemo.methods.eagle import EagleDrafter  # noqa: E402
from specdemo.methods.medusa import MedusaDrafter  # noqa: E402
from specdemo.methods.ngram import LookupBranch, NgramDrafter  # noqa: E402
from specdemo.session.racer import compare_outputs  # noqa: E402
from specdemo.session.stock import static_generation  # noqa: E402

GREEDY = SamplingSettings()
PROMPTS = [[5, 7, 9, 11, 5, 7, 9, 3, 2, 1], [1], [40, 41, 42, 43, 44, 45, 40, 41, 42, 43, 44, 45, 40, 41]]


def _drafters(target, small, head, heads, passes: Passes = EAGER):
    """Each mode's drafter; ``passes``: how the draft model's passes and the EAGLE head's steps run (compiled with
    the target's in part 4)."""
    embed = target.get_input_embeddings()
    lm_head = target.get_output_embeddings().weight
    room = {"passes": passes, "max_new_tokens": 24}
    return {
        "draft": lambda: DraftModelDrafter(small, GREEDY, VOCAB, int8=False, **room),
        "ngram": lambda: NgramDrafter(1, 3),
        "medusa": lambda: MedusaDrafter(heads, lm_head, GREEDY, VOCAB, tree=True),
        "eagle-chain": lambda: EagleDrafter(head, embed, GREEDY, VOCAB, tree=False, **room),
        "eagle-tree": lambda: EagleDrafter(head, embed, GREEDY, VOCAB, tree=True, **room),
        "eagle": lambda: EagleDrafter(head, embed, GREEDY, VOCAB, tree=True, lookup=LookupBranch(), **room),
    }


def _divergence(model, prompt: list[int], reference: list[int], other: list[int]) -> dict | None:
    """Where ``other`` parts from ``reference`` and the target's top-1 minus top-2 logit there (the session's
    ``compare_outputs``, as the bench and the app report it); None when they are identical."""
    loaded = LoadedModel("gpu-check", model, None, model.device, model.dtype, LoadSettings(device=str(model.device)))
    position, margin = compare_outputs(loaded, prompt, reference, other, greedy=True)
    return None if position is None else {"position": position, "logit_margin": margin}


def _compile_mode(device: torch.device) -> str:
    return "reduce-overhead" if device.type == "cuda" else "default"


def exactness(device: torch.device, quick: bool, compiled: bool = False) -> list[dict]:
    """Part 1 (``compiled``: part 4's first half, every speculative run on compiled passes and plain decoding
    compiled too, each against eager plain decoding)."""
    rows = []
    mode_of = _compile_mode(device) if compiled else None
    lengths = (1, 4) if quick else (1, 3, 6)
    for dtype in (torch.float32, torch.bfloat16):
        for name, factory, small_factory in (("llama", lambda: llama(1), lambda: llama(2, layers=1)),
                                             ("qwen2", lambda: qwen2(3), lambda: qwen2(4, layers=1))):
            target = factory().to(device, dtype)
            small = small_factory().to(device, dtype)
            head = random_head(target, seed=4).to(device, dtype)
            heads = random_heads(target).to(device, dtype)
            settings = GenerationSettings(max_new_tokens=24)
            for prompt in PROMPTS:
                expected = collect(plain_decode(CachedLM(target), prompt, settings)).new_token_ids
                generated = reference_greedy(target.cpu().float(), prompt, 24) if dtype == torch.float32 else None
                target.to(device, dtype)

                def target_lm(role: str):
                    return StaticLM(target, len(prompt) + 24, mode_of, role) if compiled else CachedLM(target)

                if compiled:
                    ids = collect(plain_decode(target_lm("plain"), prompt, settings)).new_token_ids
                    rows.append({"dtype": str(dtype).removeprefix("torch."), "target": name, "prompt": len(prompt),
                                 "mode": "plain", "k": 0, "identical": ids == expected, "accepted": 0, "drafted": 0,
                                 **({"divergence": _divergence(target, prompt, expected, ids)}
                                    if ids != expected else {})})
                for mode, make in _drafters(target, small, head, heads, Passes(mode_of) if compiled else EAGER).items():
                    for k in lengths:
                        final = collect(speculative_decode(target_lm("spec"), make(), FixedDraftLength(k), prompt,
                                                           settings))
                        ids = final.new_token_ids
                        parted = _divergence(target, prompt, expected, ids)
                        row = {"dtype": str(dtype).removeprefix("torch."), "target": name, "prompt": len(prompt),
                               "mode": mode, "k": k, "identical": ids == expected,
                               "accepted": final.counters.accepted, "drafted": final.counters.drafted}
                        if generated is not None:
                            row["plain_equals_generate"] = expected == generated
                        if parted is not None:
                            row["divergence"] = parted
                        rows.append(row)
    return rows


def _qwen_shape(device: torch.device, draft: bool = False):
    """A Qwen2.5-1.5B-shaped model (``draft``: 0.5B-shaped), random weights, bfloat16."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if draft:
        config = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                             num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
                             max_position_embeddings=4096)
    else:
        config = Qwen2Config(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                             num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True,
                             max_position_embeddings=4096)
    torch.manual_seed(0)
    with torch.device(device):
        return Qwen2ForCausalLM(config).to(torch.bfloat16).eval()


def _pass_seconds(make_lm, prompt: torch.Tensor, k: int, repeats: int, device: torch.device) -> float:
    """The median seconds of a pass over ``k`` tokens after ``prompt`` (CUDA events), after 3 untimed ones."""
    times = []
    with torch.inference_mode():
        lm = make_lm()
        for repeat in range(repeats + 3):
            lm.reset()
            lm.run(prompt, all_logits=False, with_hidden=False)
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            lm.run(prompt[:k], with_hidden=False)
            end.record()
            torch.cuda.synchronize(device)
            if repeat >= 3:
                times.append(start.elapsed_time(end) / 1000)
    return sorted(times)[len(times) // 2]


def compiled_speed(device: torch.device, quick: bool) -> dict:
    """Part 4's timings: compiling, compiled passes beside eager ones, plain decoding and stock ``generate`` both
    ways, a draft-shaped model's step."""
    model = _qwen_shape(device)
    prompt = torch.randint(0, 151936, (300,), device=device)
    mode = _compile_mode(device)
    sizes = [1, 2, 5, 9, 17] if quick else list(PASS_SIZES)
    started = time.perf_counter()
    with torch.inference_mode():
        lm = StaticLM(model, 300 + 128, mode, "spec")
        for size in sizes:  # what the warm-up does (session.compiling.compile_graphs)
            lm.reset()
            lm.run(prompt[:1], all_logits=False, with_hidden=False)
            lm.run(prompt[:size], with_hidden=False)
    torch.cuda.synchronize(device)
    compile_seconds = time.perf_counter() - started
    repeats = 10 if quick else 30
    eager = {k: _pass_seconds(lambda: CachedLM(model), prompt, k, repeats, device) for k in sizes}
    compiled = {k: _pass_seconds(lambda: StaticLM(model, 300 + 128, mode, "spec"), prompt, k, repeats, device)
                for k in sizes}
    result = {
        "model": "Qwen2.5-1.5B shape, random weights, bfloat16, after 300 cached tokens",
        "compile_mode": mode, "compile_seconds": compile_seconds, "pass_sizes": sizes,
        "eager_ms": {str(k): v * 1000 for k, v in eager.items()},
        "compiled_ms": {str(k): v * 1000 for k, v in compiled.items()},
        "compiled_relative": {str(k): v / compiled[1] for k, v in compiled.items()},
    }
    result["decoding"] = _decoding_both_ways(model, prompt, mode, 3 if quick else 5)
    draft = _qwen_shape(device, draft=True)
    result["draft_0.5b_one_token_ms"] = {
        "eager": _pass_seconds(lambda: CachedLM(draft), prompt, 1, repeats, device) * 1000,
        "compiled": _pass_seconds(lambda: StaticLM(draft, 300 + 128, mode, "draft"), prompt, 1, repeats, device)
        * 1000,
    }
    result["eagle_head_4_row_step_ms"] = _head_step_ms(device, mode, repeats)
    return result


def _head_step_ms(device: torch.device, mode: str, repeats: int) -> dict:
    """An EAGLE-3 head for the 1.5B shape (random weights, bfloat16, a 32,000-token draft vocabulary): one tree
    step over 4 rows after 300 committed positions, its LM head included, eager and compiled (CUDA-event medians)."""
    config = EagleConfig(1536, 12, 2, 128, 8960, 151936, 32000, (2, 14, 25))
    torch.manual_seed(0)
    head = EagleHead(config).to(device, torch.bfloat16).eval()
    rows = torch.randn(300, 1536, device=device, dtype=torch.bfloat16)
    visible = torch.ones(4, 304, dtype=torch.bool, device=device)
    timings = {}
    for name, make in (("eager", HeadKVCache), ("compiled", lambda: StaticHeadCache(head, 300 + 128, mode))):
        cache, times = make(), []
        with torch.inference_mode():
            cache.step(head, rows, rows, torch.arange(300, device=device))
            for repeat in range(repeats + 3):
                cache.crop(300)
                torch.cuda.synchronize(device)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                cache.step(head, rows[:4], rows[:4], torch.full((4,), 300, device=device), visible)
                end.record()
                torch.cuda.synchronize(device)
                if repeat >= 3:
                    times.append(start.elapsed_time(end))
        timings[name] = sorted(times)[len(times) // 2]
    return timings


def _decoding_both_ways(model, prompt: torch.Tensor, mode: str, repeats: int) -> dict:
    """128 new tokens four ways: plain decoding eager and compiled, ``generate`` eager and on a static cache it
    compiles itself (the bench's hf-static); tokens/s medians and whether each wrote eager plain decoding's tokens."""
    from transformers import GenerationConfig

    settings = GenerationSettings(max_new_tokens=128, stop_on_eos=False)
    ids = prompt.tolist()

    def generate(static: bool) -> list[int]:
        config = GenerationConfig(do_sample=False, max_new_tokens=128, min_new_tokens=128, eos_token_id=None,
                                  pad_token_id=0)
        if static:
            static_generation(config, prompt.device, len(ids) + 128)
        with torch.inference_mode():
            out = model.generate(prompt.view(1, -1), attention_mask=torch.ones_like(prompt.view(1, -1)),
                                 generation_config=config)
        return out[0, len(ids):].tolist()

    ways = {
        "plain_eager": lambda: collect(plain_decode(CachedLM(model), ids, settings)).new_token_ids,
        "plain_compiled": lambda: collect(plain_decode(StaticLM(model, len(ids) + 128, mode, "plain"), ids,
                                                       settings)).new_token_ids,
        "generate": lambda: generate(False),
        "generate_static_compiled": lambda: generate(True),
    }
    timings: dict[str, list[float]] = {name: [] for name in ways}
    outputs: dict[str, list[int]] = {}
    for repeat in range(repeats + 2):  # the first two warm up (and compile)
        for name, run in ways.items():
            torch.cuda.synchronize()
            started = time.perf_counter()
            outputs[name] = run()
            torch.cuda.synchronize()
            if repeat >= 2:
                timings[name].append(time.perf_counter() - started)
    result: dict = {}
    for name, values in timings.items():
        result[name] = {"tokens_per_s": 128 / sorted(values)[len(values) // 2],
                        "identical_to_plain_eager": outputs[name] == outputs["plain_eager"]}
        if outputs[name] != outputs["plain_eager"]:
            result[name]["divergence"] = _divergence(model, ids, outputs["plain_eager"], outputs[name])
    return result


def cost_curve(device: torch.device, quick: bool) -> dict:
    model = _qwen_shape(device)
    prompt = torch.randint(0, 151936, (300,), device=device)
    repeats = 10 if quick else 30
    seconds = {k: _pass_seconds(lambda: CachedLM(model), prompt, k, repeats, device) for k in (1, 2, 4, 8, 16, 32, 64)}
    curve = {"model": "Qwen2.5-1.5B shape, random weights, bfloat16, after 300 cached tokens",
             "one_token_ms": seconds[1] * 1000,
             "relative": {str(k): value / seconds[1] for k, value in seconds.items()}}
    curve["baseline"] = _baseline(model, prompt, 3 if quick else 5)
    return curve


def _baseline(model, prompt: torch.Tensor, repeats: int) -> dict:
    """Plain decoding's tokens/s against ``generate``'s on the same prompt (the fair baseline)."""
    from transformers import GenerationConfig

    settings = GenerationSettings(max_new_tokens=128, stop_on_eos=False)
    config = GenerationConfig(do_sample=False, max_new_tokens=128, min_new_tokens=128, eos_token_id=None,
                              pad_token_id=0)
    ids = prompt.tolist()
    timings: dict[str, list[float]] = {"plain": [], "generate": []}
    outputs: dict[str, list[int]] = {}
    for repeat in range(repeats + 1):  # the first a warm-up
        for name in ("plain", "generate"):
            torch.cuda.synchronize()
            started = time.perf_counter()
            if name == "plain":
                written = collect(plain_decode(CachedLM(model), ids, settings)).new_token_ids
            else:
                with torch.inference_mode():
                    out = model.generate(prompt.view(1, -1), attention_mask=torch.ones_like(prompt.view(1, -1)),
                                         generation_config=config)
                written = out[0, len(ids):].tolist()
            torch.cuda.synchronize()
            if repeat:
                timings[name].append(time.perf_counter() - started)
            outputs[name] = written
    rates = {name: 128 / sorted(values)[len(values) // 2] for name, values in timings.items()}
    result = {"plain_tokens_per_s": rates["plain"], "generate_tokens_per_s": rates["generate"],
              "plain_over_generate": rates["plain"] / rates["generate"],
              "identical": outputs["plain"] == outputs["generate"]}
    parted = _divergence(model, ids, outputs["plain"], outputs["generate"])  # in plain's context
    if parted is not None:
        result["divergence"] = parted
    model.float()  # the same comparison in float32, untimed
    with torch.inference_mode():
        out = model.generate(prompt.view(1, -1), attention_mask=torch.ones_like(prompt.view(1, -1)),
                             generation_config=config)
    result["float32_identical"] = (collect(plain_decode(CachedLM(model), ids, settings)).new_token_ids
                                   == out[0, len(ids):].tolist())
    model.to(torch.bfloat16)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--skip-exactness", action="store_true", help="no part 1 (nor part 4's exactness)")
    parser.add_argument("--skip-compiled", action="store_true", help="no part 4")
    args = parser.parse_args()
    device = torch.device(args.device)
    report: dict = {"torch": torch.__version__, "python": platform.python_version()}
    if device.type == "cuda":
        report["gpu"] = torch.cuda.get_device_name(device)
    import transformers

    report["transformers"] = transformers.__version__
    started = time.perf_counter()
    rows = [] if args.skip_exactness else exactness(device, args.quick)
    report["exactness_seconds"] = time.perf_counter() - started
    report["exactness"] = rows
    float32 = [r for r in rows if r["dtype"] == "float32"]
    bf16 = [r for r in rows if r["dtype"] == "bfloat16"]
    print(f"float32: {sum(r['identical'] for r in float32)}/{len(float32)} runs identical to plain decoding; "
          f"plain equals generate in {sum(r.get('plain_equals_generate', False) for r in float32)}/{len(float32)}")
    print(f"bfloat16: {sum(r['identical'] for r in bf16)}/{len(bf16)} identical")
    for row in rows:
        if not row["identical"]:
            print("  parted:", json.dumps(row))
    by_mode: dict[str, list[int]] = {}
    for row in float32:
        by_mode.setdefault(row["mode"], [0, 0])
        by_mode[row["mode"]][0] += row["accepted"]
        by_mode[row["mode"]][1] += row["drafted"]
    print("float32 accepted/drafted:", {mode: f"{a}/{d}" for mode, (a, d) in by_mode.items()})
    if device.type == "cuda":
        report["cost_curve"] = cost_curve(device, args.quick)
        curve = report["cost_curve"]
        print(f"cost curve ({curve['model']}): one token {curve['one_token_ms']:.2f} ms; " + ", ".join(
            f"k={k}: {value:.2f}" for k, value in curve["relative"].items()))
        base = curve["baseline"]
        print(f"128 tokens: plain decoding {base['plain_tokens_per_s']:.1f} tok/s, generate "
              f"{base['generate_tokens_per_s']:.1f} tok/s ({base['plain_over_generate']:.2f}x), identical "
              f"{base['identical']} (parted: {base.get('divergence')}), float32 identical {base['float32_identical']}")
    if not args.skip_compiled:
        _compiled_part(report, device, args.quick, args.skip_exactness)
        float32 += [r for r in report.get("compiled_exactness", []) if r["dtype"] == "float32"]
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0 if all(r["identical"] for r in float32) else 1


def _compiled_part(report: dict, device: torch.device, quick: bool, skip_exactness: bool) -> None:
    """Part 4, into ``report`` and printed."""
    if not skip_exactness:
        started = time.perf_counter()
        rows = exactness(device, quick, compiled=True)
        report["compiled_exactness_seconds"] = time.perf_counter() - started
        report["compiled_exactness"] = rows
        for dtype in ("float32", "bfloat16"):
            chosen = [r for r in rows if r["dtype"] == dtype]
            print(f"compiled, {dtype}: {sum(r['identical'] for r in chosen)}/{len(chosen)} runs identical to eager "
                  f"plain decoding ({report['compiled_exactness_seconds']:.0f} s with compiling)")
        for row in rows:
            if not row["identical"]:
                print("  parted:", json.dumps(row))
    if device.type != "cuda":
        return
    speed = report["compiled_speed"] = compiled_speed(device, quick)
    print(f"compiled ({speed['compile_mode']}): {len(speed['pass_sizes'])} pass sizes in "
          f"{speed['compile_seconds']:.1f} s; one token eager {speed['eager_ms']['1']:.2f} ms, compiled "
          f"{speed['compiled_ms']['1']:.2f} ms; compiled k-token pass / one-token: " + ", ".join(
              f"{k}: {value:.2f}" for k, value in speed["compiled_relative"].items()))
    print("128 tokens: " + ", ".join(f"{name} {row['tokens_per_s']:.1f} tok/s"
                                      + ("" if row["identical_to_plain_eager"] else " (parted)")
                                      for name, row in speed["decoding"].items()))
    draft = speed["draft_0.5b_one_token_ms"]
    print(f"0.5B-shaped draft, one token: eager {draft['eager']:.2f} ms, compiled {draft['compiled']:.2f} ms")
    head = speed["eagle_head_4_row_step_ms"]
    print(f"EAGLE head, a 4-row tree step: eager {head['eager']:.2f} ms, compiled {head['compiled']:.2f} ms")


if __name__ == "__main__":
    sys.exit(main())
