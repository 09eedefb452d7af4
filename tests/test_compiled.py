"""Compiled passes (``--compile``): the static-cache backend and ``torch.compile`` (inductor on the CPU) write,
token for token, what eager plain decoding writes, in every mode and number format; a compilation that cannot
happen falls back to eager before the race; a process keeps a bounded number of graphs."""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import replace

import pytest
import tiny_app
import torch
from tiny import VOCAB, gpt2, llama, qwen2, reference_greedy, save_tiny_eagle_head, save_tiny_heads, save_tiny_pair

from specdemo import bench
from specdemo.backends import static_lm
from specdemo.backends.eagle3_head import EagleConfig, EagleHead, HeadKVCache
from specdemo.backends.eagle3_static import StaticHeadCache
from specdemo.backends.formats import to_int8_format
from specdemo.backends.medusa_heads import MedusaConfig, MedusaHeads
from specdemo.backends.loading import LoadedModel, LoadSettings, clear_model_cache
from specdemo.backends.static_lm import PASS_SIZES, GraphBudget, StaticLM, capacity_for, pass_size
from specdemo.backends.transformers_lm import CachedLM
from specdemo.core.loop import collect, plain_decode, speculative_decode
from specdemo.core.settings import GenerationSettings, SamplingSettings
from specdemo.methods import SpecSettings, make_drafter
from specdemo.methods.draft_length import make_policy
from specdemo.methods.draft_model import DraftModelDrafter
from specdemo.methods.ngram import NgramDrafter
from specdemo.session import compiling
from specdemo.session.compiling import EAGER, Passes, choose_passes, compile_graphs, sizes_up_to
from specdemo.session.pipeline import encode_prompt, plain_events, release_models, spec_events

COMPILED = Passes("default")  # inductor: what --compile on gives on a CPU
STATIC = Passes(static=True)  # the static cache alone, no compiler
PROMPTS = [[5, 7, 9, 11, 5, 7, 9, 3, 2, 1], [1], [40, 41, 42, 43, 44, 45, 40, 41, 42, 43, 44, 45, 40, 41]]
GREEDY = SamplingSettings()


@pytest.fixture(autouse=True)
def one_thread():
    with tiny_app.one_thread():
        yield


# ----------------------------------------------------------------------------------------------------------------
# the backend


def test_pass_sizes_cover_every_draft_and_capacities_are_few():
    assert pass_size(1) == 1 and pass_size(4) == 5 and pass_size(13) == 17 and pass_size(65) == 65
    assert pass_size(66) is None  # larger than any: unpadded and eager
    assert sizes_up_to(13) == [1, 2, 3, 5, 9, 17] and sizes_up_to(1000) == list(PASS_SIZES)
    assert capacity_for(10) == 1024 and capacity_for(1000) == 2048 and capacity_for(5000) == 8192


@pytest.mark.parametrize("make", [llama, qwen2, gpt2])
def test_a_static_pass_equals_a_cached_one_for_chains_trees_kept_rows_and_hidden_layers(make):
    model = make(1).eval()
    passes = []
    for lm in (CachedLM(model), StaticLM(model, 100)):
        lm.reset()
        prompt = lm.run(torch.tensor(PROMPTS[0]), all_logits=False, with_hidden=True, hidden_layers=[0, 2])
        tree = lm.run(torch.tensor([3, 8, 9, 12, 4, 4, 6]), parents=[-1, 0, 0, 1, 2, 2, -1], with_hidden=True)
        lm.keep(7, [0, 2, 5])
        chain = lm.run(torch.tensor([1, 2]), with_hidden=True, hidden_layers=[0, 1, 2])
        lm.rollback(1)
        step = lm.run(torch.tensor([7]), all_logits=False, with_hidden=False)
        assert lm.length == len(PROMPTS[0]) + 3 + 1 + 1
        passes.append((prompt, tree, chain, step))
    for cached, static in zip(*passes):
        assert static.logits.shape == cached.logits.shape
        torch.testing.assert_close(static.logits, cached.logits, rtol=1e-4, atol=1e-5)
        if cached.hidden_states is not None:
            torch.testing.assert_close(static.hidden_states, cached.hidden_states, rtol=1e-4, atol=1e-5)


