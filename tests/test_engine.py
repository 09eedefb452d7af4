"""Greedy speculative output equals the target alone, token for token (float32), in every configuration."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny import VOCAB, gpt2, llama, qwen2, reference_greedy

from specdemo.backends.formats import ROW_WISE_MAX_QUERIES
from specdemo.backends.transformers_lm import CachedLM
from specdemo.core.events import ACCEPTED, BONUS, CORRECTED, PLAIN
from specdemo.core.loop import collect, plain_decode, speculative_decode
from specdemo.core.settings import (
    MAX_NUM_DRAFT_TOKENS,
    GenerationSettings,
    SamplingSettings,
)
from specdemo.core.tree import chain_parents, is_chain
from specdemo.methods.draft_length import (
    CostAwareDraftLength,
    FixedDraftLength,
    HeuristicDraftLength,
    make_policy,
)
from specdemo.methods.draft_model import DraftModelDrafter
from specdemo.methods.ngram import NgramDrafter

PROMPTS = [
    [5, 7, 9, 11, 5, 7, 9, 3, 2, 1],
    [1],
    [40, 41, 42, 43, 44, 45, 40, 41, 42, 43, 44, 45, 40, 41],
]
GREEDY = SamplingSettings()


def _targets():
    return {"llama": llama(1), "qwen2": qwen2(3), "gpt2": gpt2(5)}


TARGETS = _targets()


def _drafters(name: str, target):
    small = {"llama": llama(2, layers=1), "qwen2": qwen2(4, layers=1), "gpt2": gpt2(6, layers=1)}[name]
    return {
        "same-model": DraftModelDrafter(target, GREEDY, VOCAB, head_tokens=0, int8=False),
        "small-model": DraftModelDrafter(small, GREEDY, VOCAB),
        "restricted-head": DraftModelDrafter(target, GREEDY, VOCAB, head_tokens=40),
        "random-model": DraftModelDrafter(llama(99, layers=1), GREEDY, VOCAB),
        "ngram": NgramDrafter(1, 3),
        "ngram-recent": NgramDrafter(1, 3, "recent"),
        "ngram-first": NgramDrafter(2, 4, "first"),
    }


CASES = [("llama", "fixed", 1), ("llama", "fixed", 4), ("llama", "heuristic", None), ("qwen2", "fixed", 2),
         ("qwen2", "adaptive", None), ("gpt2", "fixed", 3), ("gpt2", "fixed", 7)]


@pytest.mark.parametrize("name,schedule,k", CASES)
def test_greedy_equals_generate(name: str, schedule: str, k):
    target = TARGETS[name]
    settings = GenerationSettings(max_new_tokens=24)
    for prompt in PROMPTS:
        expected = reference_greedy(target, prompt, 24)
        assert collect(plain_decode(CachedLM(target), prompt, settings)).new_token_ids == expected
        for label, drafter in _drafters(name, target).items():
            final = collect(speculative_decode(CachedLM(target), drafter, make_policy(schedule, k), prompt, settings))
            assert final.new_token_ids == expected, (name, schedule, k, label, prompt)
            assert final.finish_reason == "length"


@pytest.mark.parametrize("int8", [False, True])
def test_restricted_head_scores_frequent_and_prompt_ids_and_is_built_once(int8: bool):
    import torch

    target = TARGETS["qwen2"]
    prompt = [3, 70, 7, 90]  # 70 and 90 lie beyond the 40 frequent ids
    drafters = [DraftModelDrafter(target, GREEDY, VOCAB, head_tokens=40, int8=int8) for _ in range(2)]
    for drafter in drafters:
        drafter.start(prompt)
    assert drafters[0]._frequent_head is drafters[1]._frequent_head  # one per model, not one per request
    logits, id_map = drafters[0]._logits(torch.tensor(prompt))
    assert sorted(id_map.tolist()) == list(range(40)) + [70, 90]
    full = drafters[1].lm.forward(torch.tensor(prompt), all_logits=False)[-1]  # its own, untouched cache
    tolerance = 0.05 * float(full.abs().max()) if int8 else 1e-5
    assert torch.allclose(logits, full[id_map], atol=tolerance)


def test_identical_draft_accepts_everything_and_random_draft_almost_nothing():
    target = TARGETS["llama"]
    settings = GenerationSettings(max_new_tokens=33)
    same = collect(speculative_decode(CachedLM(target), DraftModelDrafter(target, GREEDY, VOCAB, head_tokens=0, int8=False), FixedDraftLength(4), PROMPTS[0], settings))
    assert same.counters.accepted == same.counters.drafted > 0
    assert same.counters.target_passes == 1 + 32 // 5 + (1 if 32 % 5 else 0)
    rand = collect(speculative_decode(CachedLM(target), DraftModelDrafter(llama(1234, layers=1), GREEDY, VOCAB), FixedDraftLength(4), PROMPTS[0], settings))
    assert rand.counters.accepted <= rand.counters.drafted // 4
    assert rand.new_token_ids == same.new_token_ids


@pytest.mark.parametrize("limit", [1, 2, 3, 4, 5, 6, 9])
@pytest.mark.parametrize("k", [1, 3, 4])
def test_exactly_max_new_tokens(limit: int, k: int):
    target = TARGETS["qwen2"]
    settings = GenerationSettings(max_new_tokens=limit)
    expected = reference_greedy(target, PROMPTS[0], limit)
    for drafter in (DraftModelDrafter(target, GREEDY, VOCAB, head_tokens=0, int8=False), NgramDrafter()):
        final = collect(speculative_decode(CachedLM(target), drafter, FixedDraftLength(k), PROMPTS[0], settings))
        assert final.new_token_ids == expected
        assert len(final.new_token_ids) == limit


def test_eos_inside_a_draft_stops_there():
    target = TARGETS["llama"]
    prompt = PROMPTS[0]
    free_run = reference_greedy(target, prompt, 30)
    # choose as EOS a token that first appears in the middle of the output, so it arrives inside accepted drafts
    for position in (3, 7, 12):
        eos = free_run[position]
        expected = reference_greedy(target, prompt, 30, eos=[eos])
        assert expected[-1] == eos and len(expected) <= 30
        settings = GenerationSettings(max_new_tokens=30)
        for k in (2, 5, 8):
            drafter = DraftModelDrafter(target, GREEDY, VOCAB, head_tokens=0, int8=False)  # everything accepted: EOS mid-draft
            final = collect(speculative_decode(CachedLM(target), drafter, FixedDraftLength(k), prompt, settings, [eos]))
            assert final.new_token_ids == expected
            assert final.finish_reason == "eos"
        plain = collect(plain_decode(CachedLM(target), prompt, settings, [eos]))
        assert plain.new_token_ids == expected


def test_token_kinds_and_counters_are_consistent():
    target = TARGETS["gpt2"]
    settings = GenerationSettings(max_new_tokens=40)
    drafter = DraftModelDrafter(gpt2(6, layers=1), GREEDY, VOCAB)
    events = list(speculative_decode(CachedLM(target), drafter, FixedDraftLength(3), PROMPTS[2], settings))
    tokens = [t for e in events for t in e.tokens]
    assert [t.id for t in tokens] == events[-1].new_token_ids
    assert tokens[0].kind == PLAIN  # the prefill's token
    for event in events[1:]:
        kinds = [t.kind for t in event.tokens]
        assert kinds[: event.accepted] == [ACCEPTED] * event.accepted
        if not event.finished:
            assert kinds[-1] == (BONUS if event.accepted == event.drafted else CORRECTED)
        assert len(event.rejected) == event.drafted - event.accepted
        assert all(0.0 <= (t.target_prob or 0.0) <= 1.0 for t in event.tokens)
    last = events[-1].counters
    assert last.accepted == sum(e.accepted for e in events) and last.drafted == sum(e.drafted for e in events)
    assert last.target_passes == len(events)
    assert last.new_tokens == 40


def test_cache_is_rolled_back_not_rebuilt():
    target = TARGETS["llama"]
    lm = CachedLM(target)
    calls = []
    original = lm.run

    def spy(ids, all_logits=True, parents=None, with_hidden=True):
        calls.append(int(ids.numel()))
        return original(ids, all_logits, parents, with_hidden)

    lm.run = spy
    drafter = DraftModelDrafter(llama(77, layers=1), GREEDY, VOCAB)
    collect(speculative_decode(lm, drafter, FixedDraftLength(4), PROMPTS[0], GenerationSettings(max_new_tokens=20)))
    assert calls[0] == len(PROMPTS[0])  # the prompt is encoded once
    assert all(n <= 5 for n in calls[1:])  # later passes only see [last token + draft]


def test_bad_settings_are_refused():
    target = TARGETS["llama"]
    with pytest.raises(ValueError, match="max_new_tokens"):
        collect(plain_decode(CachedLM(target), [1, 2], GenerationSettings(max_new_tokens=0)))
    with pytest.raises(ValueError, match="empty"):
        collect(plain_decode(CachedLM(target), [], GenerationSettings()))
    with pytest.raises(ValueError, match="num_draft_tokens must be"):
        make_policy("fixed", 0)
    with pytest.raises(ValueError, match="num_draft_tokens_schedule must be one of fixed, adaptive, heuristic"):
        make_policy("sometimes")
    with pytest.raises(ValueError, match="'fixed' needs num_draft_tokens"):
        make_policy("fixed")
    with pytest.raises(ValueError, match="top_p"):
        SamplingSettings(temperature=1.0, top_p=0.0).validate()
    assert make_policy("fixed", MAX_NUM_DRAFT_TOKENS).next_num_draft_tokens() == MAX_NUM_DRAFT_TOKENS
    with pytest.raises(ValueError, match=str(MAX_NUM_DRAFT_TOKENS)):
        make_policy("fixed", MAX_NUM_DRAFT_TOKENS + 1)
    # the longest draft comes from verification: with the last token it fits the int8 row-wise attention
    assert ROW_WISE_MAX_QUERIES == MAX_NUM_DRAFT_TOKENS + 1


def test_a_chain_is_the_tree_whose_parents_are_minus_one_zero_one():
    assert chain_parents(4) == [-1, 0, 1, 2] and chain_parents(0) == []
    assert is_chain(chain_parents(5)) and is_chain(None) and not is_chain([-1, 0, 0])
    lm = CachedLM(TARGETS["llama"])
    ids = torch.tensor(PROMPTS[0])
    lm.reset()
    causal = lm.run(ids, with_hidden=False).logits
    lm.reset()
    as_tree = lm.run(ids, parents=chain_parents(len(ids)), with_hidden=False).logits
    assert torch.equal(causal, as_tree) and lm.length == len(ids)


class _NeedsHidden(NgramDrafter):
    """An n-gram drafter that says it reads the target's hidden states (and checks that it gets them)."""

    needs_hidden_states = True

    hidden_layers: tuple[int, ...] | None = None

    def start(self, prompt_ids, prefill=None) -> None:
        assert prefill is not None and prefill.hidden_states is not None
        super().start(prompt_ids, prefill)

    def feedback(self, result) -> None:
        assert result.target_pass is not None and result.target_pass.hidden_states is not None
        super().feedback(result)


