"""EAGLE-3 heads: the layer-selection pass, exact greedy output (tree and chain, every format), exact sampling, the
three checkpoint layouts, and misfits refused in one line."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from test_medusa import random_heads
from test_sampling import ALPHA, _chi_square_p
from tiny import VOCAB, llama, qwen2, save_tiny_eagle_head, save_tiny_pair

from specdemo.backends.formats import INT8, W8A8, W8A8Linear, activation_dtype, to_int8_format
from specdemo.backends.loading import LoadedModel, LoadSettings
from specdemo.backends.transformers_lm import CachedLM
from specdemo.core.acceptance import target_distribution
from specdemo.core.errors import InputError
from specdemo.core.events import ACCEPTED, DRAFTED_BY_BOTH, DRAFTED_BY_HEAD, DRAFTED_BY_LOOKUP
from specdemo.core.loop import collect, plain_decode, speculative_decode
from specdemo.core.settings import GenerationSettings, SamplingSettings
from specdemo.core.tree import add_branch
from specdemo.backends import eagle3_checkpoint, eagle3_head
from specdemo.methods import (
    METHODS,
    SpecSettings,
    make_drafter,
    make_spec_policy,
)
from specdemo.methods.draft_length import FixedDraftLength, TreeBudget, make_policy
from specdemo.backends.eagle3_checkpoint import EagleLoadError, head_for, load_head, save_head, target_facts
from specdemo.backends.eagle3_head import EagleConfig, EagleHead, default_hidden_layers
from specdemo.methods.eagle import EagleDrafter
from specdemo.core.tree import best_path_first
from specdemo.methods.medusa import MedusaDrafter
from specdemo.methods.ngram import LookupBranch, NgramDrafter
from specdemo.render.views import token_title
from specdemo.session.pipeline import plain_events, spec_events

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingSettings()
PROMPTS = [[5, 7, 9, 11, 5, 7, 9, 3, 2, 1], [1], [40, 41, 42, 43, 44, 45, 40, 41, 42, 43, 44, 45, 40, 41]]
TARGETS = {"llama": lambda: llama(1), "qwen2": lambda: qwen2(3)}
CPU = torch.device("cpu")


def head_config(model, draft_vocab: int = 48, vocab: int = VOCAB, **fields) -> EagleConfig:
    hidden = model.config.hidden_size
    layers = fields.pop("hidden_layers", default_hidden_layers(model.config.num_hidden_layers))
    return EagleConfig(hidden, 4, 2, hidden // 4, 2 * hidden, vocab, draft_vocab, layers, **fields)


def random_head(model, seed: int = 0, scale: float = 0.3, draft_vocab: int = 48, **fields) -> EagleHead:
    """Random weights; the draft vocabulary a random subset of the target's ids."""
    head = EagleHead(head_config(model, draft_vocab, **fields))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * scale)
        head.draft_ids.copy_(torch.randperm(VOCAB, generator=generator)[:draft_vocab].sort().values)
    return head.eval()


def trained_head(model, steps: int = 40, draft_vocab: int = 64, seed: int = 0) -> EagleHead:
    """A head fitted in about a second to the target's own greedy text (two steps of training-time test: the
    target's features, then the head's own output), so that its drafts are accepted most of the time."""
    layers = default_hidden_layers(model.config.num_hidden_layers)
    sequences = []
    for prompt in PROMPTS + [[3, 1, 4, 1, 5, 9, 2, 6], [50, 60, 70]]:
        written = collect(plain_decode(CachedLM(model), prompt, GenerationSettings(max_new_tokens=40)))
        sequences.append(torch.tensor(prompt + written.new_token_ids))
    counts = torch.bincount(torch.cat(sequences), minlength=VOCAB)
    draft_ids = counts.argsort(descending=True, stable=True)[:draft_vocab].sort().values
    to_draft = torch.full((VOCAB,), -100)
    to_draft[draft_ids] = torch.arange(draft_vocab)
    torch.manual_seed(seed)
    head = EagleHead(head_config(model, draft_vocab))
    with torch.no_grad():
        head.draft_ids.copy_(draft_ids)
    embed = model.get_input_embeddings()
    data = []
    for sequence in sequences:
        with torch.inference_mode():
            states = CachedLM(model).run(sequence, hidden_layers=layers).hidden_states
        data.append((states.clone(), sequence))
    optimizer = torch.optim.Adam(head.parameters(), lr=1e-2)
    cross_entropy = torch.nn.functional.cross_entropy
    for _ in range(steps):
        for states, sequence in data:
            count = sequence.shape[0] - 2
            cache = eagle3_head.HeadKVCache()
            positions = torch.arange(count)
            first = head(head.features(states[:count]), embed(sequence[1 : count + 1]).detach(), positions, cache)
            loss = cross_entropy(head.logits(first), to_draft[sequence[2 : count + 2]], ignore_index=-100)
            # step 2: position p reads (the head's output at p - 1, x_{p+1}), sees step-1 keys up to p - 1, itself
            rows = count - 1
            earlier = torch.ones(rows, count, dtype=torch.bool).tril()
            visible = torch.cat([earlier, torch.eye(rows, dtype=torch.bool)], 1)
            second = head(first[:rows], embed(sequence[2 : rows + 2]).detach(), positions[1:], cache, visible)
            loss = loss + cross_entropy(head.logits(second), to_draft[sequence[3 : rows + 3]], ignore_index=-100)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return head.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def trained(one_torch_thread):
    """Each target with a head trained on its own text."""
    models = {name: factory() for name, factory in TARGETS.items()}
    return {name: (model, trained_head(model)) for name, model in models.items()}


def drafter(model, head, tree: bool, sampling=GREEDY, **kwargs) -> EagleDrafter:
    return EagleDrafter(head, model.get_input_embeddings(), sampling, VOCAB, tree=tree, **kwargs)


def plain_ids(model, prompt, settings, eos=()):
    return collect(plain_decode(CachedLM(model), prompt, settings, eos)).new_token_ids