def test_outputs_of_cuda_graphs_are_copied_out_before_the_next_replay_overwrites_them():
    logits, states = torch.ones(2, 3), (torch.zeros(1, 4), torch.ones(1, 4))
    copied = static_lm.kept((logits, states), static_lm.CUDA_GRAPHS)
    assert copied[0] is not logits and all(new is not old for new, old in zip(copied[1], states))
    torch.testing.assert_close(copied[0], logits)
    assert static_lm.kept(logits, static_lm.INDUCTOR) is logits and static_lm.kept(None, static_lm.CUDA_GRAPHS) is None


def test_a_pass_that_does_not_fit_the_buffer_is_refused_and_the_sequence_kept():
    model = llama(1).eval()
    lm = StaticLM(model, 10)
    lm.reset()
    lm.run(torch.arange(1, lm.capacity - 70) % VOCAB, all_logits=False, with_hidden=False)
    with pytest.raises(ValueError, match="does not fit"):
        lm.run(torch.arange(80) % VOCAB, with_hidden=False)
    assert lm.length == lm.capacity - 71


def test_two_sides_of_one_model_keep_their_own_buffers():
    model = llama(1).eval()
    settings = GenerationSettings(max_new_tokens=20)
    expected = reference_greedy(model, PROMPTS[2], 20)
    plain = plain_decode(StaticLM(model, 40, role="plain"), PROMPTS[2], settings)
    spec = speculative_decode(StaticLM(model, 40, role="spec"), NgramDrafter(1, 3), make_policy("fixed", 3),
                              PROMPTS[2], settings)
    finished: dict[str, list[int]] = {}
    for plain_event, spec_event in itertools.zip_longest(plain, spec):  # interleaved, as a race runs them
        if plain_event is not None:
            finished["plain"] = plain_event.new_token_ids
        if spec_event is not None:
            finished["spec"] = spec_event.new_token_ids
    assert finished == {"plain": expected, "spec": expected}


def test_a_pass_that_failed_halfway_through_the_layers_leaves_nothing_behind():
    model = llama(1).eval()
    settings = GenerationSettings(max_new_tokens=8)
    lm = StaticLM(model, 40, role="spec")
    collect(plain_decode(lm, PROMPTS[0], settings))
    lm.cache.layers[0].cumulative_length.add_(5)  # as if a pass had stopped after the first layer
    again = StaticLM(model, 40, role="spec")
    assert collect(plain_decode(again, PROMPTS[2], settings)).new_token_ids == reference_greedy(model, PROMPTS[2], 8)


@pytest.mark.parametrize("passes", [STATIC, COMPILED], ids=["static", "compiled"])
@pytest.mark.parametrize("make", [llama, qwen2])
def test_greedy_output_equals_generate_at_every_length_limit(passes, make):
    target = make(3).eval()
    small = make(4, layers=1).eval()
    for prompt in PROMPTS:
        expected = reference_greedy(target, prompt, 24)
        for limit in (1, 2, 5, 24):
            settings = GenerationSettings(max_new_tokens=limit)
            lm = StaticLM(target, len(prompt) + limit, passes.compile_mode, "plain")
            assert collect(plain_decode(lm, prompt, settings)).new_token_ids == expected[:limit]
            for drafter, k in ((NgramDrafter(1, 3), 4), (DraftModelDrafter(small, GREEDY, VOCAB), 2)):
                lm = StaticLM(target, len(prompt) + limit, passes.compile_mode, "spec")
                final = collect(speculative_decode(lm, drafter, make_policy("fixed", k), prompt, settings))
                assert final.new_token_ids == expected[:limit], (prompt, limit, type(drafter).__name__)


def test_eos_inside_an_accepted_draft_stops_there_with_compiled_passes():
    target = llama(1).eval()
    prompt = PROMPTS[2]
    expected = reference_greedy(target, prompt, 30)
    eos = expected[7]
    cut = expected[: expected.index(eos) + 1]
    settings = GenerationSettings(max_new_tokens=30)
    for k in (2, 5):
        drafter = DraftModelDrafter(target, GREEDY, VOCAB, head_tokens=0, int8=False)  # accepts everything
        lm = StaticLM(target, len(prompt) + 30, COMPILED.compile_mode, "spec")
        final = collect(speculative_decode(lm, drafter, make_policy("fixed", k), prompt, settings, [eos]))
        assert final.new_token_ids == cut and final.finish_reason == "eos"


@pytest.mark.parametrize("fmt,passes", [("int8", COMPILED), ("int8", STATIC), ("w8a8", STATIC)],
                         ids=["int8-compiled", "int8-static", "w8a8-static"])