@pytest.mark.parametrize("drafter", [NgramDrafter(1, 3), _NeedsHidden(1, 3)])
def test_the_target_computes_hidden_states_only_for_a_drafter_that_reads_them(drafter):
    target = TARGETS["llama"]
    lm = CachedLM(target)
    asked = []
    original = lm.run

    def spy(ids, all_logits=True, parents=None, with_hidden=True):
        asked.append(with_hidden)
        return original(ids, all_logits, parents, with_hidden)

    lm.run = spy
    settings = GenerationSettings(max_new_tokens=16)
    final = collect(speculative_decode(lm, drafter, FixedDraftLength(3), PROMPTS[0], settings))
    assert final.new_token_ids == reference_greedy(target, PROMPTS[0], 16)
    assert asked == [drafter.needs_hidden_states] * len(asked) and len(asked) == final.counters.target_passes


def test_both_decoders_read_the_time_from_an_injected_clock():
    """A clock one second further on at every reading: the prompt pass takes 1 s, each round 1 s of drafting and
    1 s of verifying (a plain step: 1 s), whatever the machine does."""
    target = TARGETS["qwen2"]
    settings = GenerationSettings(max_new_tokens=12)
    ticks = itertools.count()
    spec = collect(speculative_decode(CachedLM(target), NgramDrafter(), FixedDraftLength(3), PROMPTS[0], settings,
                                      clock=lambda: float(next(ticks))))
    counters = spec.counters
    assert counters.prefill_seconds == 1.0 and counters.rounds > 0
    assert counters.draft_seconds == counters.verify_seconds == float(counters.rounds)
    ticks = itertools.count()
    plain = collect(plain_decode(CachedLM(target), PROMPTS[0], settings, clock=lambda: float(next(ticks))))
    assert plain.counters.prefill_seconds == 1.0 and plain.counters.verify_seconds == float(plain.counters.rounds)
    assert plain.new_token_ids == spec.new_token_ids