#: the drafter shapes the exactness tests go through: a chain, a tree, and a tree with prompt lookup's branch
SHAPES = {"chain": (False, False), "tree": (True, False), "tree+lookup": (True, True)}


def policy_and_drafter(model, head, tree: bool, budget, lookup: bool = False):
    """The run's policy and drafter as the method builds them: a TreeBudget sizing each tree for adaptive trees;
    ``lookup``: the tree holds prompt lookup's branch too."""
    branch = LookupBranch() if lookup else None
    if budget == "adaptive" and tree:
        policy = TreeBudget(max_num_draft_tokens=8)
        return policy, drafter(model, head, tree, verify_cost=policy.verify_cost, lookup=branch)
    schedule, k = ("adaptive", None) if budget == "adaptive" else ("fixed", budget)
    return make_policy(schedule, k, 8, free_drafts=True), drafter(model, head, tree, lookup=branch)


def loaded(model, source: str = "tiny-llama") -> LoadedModel:
    return LoadedModel(source, model, None, CPU, next(model.parameters()).dtype, LoadSettings(dtype="float32"))


# ----------------------------------------------------------------------------------------------------------------
# the target's pass


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_a_layer_selection_pass_returns_those_layers_states_side_by_side(name):
    model = llama(1, layers=4) if name == "llama" else qwen2(3, layers=4)
    ids = torch.tensor(PROMPTS[0])
    with torch.inference_mode():
        reference = model(input_ids=ids.view(1, -1), output_hidden_states=True).hidden_states
    layers = (1, 2, 4)
    expected = torch.cat([reference[layer][0] for layer in layers], dim=-1)
    for all_logits in (True, False):  # every prompt row, whatever all_logits says
        lm = CachedLM(model)
        chosen = lm.run(ids, all_logits=all_logits, hidden_layers=layers)
        assert chosen.hidden_states.shape == (len(ids), 3 * 64)
        assert torch.allclose(chosen.hidden_states, expected, atol=1e-5)
        assert chosen.logits.shape[0] == (len(ids) if all_logits else 1)
    # without hidden_layers nothing changed: the final post-norm state, the last row for all_logits=False
    final = CachedLM(model).run(ids, all_logits=False).hidden_states
    assert final.shape == (1, 64) and torch.allclose(final[0], reference[-1][0, -1], atol=1e-5)
    assert CachedLM(model).run(ids, with_hidden=False, hidden_layers=layers).hidden_states is None
    # a tree pass: each node's states are those of its own path
    lm = CachedLM(model)
    lm.run(ids[:6], hidden_layers=layers)
    tree = lm.run(ids[6:9], parents=[-1, 0, 0], hidden_layers=layers).hidden_states
    with torch.inference_mode():
        path = model(input_ids=torch.cat([ids[:7], ids[8:9]]).view(1, -1), output_hidden_states=True).hidden_states
    assert torch.allclose(tree[2], torch.cat([path[layer][0, -1] for layer in layers]), atol=1e-4)
    with pytest.raises(ValueError, match="hidden layers"):
        CachedLM(model).run(ids, hidden_layers=(1, 9))


def test_default_layers_are_eagle3s_and_stay_inside_small_models():
    assert default_hidden_layers(32) == (2, 16, 29) and default_hidden_layers(28) == (2, 14, 25)
    assert default_hidden_layers(2) == (0, 1, 2) and default_hidden_layers(4) == (1, 2, 2)


class _Spy:
    """Records the keyword arguments of every target pass."""

    def __init__(self, lm: CachedLM) -> None:
        self.calls: list[dict] = []
        original = lm.run

        def run(ids, *args, **kwargs):
            self.calls.append(kwargs)
            return original(ids, *args, **kwargs)

        lm.run = run


def test_only_an_eagle_run_asks_the_target_for_layers():
    model = llama(1)
    settings = GenerationSettings(max_new_tokens=12)
    weight = model.get_output_embeddings().weight.detach()
    others = {
        "ngram": NgramDrafter(1, 3),
        "medusa": MedusaDrafter(random_heads(model), weight, GREEDY, VOCAB, tree=True, top_width=3),
    }
    expected = plain_ids(model, PROMPTS[0], settings)
    for label, other in others.items():
        lm = CachedLM(model)
        spy = _Spy(lm)
        final = collect(speculative_decode(lm, other, FixedDraftLength(3), PROMPTS[0], settings))
        assert final.new_token_ids == expected
        assert spy.calls and all("hidden_layers" not in call for call in spy.calls), label
        assert all(call["with_hidden"] == other.needs_hidden_states for call in spy.calls), label
    head = random_head(model)
    lm = CachedLM(model)
    spy = _Spy(lm)
    assert collect(speculative_decode(lm, drafter(model, head, True), FixedDraftLength(3), PROMPTS[0],
                                      settings)).new_token_ids == expected
    assert all(call["hidden_layers"] == head.hidden_layers and call["with_hidden"] for call in spy.calls)


# ----------------------------------------------------------------------------------------------------------------
# exact greedy output


@pytest.mark.parametrize("name", sorted(TARGETS))
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("kind", ["random", "trained"])
def test_greedy_eagle_output_equals_the_target_alone(trained, name, shape, kind):
    model, fitted = trained[name]
    tree, lookup = SHAPES[shape]
    head = fitted if kind == "trained" else random_head(model, seed=4)
    settings = GenerationSettings(max_new_tokens=24)
    accepted = 0
    for prompt in PROMPTS:
        expected = plain_ids(model, prompt, settings)
        for budget in (1, 3, 8, "adaptive"):
            policy, eagle_drafter = policy_and_drafter(model, head, tree, budget, lookup)
            final = collect(speculative_decode(CachedLM(model), eagle_drafter, policy, prompt, settings))
            assert final.new_token_ids == expected, (prompt, budget)
            assert eagle_drafter._cache.length == eagle_drafter._committed  # drafted positions rolled back
            accepted += final.counters.accepted
    if kind == "trained":  # the trained head's drafts are mostly accepted: whole paths, not only first tokens
        assert accepted > 100