def test_the_int8_formats_write_the_same_tokens_on_a_static_cache_and_compiled(fmt, passes):
    """The row-wise attention of the int8 formats over the static cache's mask; and, compiled, the same tokens
    (w8a8 compiled, exact too, takes minutes of compiling: its kernels split the graph, which is why no run
    compiles the int8 formats, see test_the_int8_formats_stay_eager)."""
    target = to_int8_format(qwen2(3), fmt).eval()
    settings = GenerationSettings(max_new_tokens=16)
    for prompt in (PROMPTS[0], PROMPTS[2]):
        expected = collect(plain_decode(CachedLM(target), prompt, settings)).new_token_ids
        lm = StaticLM(target, len(prompt) + 16, passes.compile_mode, "plain")
        assert collect(plain_decode(lm, prompt, settings)).new_token_ids == expected
        lm = StaticLM(target, len(prompt) + 16, passes.compile_mode, "spec")
        final = collect(speculative_decode(lm, NgramDrafter(1, 3), make_policy("fixed", 2), prompt, settings))
        assert final.new_token_ids == expected


def test_the_int8_formats_stay_eager():
    loaded = LoadedModel("tiny", to_int8_format(llama(1), "w8a8"), None, torch.device("cpu"), torch.float32,
                         LoadSettings(dtype="w8a8"))
    for choice in ("on", "auto"):
        outcome = choose_passes(choice, loaded, measure=False)
        assert outcome.passes == EAGER and "w8a8 format's kernels cannot be traced" in outcome.reason


# ----------------------------------------------------------------------------------------------------------------
# every mode, through the session


@pytest.fixture(scope="module")
def heads(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("heads")
    return {"medusa_heads": save_tiny_heads(folder / "medusa", vocab=tiny_app.VOCAB),
            "eagle_head": save_tiny_eagle_head(folder / "eagle", vocab=tiny_app.VOCAB, draft_vocab=96)}


MODES = ["draft", "ngram", "uag", "medusa", "medusa-chain", "eagle", "eagle-chain", "suffix"]


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_compiled_writes_what_eager_plain_writes(mode, heads):
    target = tiny_app.loader("tiny:target")
    draft = tiny_app.loader("tiny:other" if mode == "uag" else "tiny:draft")
    chain = "chain" in mode or mode in ("draft", "uag", "ngram")
    spec = SpecSettings(mode=mode, num_draft_tokens_schedule="fixed" if chain else "adaptive",
                        num_draft_tokens=3 if chain else None, **heads)
    for text in ("def f ( x ) : return x + y def f ( x ) : return", "hello world the cat sat on the mat"):
        prompt_ids = encode_prompt(target, text)
        for limit in (3, 24):
            settings = GenerationSettings(max_new_tokens=limit, collect_probs=False)
            expected = collect(plain_events(target, prompt_ids, settings)).new_token_ids
            assert collect(plain_events(target, prompt_ids, settings, COMPILED)).new_token_ids == expected
            final = collect(spec_events(target, draft, prompt_ids, settings, spec, passes=COMPILED))
            assert final.new_token_ids == expected, (mode, text, limit)


@pytest.mark.parametrize("head_tokens", [0, 40], ids=["whole-head", "restricted-head"])
def test_a_draft_model_in_a_traceable_format_runs_compiled_beside_the_target(head_tokens):
    """Draft mode's draft model goes through the run's passes: compiled (its own static buffers) when its format
    can be traced, eager as an int8 copy; its graphs are made in the warm-up; the output stays plain's."""
    target, draft = tiny_app.loader("tiny:target"), tiny_app.loader("tiny:draft")
    spec = SpecSettings(mode="draft", num_draft_tokens_schedule="fixed", num_draft_tokens=3, draft_int8=False,
                        draft_head_tokens=head_tokens)
    drafting = compiling.drafting_model_of(spec, target, draft)
    assert drafting is draft.model
    warmed = compile_graphs(choose_passes("on", target), target, {False}, max_rows=4, max_tokens=100,
                            drafting=[drafting])
    assert warmed.compiled["draft model"] == [1, 2]  # inductor: one graph for a row, one for more
    for text in ("def f ( x ) : return x + y def f ( x ) : return", "the cat sat on the mat the cat"):
        prompt_ids = encode_prompt(target, text)
        for limit in (1, 7, 30):
            settings = GenerationSettings(max_new_tokens=limit, collect_probs=False)
            expected = collect(plain_events(target, prompt_ids, settings)).new_token_ids
            final = collect(spec_events(target, draft, prompt_ids, settings, spec, passes=COMPILED))
            assert final.new_token_ids == expected, (text, limit)
    drafter = make_drafter(spec, target, draft, GenerationSettings(max_new_tokens=8), None, None, COMPILED)
    drafter.start(prompt_ids)
    assert isinstance(drafter.lm, StaticLM) and drafter.lm.compile_mode == "default"
    int8 = compiling.drafting_model_of(replace(spec, draft_int8=True), target, draft)
    assert int8 is not draft.model and isinstance(COMPILED.draft_language_model(int8, 50), CachedLM)
    assert isinstance(EAGER.draft_language_model(draft.model, 50), CachedLM)


@pytest.mark.parametrize("compile_mode", [None, "default"], ids=["static", "compiled"])
def test_an_eagle_head_steps_alike_on_its_static_cache(compile_mode):
    """The head's catch-up (causal), a tree step (its own mask), a crop and a chain step give the same outputs on
    the static cache, eager or compiled, as on the growing one; the warm-up compiles the head's step sizes."""
    torch.manual_seed(0)
    head = EagleHead(EagleConfig(32, 4, 2, 8, 64, VOCAB, 48, (1, 2, 3))).eval()
    features, embeds = torch.randn(12, 32), torch.randn(12, 32)
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 0, 1]], dtype=torch.bool)
    visible = torch.cat([torch.ones(4, 7, dtype=torch.bool), tree], dim=1)
    runs = []
    for cache in (HeadKVCache(), StaticHeadCache(head, 100, compile_mode)):
        with torch.inference_mode():
            catch_up = cache.step(head, features[:7], embeds[:7], torch.arange(7), all_logits=False)
            step = cache.step(head, features[7:11], embeds[7:11], torch.tensor([7, 8, 8, 7]), visible)
            cache.crop(7)
            chain = cache.step(head, features[11:], embeds[11:], torch.tensor([7]))
            catch_up_short = cache.step(head, features[:3], embeds[:3], torch.arange(8, 11), all_logits=False)
        assert cache.length == 11
        runs.append((*catch_up, *step, *chain, *catch_up_short))
    for growing, static in zip(*runs):
        assert static.shape == growing.shape
        torch.testing.assert_close(static, growing, rtol=1e-4, atol=1e-5)
    if compile_mode:
        target = _loaded(llama(1))
        warmed = compile_graphs(choose_passes("on", target), target, {True}, max_rows=4, max_tokens=100,
                                drafting=[head])
        assert warmed.compiled["EAGLE head"] == [1, 2, 3, 5]
        assert isinstance(EAGER.head_cache(head, 50), HeadKVCache)