def test_the_event_and_settings_layers_import_no_torch():
    """The render layer reads events and settings without torch (or gradio) being imported."""
    code = ("import sys, specdemo.core.events, specdemo.core.settings, specdemo.core.economics; "
            "print(sorted(m for m in ('torch', 'gradio', 'transformers') if m in sys.modules))")
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root)
    assert result.stdout.strip() == "[]"


def test_policies():
    heuristic = HeuristicDraftLength(num_draft_tokens=5)
    heuristic.update(5, 5, 0.1, 0.1)
    assert heuristic.next_num_draft_tokens() == 7
    heuristic.update(7, 2, 0.1, 0.1)
    assert heuristic.next_num_draft_tokens() == 6
    costly = CostAwareDraftLength()
    assert costly.next_num_draft_tokens() == 4
    costly.update(4, 0, 0.4, 0.1)  # slow drafts, all rejected
    assert costly.next_num_draft_tokens() == 0  # measures a plain step
    costly.update(0, 0, 0.0, 0.1)
    for _ in range(5):
        k = costly.next_num_draft_tokens()
        costly.update(k, 0, 0.1 * k, 0.1)
    assert costly.next_num_draft_tokens() == 0  # drafting does not pay: plain steps
    cheap = CostAwareDraftLength()
    for _ in range(20):
        k = cheap.next_num_draft_tokens()
        cheap.update(k, k, 0.001 * k, 0.1 + 0.001 * k)  # cheap drafts, all accepted
    assert cheap.next_num_draft_tokens() >= 8