def test_the_heads_cache_after_a_run_is_what_a_fresh_pass_over_the_text_gives(trained):
    """Committed positions only (target features, accepted tokens): the head's state after a run of trees equals
    one teacher-forced pass over the whole text."""
    model, head = trained["llama"]
    prompt = PROMPTS[0]
    eagle_drafter = drafter(model, head, True)
    final = collect(speculative_decode(CachedLM(model), eagle_drafter, FixedDraftLength(6), prompt,
                                       GenerationSettings(max_new_tokens=20)))
    assert final.counters.accepted > 10
    context = prompt + final.new_token_ids
    eagle_drafter._catch_up(context)
    sequence = torch.tensor(context)
    with torch.inference_mode():
        states = CachedLM(model).run(sequence[:-1], hidden_layers=head.hidden_layers).hidden_states
        embeds = model.get_input_embeddings()(sequence[1:])
        outputs = head(head.features(states), embeds, torch.arange(len(context) - 1))
    assert eagle_drafter._committed == len(context) - 1
    assert torch.allclose(eagle_drafter._root[1], head.logits(outputs[-1:])[0], atol=1e-4)


def test_a_tree_stops_growing_when_no_deeper_step_could_pay(trained):
    """A tree step whose children could not lift the tree's rate (each child worth at most its parent's path
    probability) is not run: with a dear step the tree is the root's top tokens, drafted with no step; with a free
    step and a flat verify cost it grows."""
    model, head = trained["llama"]
    prompt = PROMPTS[0]
    context = prompt + plain_ids(model, prompt, GenerationSettings(max_new_tokens=1))
    with torch.inference_mode():
        prefill = CachedLM(model).run(torch.tensor(prompt), hidden_layers=head.hidden_layers)
    steps = []
    for step_seconds, expect_steps in ((10.0, False), (1e-9, True)):
        eagle_drafter = drafter(model, head, True, verify_cost=lambda length: 1.0 + 1e-6 * length)
        eagle_drafter.start(prompt, prefill)
        eagle_drafter._catch_up(context)
        eagle_drafter._step_seconds = step_seconds
        calls = []
        real_forward = head.forward
        head.forward = lambda *args, **kwargs: calls.append(1) or real_forward(*args, **kwargs)
        try:
            with torch.inference_mode():
                candidates, parents, probs = eagle_drafter._grow_tree(8)
        finally:
            del head.forward
        steps.append(len(calls))
        assert bool(calls) == expect_steps, step_seconds
        if not expect_steps:
            assert parents == [-1] * len(candidates) == [-1] * eagle_drafter.top_k  # the root's top tokens only
        eagle_drafter._cache.crop(eagle_drafter._committed)
    assert steps[1] >= 2


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_every_length_limit_and_eos_inside_an_accepted_path(trained, shape):
    model, head = trained["llama"]
    tree, lookup = SHAPES[shape]
    prompt = PROMPTS[0]
    full = plain_ids(model, prompt, GenerationSettings(max_new_tokens=20))

    def new_drafter():
        return drafter(model, head, tree, lookup=LookupBranch() if lookup else None)

    for limit in range(1, 13):
        final = collect(speculative_decode(CachedLM(model), new_drafter(), FixedDraftLength(6), prompt,
                                           GenerationSettings(max_new_tokens=limit)))
        assert final.new_token_ids == full[:limit], limit
    cut_inside = 0
    for eos_at in range(1, 14):
        eos = [full[eos_at]]
        expected = plain_ids(model, prompt, GenerationSettings(max_new_tokens=20), eos)
        events = list(speculative_decode(CachedLM(model), new_drafter(), FixedDraftLength(6), prompt,
                                         GenerationSettings(max_new_tokens=20), eos))
        assert events[-1].new_token_ids == expected and events[-1].finish_reason == "eos"
        last = events[-1]
        if last.tokens[-1].kind == ACCEPTED and last.accepted > len(last.tokens):
            cut_inside += 1  # EOS was an accepted draft token, and the accepted tokens after it were dropped
    assert cut_inside >= 2


@pytest.mark.parametrize(("fmt", "head_dtype"), [(INT8, torch.bfloat16), (W8A8, torch.float32),
                                                (W8A8, torch.bfloat16)])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_eagle_in_the_int8_formats_equals_plain_decoding_in_that_format(trained, shape, fmt, head_dtype):
    _, fitted = trained["llama"]
    tree, lookup = SHAPES[shape]
    target = to_int8_format(llama(1), fmt)
    head = copy.deepcopy(fitted).to(head_dtype)  # the target's dtype, or bfloat16 beside w8a8 (the faster here)
    settings = GenerationSettings(max_new_tokens=24)
    accepted = 0
    for prompt in PROMPTS:
        expected = plain_ids(target, prompt, settings)
        for budget in (3, 8, "adaptive"):
            policy, eagle_drafter = policy_and_drafter(target, head, tree, budget, lookup)
            final = collect(speculative_decode(CachedLM(target), eagle_drafter, policy, prompt, settings))
            assert final.new_token_ids == expected, (prompt, budget)
            accepted += final.counters.accepted
    assert accepted > 50