def test_medusa_heads_score_alike_compiled():
    heads = MedusaHeads(MedusaConfig(3, 1, 32, VOCAB)).eval()
    hidden, weight = torch.randn(1, 32), torch.randn(VOCAB, 32)
    with torch.inference_mode():
        eager = heads.scores(EAGER.medusa_features(heads)(hidden), weight)
        compiled = heads.scores(COMPILED.medusa_features(heads)(hidden), weight)
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-5)
    target = _loaded(llama(1))
    warmed = compile_graphs(choose_passes("on", target), target, {True}, max_rows=2, max_tokens=50, drafting=[heads])
    assert warmed.compiled["Medusa heads"] == [1]


# ----------------------------------------------------------------------------------------------------------------
# the choice, the warm-up, the bound


def _loaded(model, source: str = "tiny") -> LoadedModel:
    return LoadedModel(source, model, None, torch.device("cpu"), torch.float32, LoadSettings(dtype="float32"))


def test_the_choice_says_why_in_one_line(monkeypatch, tmp_path):
    target = _loaded(llama(1))
    assert choose_passes("off", target).passes == EAGER
    on = choose_passes("on", target)
    assert on.passes == COMPILED and "inductor" in on.describe() and "\n" not in on.describe()
    assert "ZeroGPU" in choose_passes("on", target, zero_gpu=True).reason
    unmeasured = choose_passes("auto", target, measure=False, folder=tmp_path)
    assert unmeasured.passes == EAGER and "not measured" in unmeasured.reason
    monkeypatch.setattr(compiling.shutil, "which", lambda name: None)
    no_compiler = choose_passes("on", target)
    assert no_compiler.passes == EAGER and "C++ compiler" in no_compiler.reason
    with pytest.raises(Exception, match="--compile must be one of"):
        choose_passes("fast", target)