def test_each_schedule_starts_at_the_first_rounds_draft_or_its_own():
    assert make_policy("adaptive").next_num_draft_tokens() == 4
    assert make_policy("adaptive", None, 9, free_drafts=True).next_num_draft_tokens() == 9  # free drafts: the cap
    assert make_policy("adaptive", 6, 12, free_drafts=True).next_num_draft_tokens() == 6
    assert make_policy("heuristic").next_num_draft_tokens() == 5
    heuristic = make_policy("heuristic", 2, 6)
    assert heuristic.next_num_draft_tokens() == 2 and heuristic.max_num_draft_tokens == 6
    assert make_policy("fixed", 3).next_num_draft_tokens() == 3


def test_adaptive_policy_goes_long_for_free_all_or_nothing_drafts():
    """N-gram-like drafts: free to make, accepted whole or rejected at the first token; verify cost flat in k."""
    policy = make_policy("adaptive", None, 12, free_drafts=True)
    assert policy.next_num_draft_tokens() == 12
    for round_index in range(30):
        k = policy.next_num_draft_tokens()
        accepted = k if round_index % 2 else 0
        policy.update(k, accepted, 1e-6 * k, 0.1)
    assert policy.next_num_draft_tokens() >= 10
    acceptance = policy.acceptance_at()
    assert acceptance[0] < 0.7 and min(acceptance[1:6]) > 0.8  # the first position decides, the rest follow


def paused_policy() -> CostAwareDraftLength:
    """An adaptive policy whose first drafts were slow and all rejected, then a plain step: it decodes plainly and
    probes now and then."""
    policy = CostAwareDraftLength()
    policy.update(4, 0, 0.2, 0.1)
    policy.update(0, 0, 0.0, 0.1)
    policy._rounds = 2
    return policy


def test_adaptive_policy_backs_off_probes_that_keep_failing():
    policy = paused_policy()
    probes = []
    for round_index in range(200):
        k = policy.next_num_draft_tokens()
        if k:
            probes.append(round_index)
        policy.update(k, 0, 0.05 * k, 0.1)  # drafts that would pay if accepted (free verification), never are
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps[:4] == [17, 33, 65, 65]  # 8, 16, 32, then at most 64 plain steps between probes (+1: the probe)
    for _ in range(6):  # drafts accepted whole: drafting pays again, and probing comes back to its normal pace
        policy.update(4, 4, 0.2, 0.1)
    assert policy.next_num_draft_tokens() > 0 and policy._probe_interval == policy.probe_every