def test_beside_an_int8_or_w8a8_target_the_head_runs_in_the_format_that_drafts_fastest(
        trained, tmp_path, monkeypatch, caplog):
    _, fitted = trained["llama"]
    before = {name: tensor.clone() for name, tensor in fitted.state_dict().items()}
    with caplog.at_level("INFO", logger="specdemo.backends.eagle3_head"):
        chosen = eagle3_head.fastest_head_format(fitted, eagle3_head.CPU_HEAD_FORMATS, context=16, repeats=1)
    assert isinstance(chosen, EagleHead) and "running it in" in caplog.text
    assert set(chosen.format_seconds) == set(eagle3_head.CPU_HEAD_FORMATS)  # what the results file records
    assert chosen.number_format == min(chosen.format_seconds, key=chosen.format_seconds.__getitem__)
    assert all(torch.equal(tensor, before[name]) for name, tensor in fitted.state_dict().items())  # untouched
    folder = tmp_path / "head"
    save_head(fitted, folder, torch.float32)
    measured = []

    def as_told(head, formats, **_):  # the last format (w8a8), without timing anything
        measured.append(formats)
        return eagle3_head.head_in_format(head, formats[-1])

    monkeypatch.setattr(eagle3_checkpoint, "fastest_head_format", as_told)
    for fmt in (W8A8, INT8):
        model = to_int8_format(llama(1), fmt)
        target = LoadedModel("tiny", model, None, CPU, activation_dtype(fmt), LoadSettings(dtype=fmt))
        head = head_for(target, str(folder))
        assert isinstance(head.fc, W8A8Linear) and isinstance(head.lm_head, W8A8Linear)
        assert head.number_format == W8A8
        assert head.dtype == torch.float32 and measured[-1] == eagle3_head.CPU_HEAD_FORMATS
        for tree, budget in ((True, 4), (False, 3), (True, "adaptive")):
            settings = GenerationSettings(max_new_tokens=16)
            policy, eagle_drafter = policy_and_drafter(model, head, tree, budget)
            final = collect(speculative_decode(CachedLM(model), eagle_drafter, policy, PROMPTS[0], settings))
            assert final.new_token_ids == plain_ids(model, PROMPTS[0], settings), (fmt, tree, budget)
    model = llama(1)  # a float32 target: the head in its dtype, nothing measured
    head = head_for(LoadedModel("tiny", model, None, CPU, torch.float32, LoadSettings(dtype="float32")), str(folder))
    assert len(measured) == 2 and isinstance(head.fc, torch.nn.Linear) and head.dtype == torch.float32


def test_the_w8a8_head_drafts_what_the_float32_head_drafts(trained, monkeypatch):
    """Two-part activations (about 14 bits) in every layer: the head's top-1 barely moves (on the real head 98.6 %
    of teacher-forced positions agreed with float32, as bfloat16's 98.3 %; 7-bit activations agreed 81 %). Its
    q, k, v and gate, up layers share their input's one call, bit-equal to separate layers."""
    from specdemo.backends.formats import SHARE_INPUTS_ENV, SharedInputLinear

    for name in ("llama", "qwen2"):
        model, fitted = trained[name]
        quantised = eagle3_head.head_in_format(fitted, W8A8)
        assert quantised is not fitted and isinstance(quantised.midlayer.mlp.down_proj, W8A8Linear)
        assert isinstance(quantised.midlayer.self_attn.k_proj, SharedInputLinear)
        assert eagle3_head.head_in_format(fitted, "float32") is fitted
        with monkeypatch.context() as patched:
            patched.setenv(SHARE_INPUTS_ENV, "0")
            separate = eagle3_head.head_in_format(fitted, W8A8)
        assert isinstance(separate.midlayer.self_attn.k_proj, W8A8Linear)
        generator = torch.Generator().manual_seed(1)
        rows = 48
        states = torch.randn(rows, fitted.config.num_features * fitted.config.hidden_size, generator=generator)
        embeds = model.get_input_embeddings()(torch.randint(0, VOCAB, (rows,), generator=generator))
        with torch.inference_mode():
            logits = [head.logits(head(head.features(states), embeds, torch.arange(rows)))
                      for head in (fitted, quantised, separate)]
        assert torch.equal(logits[1], logits[2]), name
        tops = [row.argmax(-1) for row in logits]
        assert (tops[0] == tops[1]).float().mean() >= 0.9, name


def test_sampled_runs_refuse_a_tree():
    model = llama(1)
    with pytest.raises(ValueError, match="greedily"):
        drafter(model, random_head(model), True, sampling=SamplingSettings(temperature=1.0))


# ----------------------------------------------------------------------------------------------------------------
# exact sampling


def test_sampled_eagle_chains_follow_the_target_at_every_draft_position():
    """Three tokens: the prefill's, then a two-token draft. The head drafts from 6 of the 8 ids (zero elsewhere),
    so the residual distribution has to supply the other two; the joint law of all three tokens is the target's."""
    vocab = 8
    target = llama(21, layers=1, vocab=vocab, hidden=32)
    config = EagleConfig(32, 4, 2, 8, 64, vocab, 6, default_hidden_layers(1))
    head = EagleHead(config)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)
        head.draft_ids.copy_(torch.tensor([0, 1, 2, 4, 5, 7]))
    sampling = SamplingSettings(temperature=1.3, top_k=6)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    with torch.inference_mode():
        first = target_distribution(target(input_ids=torch.tensor([prompt])).logits[0, -1], sampling)
        second = target_distribution(target(input_ids=torch.tensor([prompt + [a] for a in range(vocab)])).logits[:, -1],
                                     sampling)
        pairs = [(a, b) for a in range(vocab) for b in range(vocab)]
        third = target_distribution(target(input_ids=torch.tensor([prompt + [a, b] for a, b in pairs])).logits[:, -1],
                                    sampling).view(vocab, vocab, vocab)
    exact = {(a, b, c): float(first[a] * second[a, b] * third[a, b, c])
             for a in range(vocab) for b in range(vocab) for c in range(vocab)}
    trials = 1500
    counts: dict = {}
    drafted = 0
    for seed in range(trials):
        settings = GenerationSettings(max_new_tokens=3, sampling=SamplingSettings(1.3, 6, 1.0, seed),
                                      collect_probs=False)
        eagle_drafter = EagleDrafter(head, target.get_input_embeddings(), settings.sampling, vocab,
                                     generator=torch.Generator().manual_seed(10_000 + seed))
        final = collect(speculative_decode(CachedLM(target), eagle_drafter, FixedDraftLength(2), prompt, settings))
        key = tuple(final.new_token_ids)
        counts[key] = counts.get(key, 0) + 1
        drafted += final.counters.accepted
    assert drafted > trials // 4  # the drafts were accepted often enough to matter
    assert _chi_square_p(counts, exact, trials) > ALPHA
    later: dict = {}  # positions 2 and 3 alone: the draft's own positions
    for (a, b, c), count in counts.items():
        later[(b, c)] = later.get((b, c), 0) + count
    exact_later: dict = {}
    for (a, b, c), prob in exact.items():
        exact_later[(b, c)] = exact_later.get((b, c), 0.0) + prob
    assert _chi_square_p(later, exact_later, trials) > ALPHA