def test_auto_on_a_cpu_compiles_where_a_cached_measurement_found_it_faster(monkeypatch, tmp_path):
    target = _loaded(llama(1))
    verdict = compiling.measure_compiled(target)  # a real measurement: both passes timed, compiling too
    assert verdict.eager_seconds > 0 and verdict.compiled_seconds > 0 and verdict.compile_seconds > 0
    measured = []

    def measure(loaded):
        measured.append(loaded.source)
        return compiling.CompiledVerdict(eager_seconds=0.100, compiled_seconds=0.060, compile_seconds=40.0)

    monkeypatch.setattr(compiling, "measure_compiled", measure)
    auto = choose_passes("auto", target, folder=tmp_path)
    assert auto.passes == COMPILED and "60.0 ms against 100.0 ms eager" in auto.reason
    assert choose_passes("auto", target, folder=tmp_path).passes == COMPILED and measured == ["tiny"]  # cached
    slower = _loaded(qwen2(3), "tiny-qwen2")
    monkeypatch.setattr(compiling, "measure_compiled", lambda loaded: compiling.CompiledVerdict(0.100, 0.097, 30.0))
    stays = choose_passes("auto", slower, folder=tmp_path)
    assert stays.passes == EAGER and stays.reason.startswith("on this CPU, a compiled one-token pass measured 97.0 ms")


@pytest.mark.parametrize("eager,compiled,kept", [(0.100, 0.200, False), (0.200, 0.100, True)])
def test_a_measurement_keeps_its_graph_only_where_compiling_pays(monkeypatch, eager, compiled, kept):
    """A frozen graph holds a packed copy of the weights: when the verdict is eager, nothing keeps it."""
    release_models()
    times = iter([eager, compiled])
    monkeypatch.setattr(compiling, "_one_token_seconds", lambda lm, prefix, device: next(times))
    verdict = compiling.measure_compiled(_loaded(llama(1)))
    assert verdict.pays == kept and bool(static_lm.GRAPHS.made) == kept


def test_a_model_with_sliding_window_layers_stays_eager():
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=8)
    outcome = choose_passes("on", _loaded(MistralForCausalLM(config).eval()))
    assert outcome.passes == EAGER and "sliding" in outcome.reason


def test_the_warm_up_compiles_every_size_and_a_failure_falls_back_to_eager(monkeypatch):
    target = _loaded(llama(1))
    outcome = compile_graphs(choose_passes("on", target), target, {False, True}, max_rows=4, max_tokens=100)
    assert outcome.passes == COMPILED and outcome.seconds > 0
    assert outcome.compiled == {"plain": [1], "spec": [1, 2, 3, 5], "spec with hidden states": [1, 2, 3, 5]}
    assert json.dumps(outcome.as_record())

    def broken(mode):
        def fail(*args, **kwargs):
            raise RuntimeError("inductor refused an operation\nsecond line")
        return fail

    monkeypatch.setattr(static_lm, "compiled_pass", broken)
    failed = compile_graphs(choose_passes("on", target), target, {False}, max_rows=4, max_tokens=100)
    assert failed.passes == EAGER and failed.reason == "compiling failed: inductor refused an operation"
    assert "eager passes" in failed.describe()


def test_past_the_graph_bound_a_pass_size_runs_eagerly(monkeypatch):
    budget = GraphBudget(limit=2)
    monkeypatch.setattr(static_lm, "GRAPHS", budget)
    model = llama(1).eval()
    settings = GenerationSettings(max_new_tokens=12)
    expected = reference_greedy(model, PROMPTS[2], 12)
    lm = StaticLM(model, 40, "default", "spec")
    final = collect(speculative_decode(lm, NgramDrafter(1, 3), make_policy("fixed", 4), PROMPTS[2], settings))
    assert final.new_token_ids == expected
    assert len(budget.made) == 2  # every other size ran eagerly


def test_freeing_models_drops_the_compiled_graphs():
    model = llama(1).eval()
    lm = StaticLM(model, 20, "default", "plain")
    collect(plain_decode(lm, PROMPTS[0], GenerationSettings(max_new_tokens=3)))
    assert static_lm.GRAPHS.made
    release_models()
    assert not static_lm.GRAPHS.made


# ----------------------------------------------------------------------------------------------------------------
# the bench