def test_no_probe_near_the_end_of_a_run():
    """A probe decides whether to draft over the stretch ahead: with fewer tokens left than the plain steps it
    waited for, it could not pay for itself (measured: a probe three tokens before the end of a 128-token uag run
    cost 220 ms)."""
    policy = paused_policy()
    for _ in range(20):  # a probe is due after 8 plain steps, but never more than 8 tokens are left
        assert policy.next_num_draft_tokens(remaining=policy.probe_every) == 0
        policy.update(0, 0, 0.0, 0.1)
    assert policy.next_num_draft_tokens(remaining=policy.probe_every + 1) == 1


def test_a_draft_that_comes_back_empty_counts_as_rejected():
    """A universal drafter can work (catch up, draft) and still return no target token: that round counts as a
    rejected draft, so the next probe waits its turn instead of coming the very next round, and a policy that
    was drafting learns that it pays for nothing; a free lookup that found nothing is a plain step."""
    for work, expect_spent in ((0.02, True), (0.0, False)):
        policy = paused_policy()
        lengths = []
        for _ in range(40):
            k = policy.next_num_draft_tokens()
            lengths.append(k)
            policy.update(0, 0, work if k else 0.0, 0.1, catch_up_seconds=work / 2 if k else 0.0)
        probes = [index for index, k in enumerate(lengths) if k]
        if expect_spent:  # 8 plain steps, then 16, then 32 between probes
            assert probes[1] - probes[0] == 2 * policy.probe_every + 1, lengths
            assert policy._catch_up_per_token is not None
        else:  # the probe stays open until the drafter proposes something
            assert probes == list(range(probes[0], 40)), lengths
    drafting = CostAwareDraftLength()
    for _ in range(10):
        k = drafting.next_num_draft_tokens()
        drafting.update(k, k, 0.001 * k, 0.1 + 0.001 * k)  # cheap drafts, all accepted
    assert drafting.next_num_draft_tokens() > 0
    for _ in range(30):  # then the drafter works and proposes nothing, round after round
        k = drafting.next_num_draft_tokens()
        drafting.update(0, 0, 0.02 if k else 0.0, 0.1)
    assert drafting.next_num_draft_tokens() == 0 and drafting.acceptance < 0.5


def test_verify_cost_fit_shrugs_off_one_noisy_length():
    policy = CostAwareDraftLength()
    for length, seconds in [(1, 0.10), (3, 0.10), (5, 0.10), (7, 0.30), (9, 0.10), (13, 0.11)]:
        for _ in range(3):
            policy.update(length - 1, 0, 0.0, seconds)
    assert policy._verify_cost(1) == pytest.approx(0.10)
    assert policy._verify_cost(11) < 0.16  # one slow measurement at 7 does not make every long pass look dear


def test_a_model_that_names_its_cache_past_key_values_gets_it_there():
    """transformers before 5.24 calls the forward's cache argument ``past_key_values``; an unknown keyword would be
    swallowed by ``**kwargs`` and every pass would start from nothing."""
    from transformers import LlamaForCausalLM

    from specdemo.backends.transformers_lm import cache_keyword

    class OlderLlama(LlamaForCausalLM):
        def forward(self, input_ids=None, past_key_values=None, **kwargs):
            return super().forward(input_ids=input_ids, cache=past_key_values, **kwargs)

    current = TARGETS["llama"]
    older = OlderLlama(current.config).eval()
    older.load_state_dict(current.state_dict())
    assert cache_keyword(current) == "cache" and cache_keyword(older) == "past_key_values"
    settings = GenerationSettings(max_new_tokens=12)
    for prompt in PROMPTS:
        expected = reference_greedy(current, prompt, 12)
        assert collect(plain_decode(CachedLM(older), prompt, settings)).new_token_ids == expected
        policy = make_policy("fixed", 4)
        final = collect(speculative_decode(CachedLM(older), NgramDrafter(1, 3), policy, prompt, settings))
        assert final.new_token_ids == expected