# ----------------------------------------------------------------------------------------------------------------
# files


def _tensors(head: EagleHead, prefix: str) -> dict[str, torch.Tensor]:
    """The head's weights as EAGLE-3's checkpoints name them (the layer under ``prefix``), d2t and t2d."""
    state = {}
    for name, tensor in head.state_dict().items():
        state[prefix + name[len("midlayer."):] if name.startswith("midlayer.") else name] = tensor.clone()
    state["d2t"] = head.draft_ids - torch.arange(head.config.draft_vocab_size)
    t2d = torch.zeros(head.config.vocab_size, dtype=torch.bool)
    t2d[head.draft_ids] = True
    state["t2d"] = t2d
    return state


def _llama_config(config: EagleConfig) -> dict:
    return {
        "model_type": "llama", "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim, "num_hidden_layers": 1, "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta, "rope_scaling": None, "max_position_embeddings": 2048,
        "hidden_act": "silu", "vocab_size": config.vocab_size,
    }


def write_original(head: EagleHead, folder: Path, safetensors: bool = False) -> Path:
    """A checkpoint as EAGLE-3's trainer writes it: a Llama-style config with draft_vocab_size, midlayer.*."""
    folder.mkdir(parents=True)
    raw = _llama_config(head.config) | {"architectures": ["LlamaForCausalLMEagle3"], "torch_dtype": "float16",
                                        "draft_vocab_size": head.config.draft_vocab_size}
    (folder / "config.json").write_text(json.dumps(raw))
    state = _tensors(head, "midlayer.")
    if safetensors:
        from safetensors.torch import save_file

        save_file(state, str(folder / "model.safetensors"))
    else:
        torch.save(state, folder / "pytorch_model.bin")
    return folder