@pytest.mark.usefixtures("own_cache")
def test_the_bench_races_compiled_against_eager_in_one_run_beside_stock_static(tmp_path, capsys):
    target, draft = save_tiny_pair(tmp_path / "pair")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "category": "code", "prompt": "def add(a, b):\n    return a + b\n"})
                       + "\n")
    out = tmp_path / "out.json"
    clear_model_cache()
    code = bench.main(["--target", target, "--draft", draft, "--prompts", str(prompts), "--dtype", "float32",
                       "--device", "cpu", "--max-new-tokens", "10", "--modes", "plain,draft,ngram,hf-static",
                       "--compile", "on,off", "--num-draft-tokens", "3", "--calibration", "off", "--quiet",
                       "--json", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "on: compiled passes (default, --compile on): inductor on the CPU" in printed
    assert "off: eager passes (--compile off): as asked" in printed
    report = json.loads(out.read_text())
    modes = ["plain@on", "draft@on", "ngram@on", "plain@off", "draft@off", "ngram@off", "hf-static"]
    assert report["config"]["modes"] == modes and report["config"]["compile"] == ["on", "off"]
    assert report["compile"]["on"]["compile_mode"] == "default" and report["compile"]["on"]["compile_seconds"] > 0
    assert report["compile"]["on"]["compiled_pass_sizes"] == {"plain": [1], "spec": [1, 2, 3, 5]}
    assert report["compile"]["off"]["compile_mode"] is None
    plain = next(r for r in report["results"] if r["mode"] == "plain@off")["new_token_ids"]
    assert all(r["new_token_ids"] == plain and r["identical"] for r in report["results"])
    summary = report["summary"]
    assert summary["plain@on"]["speedup"] == pytest.approx(1.0) and summary["plain@off"]["speedup"] == pytest.approx(1.0)
    assert summary["draft@on"]["speedup_vs"]["plain@off"] > 0 and summary["draft@on"]["acceptance_rate"] is not None
    assert summary["plain@on"]["speedup_vs"]["plain@off"] > 0  # compiled plain against eager plain
    assert "prompt_ids" in next(r for r in report["results"] if r["mode"] == "plain@on")


# ----------------------------------------------------------------------------------------------------------------
# the app's and the recorder's racer


def test_a_race_with_compile_on_compiles_before_it_starts_and_logs_how_it_ran():
    from specdemo.app.handlers import status_text
    from specdemo.session.racelog import RaceLog
    from specdemo.session.racer import Racer
    from specdemo.session.request import RaceRequest

    racer = Racer(tiny_app.config(compile="on"))
    messages: list[str] = []
    request = RaceRequest("def f ( x ) : return x + y def f ( x ) :", "tiny", mode="ngram", num_draft_tokens="3",
                          max_new_tokens=16, dtype="float32")
    prepared = racer.prepare(request, lambda fraction, message: messages.append(message))
    # the step line: "step 3 of 5 (about 6 s left): choosing how the passes run, Compiling the target's passes ..."
    assert any(re.match(r"step \d of \d \(about \d+ s left\): choosing how the passes run, Compiling the target's "
                        r"passes \(inductor on the CPU", message) for message in messages)
    assert prepared.compiled.passes == COMPILED and prepared.compiled.compiled == {"plain": [1], "spec": [1, 2, 3, 5]}
    final = None
    for final in racer.run(prepared):
        pass
    assert final.done and final.plain.counters.new_tokens == 16
    assert [t.id for t in final.spec.tokens] == [t.id for t in final.plain.tokens]
    record = RaceLog.from_json(json.loads(json.dumps(final.log().to_json()))).settings.compile
    assert record["compile_mode"] == "default" and record["compiled_pass_sizes"]["spec"] == [1, 2, 3, 5]
    assert "Both sides ran compiled passes (inductor on the CPU, compiled in" in status_text(final)
    again = racer.prepare(request, lambda fraction, message: messages.append(message))
    assert again.compiled is prepared.compiled  # once per pair, mode and length
    assert sum(", Compiling the target" in message for message in messages) == 1


def test_on_zero_gpu_a_race_stays_eager_and_says_so():
    from specdemo.session.racer import Racer
    from specdemo.session.request import RaceRequest

    racer = Racer(tiny_app.config(compile="on", zero_gpu=True))
    prepared = racer.prepare(RaceRequest("hello world", "tiny", mode="ngram", max_new_tokens=4, dtype="float32"))
    assert prepared.passes == EAGER
    assert prepared.warnings[-1] == "eager passes (--compile on): ZeroGPU cannot compile at run time"