def write_speculators(head: EagleHead, folder: Path, verifier: str = "tiny-llama",
                      architectures: tuple[str, ...] = ("LlamaForCausalLM",)) -> Path:
    """A checkpoint in speculators' layout: speculators_model_type eagle3, the layer under layers.0."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    raw = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.3.0",
        "draft_vocab_size": head.config.draft_vocab_size,
        "norm_before_residual": False,
        "eagle_aux_hidden_state_layer_ids": list(head.hidden_layers),
        "transformer_layer_config": _llama_config(head.config),
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3, "verifier_accept_k": 1}],
            "verifier": {"name_or_path": verifier, "architectures": list(architectures)},
        },
    }
    (folder / "config.json").write_text(json.dumps(raw))
    state = _tensors(head, "layers.0.")
    state["embed_tokens.weight"] = torch.zeros(head.config.vocab_size, head.config.hidden_size)  # ignored
    save_file(state, str(folder / "model.safetensors"))
    return folder


def test_the_three_layouts_load_the_same_head_and_draft_the_same(trained, tmp_path):
    model, head = trained["llama"]
    target = loaded(model)
    folders = {
        "ours": tmp_path / "ours",
        "original-bin": write_original(head, tmp_path / "original-bin"),
        "original-safetensors": write_original(head, tmp_path / "original-st", safetensors=True),
        "speculators": write_speculators(head, tmp_path / "speculators"),
    }
    digest = save_head(head, folders["ours"], torch.float32, extra={"verifier": "tiny-llama"})
    assert len(digest) == 64 and json.loads((folders["ours"] / "config.json").read_text())["verifier"] == "tiny-llama"
    settings = GenerationSettings(max_new_tokens=24)
    reference = [collect(speculative_decode(CachedLM(model), drafter(model, head, True), FixedDraftLength(6), prompt,
                                            settings)) for prompt in PROMPTS]
    for label, folder in folders.items():
        loaded_head = load_head(folder, target_facts(target))
        assert loaded_head.hidden_layers == head.hidden_layers, label
        assert torch.equal(loaded_head.draft_ids, head.draft_ids), label
        for (name, tensor), (_, original) in zip(loaded_head.state_dict().items(), head.state_dict().items()):
            assert torch.equal(tensor, original), (label, name)
        for prompt, expected in zip(PROMPTS, reference):
            final = collect(speculative_decode(CachedLM(model), drafter(model, loaded_head, True), FixedDraftLength(6),
                                               prompt, settings))
            assert final.new_token_ids == expected.new_token_ids
            assert final.counters.accepted_lengths == expected.counters.accepted_lengths, label  # the same drafts


@pytest.mark.parametrize("mode", ["eagle", "eagle-chain"])
def test_the_modes_run_through_the_registry_and_the_session(trained, tmp_path, mode):
    model, head = trained["qwen2"]
    folder = tmp_path / "head"
    save_head(head, folder, torch.float32)
    target = LoadedModel("tiny-qwen", model, None, CPU, torch.float32, LoadSettings(dtype="float32"))
    method = METHODS[mode]
    assert method.needs_hidden_states and method.drafts_for_free and method.proposes_trees == (mode == "eagle")
    settings = GenerationSettings(max_new_tokens=20)
    for schedule, num_draft_tokens in (("fixed", 4), ("adaptive", None)):
        spec = SpecSettings(mode=mode, num_draft_tokens_schedule=schedule, num_draft_tokens=num_draft_tokens,
                            max_num_draft_tokens=8, eagle_head=str(folder))
        policy = make_spec_policy(spec, target, settings)
        assert isinstance(policy, TreeBudget) == (mode == "eagle" and schedule == "adaptive")
        built = make_drafter(spec, target, None, settings, policy)
        assert isinstance(built, EagleDrafter) and built.tree == (mode == "eagle")
        plain = collect(plain_events(target, PROMPTS[0], settings))
        events = list(spec_events(target, None, PROMPTS[0], settings, spec))
        assert events[-1].new_token_ids == plain.new_token_ids
        assert events[-1].counters.accepted > 0 and any(e.tokens and e.tokens[0].kind == ACCEPTED for e in events)
    sampled = GenerationSettings(max_new_tokens=12, sampling=SamplingSettings(temperature=1.0, seed=3))
    spec = SpecSettings(mode=mode, num_draft_tokens_schedule="fixed", num_draft_tokens=3, eagle_head=str(folder))
    assert not make_drafter(spec, target, None, sampled).tree  # sampling drafts a chain
    assert len(collect(spec_events(target, None, PROMPTS[0], sampled, spec)).new_token_ids) == 12


def test_a_shared_lm_head_is_the_targets_rows_and_the_parameter_count(tmp_path):
    model = llama(1)
    head = random_head(model, shared_lm_head=True)
    save_head(head, tmp_path / "shared", torch.float32)
    from safetensors.torch import load_file

    assert "lm_head.weight" not in load_file(str(tmp_path / "shared" / "model.safetensors"))
    loaded_head = head_for(loaded(model), str(tmp_path / "shared"))
    assert torch.equal(loaded_head.lm_head.weight, model.get_output_embeddings().weight[head.draft_ids])
    full = random_head(model).config
    assert full.parameter_count() == sum(p.numel() for p in EagleHead(full).parameters())
    assert head.config.parameter_count() == full.parameter_count() - 64 * 48
    # Qwen2.5-Coder-1.5B: hidden 1536, 12 heads of 128, 2 key-value heads; MLP 2048, 32768 draft ids
    qwen = EagleConfig(1536, 12, 2, 128, 2048, 151936, 32768, default_hidden_layers(28))
    fc, attention, mlp, norms = 3 * 1536**2, 2 * 1536 * 128 * 16 + 1536**2, 3 * 1536 * 2048, 4 * 1536
    assert qwen.parameter_count() == fc + attention + mlp + norms + 1536 * 32768 == 25_171_968 + 50_331_648


# ----------------------------------------------------------------------------------------------------------------
# misfits and bad files, refused in one line


def _refused(target: LoadedModel, source, match: str) -> None:
    with pytest.raises(InputError, match=match) as error:
        head_for(target, None if source is None else str(source))
    assert error.value.field == "eagle_head" and "\n" not in str(error.value)


def test_heads_that_do_not_fit_the_target_are_refused_in_one_line(tmp_path):
    model = llama(1)
    head = random_head(model)
    save_head(head, tmp_path / "ours", torch.float32)
    _refused(loaded(llama(1, hidden=32)), tmp_path / "ours", "is for hidden size 64, the target's is 32")
    _refused(loaded(llama(1, vocab=120)), tmp_path / "ours", "vocabulary of 96 tokens, the target's has 120")
    write_speculators(head, tmp_path / "other", verifier="acme/Other-7B-Instruct")
    _refused(loaded(model), tmp_path / "other", "trained for acme/Other-7B-Instruct, the target is tiny-llama")
    write_speculators(head, tmp_path / "mistral", architectures=("MistralForCausalLM",))
    _refused(loaded(model), tmp_path / "mistral", "trained for a MistralForCausalLM, the target is a LlamaForCausalLM")
    write_speculators(head, tmp_path / "hub-name", verifier="someone/Tiny-Llama")  # the same name, another spelling
    assert head_for(loaded(model), str(tmp_path / "hub-name")).hidden_layers == head.hidden_layers
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    config["hidden_layers"] = [2, 9, 30]
    (tmp_path / "ours" / "config.json").write_text(json.dumps(config))
    _refused(loaded(model), tmp_path / "ours", r"layers \[2, 9, 30\], the target has 2 layers")
    # the mode refuses before any decoding
    with pytest.raises(InputError, match="hidden size 64"):
        make_drafter(SpecSettings(mode="eagle", eagle_head=str(tmp_path / "hub-name")), loaded(llama(1, hidden=32)),
                     None, GenerationSettings(max_new_tokens=4))


def test_a_head_written_in_int8_loads_as_its_per_row_rounded_weights_in_half_the_bytes(tmp_path):
    from safetensors.torch import load_file

    from specdemo.backends.formats import int8_rows

    model = llama(1)
    head = random_head(model, shared_lm_head=True)
    save_head(head, tmp_path / "bf16", torch.bfloat16)
    save_head(head, tmp_path / "int8", torch.int8)
    stored = load_file(str(tmp_path / "int8" / "model.safetensors"))
    assert stored["fc.weight"].dtype == torch.int8 and stored["fc.weight_scale"].dtype == torch.float32
    assert stored["norm.weight"].dtype == torch.bfloat16  # vectors stay bfloat16
    assert json.loads((tmp_path / "int8" / "config.json").read_text())["torch_dtype"] == "int8"
    matrices = sum(t.numel() for t in head.state_dict().values() if t.dim() == 2) - head.lm_head.weight.numel()
    sizes = {name: (tmp_path / name / "model.safetensors").stat().st_size for name in ("bf16", "int8")}
    assert sizes["bf16"] - sizes["int8"] >= matrices - 4 * sum(
        t.shape[0] for n, t in head.state_dict().items() if t.dim() == 2 and n != "lm_head.weight") - 4096
    back = head_for(loaded(model), str(tmp_path / "int8"))
    values, scale = int8_rows(head.midlayer.mlp.down_proj.weight)
    assert torch.equal(back.midlayer.mlp.down_proj.weight, values.float() * scale[:, None])
    assert torch.equal(back.draft_ids, head.draft_ids) and back.config == head.config


@pytest.mark.parametrize("damage", ["no-weights", "garbage", "no-config", "bad-config", "missing-tensor", "bad-d2t",
                                    "int8-without-scale", "int8-bad-scale"])
def test_bad_head_folders_are_refused_in_one_line(tmp_path, damage):
    model = llama(1)
    folder = tmp_path / "head"
    save_head(random_head(model), folder, torch.int8 if damage.startswith("int8") else torch.float32)
    weights = folder / "model.safetensors"
    from safetensors.torch import load_file, save_file

    if damage == "no-weights":
        weights.unlink()
    elif damage == "garbage":
        weights.write_bytes(b"not a tensor file")
    elif damage == "no-config":
        (folder / "config.json").unlink()
    elif damage == "bad-config":
        (folder / "config.json").write_text('{"hidden_size": 64}')
    elif damage == "missing-tensor":
        state = load_file(str(weights))
        del state["midlayer.self_attn.q_proj.weight"]
        save_file(state, str(weights))
    elif damage == "bad-d2t":
        state = load_file(str(weights))
        state["d2t"] = torch.zeros_like(state["d2t"]) + 90  # draft ids past the target's vocabulary
        save_file(state, str(weights))
    else:
        state = load_file(str(weights))
        if damage == "int8-without-scale":
            del state["fc.weight_scale"]
        else:
            state["fc.weight_scale"] = state["fc.weight_scale"][:3]
        save_file(state, str(weights))
    _refused(loaded(model), folder, "int8 without one floating-point scale per row" if damage.startswith("int8")
             else ".")


def test_hub_ids_missing_folders_and_shipped_heads(tmp_path, monkeypatch):
    model = llama(1)

    def offline(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co'\nto load the files")

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    _refused(loaded(model), "acme/eagle3-head", "cannot fetch the EAGLE head acme/eagle3-head from the Hugging Face "
             "Hub: We couldn't connect")
    _refused(loaded(model), tmp_path / "nowhere", "neither a folder nor a Hub id")
    offline_target = loaded(model, "offline:qwen2.5-coder-1.5b")
    monkeypatch.delitem(eagle3_checkpoint.SHIPPED_HEADS, "qwen2.5-coder-1.5b", raising=False)  # as for a target without one
    _refused(offline_target, None, "no EAGLE head ships for offline:qwen2.5-coder-1.5b yet: name one with "
             "--eagle-head PATH, or train one with python -m specdemo.training.eagle")
    with pytest.raises(InputError, match="no EAGLE head ships"):
        make_drafter(SpecSettings(mode="eagle-chain"), offline_target, None, GenerationSettings(max_new_tokens=4))
    digest = save_head(random_head(model), tmp_path / "shipped", torch.float32)
    monkeypatch.setitem(eagle3_checkpoint.SHIPPED_HEADS, "qwen2.5-coder-1.5b", (tmp_path / "shipped", "0" * 64))
    _refused(offline_target, None, "damaged or replaced")
    monkeypatch.setitem(eagle3_checkpoint.SHIPPED_HEADS, "qwen2.5-coder-1.5b", (tmp_path / "shipped", digest))
    assert head_for(loaded(model, "offline:qwen2.5-coder-1.5b"), None).config.draft_vocab_size == 48
    (tmp_path / "mlp").mkdir()
    (tmp_path / "mlp" / "config.json").write_text(json.dumps({"speculators_model_type": "mlp_speculator"}))
    with pytest.raises(EagleLoadError, match="speculators 'mlp_speculator' model, not an EAGLE-3 head"):
        load_head(tmp_path / "mlp", target_facts(loaded(model)))


def test_the_bench_runs_the_eagle_modes(tmp_path, monkeypatch, capsys):
    from specdemo import bench
    from specdemo.backends.loading import clear_model_cache

    monkeypatch.setenv("SPECDEMO_CACHE", str(tmp_path / "cache"))  # calibrations of tiny models stay here
    target, _ = save_tiny_pair(tmp_path / "pair")
    head = save_tiny_eagle_head(tmp_path / "head")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "c1", "category": "coding", "prompt": "def add(a, b):\n    return a + b"}))
    out = tmp_path / "out.json"
    clear_model_cache()
    common = ["--target", target, "--prompts", str(prompts), "--dtype", "float32", "--device", "cpu",
              "--max-new-tokens", "12", "--warmup", "0", "--quiet", "--calibration", "off"]
    assert bench.main(common + ["--modes", "plain,eagle,eagle-chain", "--eagle-head", head, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert {row["mode"] for row in report["results"]} == {"plain", "eagle", "eagle-chain"}
    assert all(row["identical"] for row in report["results"])
    assert "eagle-chain" in capsys.readouterr().out
    for mode in ("eagle", "eagle-chain"):  # the head as it ran: float32 beside a float32 target, nothing timed
        facts = report["methods"][mode]
        assert facts["eagle_head"] == head and facts["head_format"] == "float32"
        assert facts["head_step_seconds"] is None and facts["hidden_layers"] and facts["draft_vocab_size"] > 0
    assert "plain" not in report["methods"]
    clear_model_cache()
    assert bench.main(common + ["--modes", "eagle"]) == 2
    assert "no EAGLE head ships for" in capsys.readouterr().err

    # the head scored on the run's own plain output, per category, as the trainer scores held-out text
    from specdemo.training import head_accuracy

    scored = tmp_path / "scored.json"
    assert head_accuracy.main([str(out), "--eagle-head", head, "--json", str(scored)]) == 0
    printed = capsys.readouterr().out
    assert "coding" in printed and "top-1 by draft step" in printed
    figures = json.loads(scored.read_text())
    assert figures["head_format"] == "float32" and figures["dtype"] == "float32"
    assert set(figures["by_category"]) == {"coding"} and figures["all"]["answers"] == 1
    assert len(figures["all"]["top1_per_step"]) == head_accuracy.STEPS
    assert figures["all"]["positions"] > 0 and 0.0 <= figures["all"]["inside_draft_vocab"] <= 1.0
    assert figures["by_category"]["coding"] == figures["all"]  # one category: the same figures
    first = figures["all"]["first_draft"]  # the head's first draft scored at the same positions as step 1
    assert first["head"] == figures["all"]["top1_per_step"][0]
    assert max(first["head"], first["prompt_lookup"]) <= first["either"] <= 1.0 and "lookup  either" in printed
    # files that are not results, or results without a plain run: one line, exit 2
    for text, message in (("{", "cannot read"), ("[]", "not a bench results file"),
                          (json.dumps({"config": {}, "results": []}), "no plain run"),
                          (json.dumps({"config": {"target": "offline:nope"}, "results": [
                              {"mode": "plain", "prompt_ids": [1, 2], "new_token_ids": [3]}]}), "unknown offline model")):
        bad = tmp_path / "bad.json"
        bad.write_text(text)
        assert head_accuracy.main([str(bad)]) == 2
        assert message in capsys.readouterr().err
    assert head_accuracy.main([str(tmp_path / "missing.json")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_a_preset_with_a_published_head_passes_it_when_the_user_names_none():
    from specdemo.session.config import SessionConfig
    from specdemo.session.presets import PRESETS
    from specdemo.session.request import RaceRequest, check_request

    preset = PRESETS["llama-3.1-8b"]
    assert preset.target == "meta-llama/Llama-3.1-8B-Instruct"
    assert preset.eagle_head == "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"
    request = RaceRequest("hello", pair="llama-3.1-8b", mode="eagle")
    assert check_request(request, SessionConfig()).spec.eagle_head == preset.eagle_head
    assert check_request(request, SessionConfig(eagle_head="/my/head")).spec.eagle_head == "/my/head"
    custom = RaceRequest("hello", pair="llama-3.1-8b", target="someone/other-model", mode="eagle")
    assert check_request(custom, SessionConfig()).spec.eagle_head is None  # the preset's head is for its target
    assert check_request(RaceRequest("hello", pair="qwen2.5-7b", mode="eagle"), SessionConfig()).spec.eagle_head is None


def test_a_tree_is_verified_best_path_first():
    """The proposed tree is in depth-first order with each node's children best first, so its best path comes
    first (those nodes read a prefix of the verify pass's keys); every parent still comes before its children."""
    ranked_parents = [-1, -1, 0, 0, 1, 2, 3, 2]  # best first: node i's parent ranks above it
    order, parents = best_path_first(ranked_parents)
    assert parents == [-1, 0, 1, 1, 0, 4, -1, 6]  # renumbered in the new order
    assert sorted(order) == list(range(len(ranked_parents)))
    assert order == [0, 2, 5, 7, 3, 6, 1, 4]  # the best root, its best child, that one's best child, then the rest
    place = {node: index for index, node in enumerate(order)}
    assert all(parent < 0 or place[parent] < place[node] for node, parent in enumerate(ranked_parents))
    assert best_path_first([]) == ([], []) and best_path_first([-1, 0, 1]) == ([0, 1, 2], [-1, 0, 1])


def test_a_branch_joins_a_tree_where_it_follows_it_and_grows_where_it_leaves():
    # the tree, best first: 10 (0.6) and 11 (0.3) at the root; 20 (0.4) after 10; 30 (0.2) after 20
    tokens, parents, probs = [10, 20, 11, 30], [-1, 0, -1, 1], [0.6, 0.4, 0.3, 0.2]
    merged = add_branch(tokens, parents, probs, [10, 21, 31], [0.5, 0.45, 0.35])
    # 10 is shared (0.6 kept), 21 after 10 (0.45) and 31 after it (0.35) are new nodes
    assert merged.tokens == [10, 21, 20, 31, 11, 30]
    assert merged.parents == [-1, 0, 0, 1, -1, 2]
    assert merged.probs == [0.6, 0.45, 0.4, 0.35, 0.3, 0.2]
    assert merged.sources == ["both", "branch", "tree", "branch", "tree", "tree"]
    assert merged.tree_nodes == [0, -1, 1, -1, 2, 3]
    assert merged.cut(3).tokens == [10, 21, 20] and merged.cut(3).parents == [-1, 0, 0]
    # a branch that is the tree's best path lifts it; one that starts elsewhere is a second root
    lifted = add_branch(tokens, parents, probs, [10, 20, 30], [0.9, 0.8, 0.7])
    assert lifted.tokens == [10, 20, 30, 11] and lifted.probs == [0.9, 0.8, 0.7, 0.3]
    assert lifted.sources == ["both", "both", "both", "tree"] and lifted.parents == [-1, 0, 1, -1]
    apart = add_branch(tokens, parents, probs, [12], [0.1])
    assert apart.tokens == tokens + [12] and apart.parents == parents + [-1]
    assert add_branch([], [], [], [5, 6], [0.3, 0.1]).parents == [-1, 0]  # a branch alone: a chain


def test_the_lookup_branch_drafts_beside_the_head_and_its_tokens_say_so(trained):
    """A head that is mostly wrong (random) beside a prompt that repeats itself: prompt lookup's branch is accepted
    whole stretches at a time, its tokens marked as drafted by it, and the output is still the target's."""
    model, _ = trained["llama"]
    head = random_head(model, seed=4)
    settings = GenerationSettings(max_new_tokens=24)
    prompt = PROMPTS[2]
    expected = plain_ids(model, prompt, settings)
    runs = {}
    for lookup in (False, True):
        policy, eagle_drafter = policy_and_drafter(model, head, True, 8, lookup=lookup)
        events = list(speculative_decode(CachedLM(model), eagle_drafter, policy, prompt + expected[:12], settings))
        runs[lookup] = events
    assert all(events[-1].new_token_ids == plain_ids(model, prompt + expected[:12], settings)
               for events in runs.values())
    sources = {token.source for event in runs[True] for token in event.tokens if token.kind == ACCEPTED}
    assert DRAFTED_BY_LOOKUP in sources or DRAFTED_BY_BOTH in sources
    assert sources <= {DRAFTED_BY_HEAD, DRAFTED_BY_LOOKUP, DRAFTED_BY_BOTH}
    assert all(token.source is None for event in runs[False] for token in event.tokens + event.rejected)
    assert runs[True][-1].counters.accepted > runs[False][-1].counters.accepted
    shown = next(token for event in runs[True] for token in event.tokens if token.source == DRAFTED_BY_LOOKUP)
    assert "drafted by prompt lookup" in token_title(shown)  # the hover says who drafted it
