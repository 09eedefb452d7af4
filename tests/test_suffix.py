"""Suffix decoding: trees over the prompt and over earlier answers, exact in every format, a bounded memory per
visitor, and where each drafted token came from."""

from __future__ import annotations

import sys
from dataclasses import replace

import pytest
import torch
from tiny import llama, qwen2

import tiny_app
from specdemo.app.handlers import Handlers, answer_of, visitor_of
from specdemo.backends.formats import W8A8, to_int8_format
from specdemo.backends.loading import LoadedModel, LoadSettings
from specdemo.backends.suffix_trees import DraftLimits, PromptTree, SuffixMemory, suffix_trees_available
from specdemo.core.errors import InputError
from specdemo.core.events import EARLIER_ANSWER, TokenEvent, answer_number, drafted_from_answer, source_kind
from specdemo.core.acceptance import Verdict
from specdemo.core.loop import collect
from specdemo.core.protocol import RoundResult
from specdemo.core.settings import GenerationSettings
from specdemo.methods import METHODS, SpecSettings
from specdemo.methods.suffix import SuffixDrafter
from specdemo.render.views import token_title
from specdemo.session.memories import MemoryLimits, SuffixMemories
from specdemo.session.pipeline import plain_events, spec_events

pytestmark = pytest.mark.skipif(
    not suffix_trees_available(),
    reason="the suffix trees need arctic-inference: python3 -m pip install --no-build-isolation --no-deps -r "
    "requirements-suffix.txt",
)

APP_PROMPT = "hello world the cat sat on the mat and the dog sat on the mat"
REPEATING = [5, 6, 7, 8, 9, 5, 6, 7, 8, 1, 2, 3] * 3
PROMPTS = [REPEATING, [11, 12, 13, 14, 15, 16], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6]]


def loaded(model, fmt: str = "float32") -> LoadedModel:
    return LoadedModel("tiny", model, None, torch.device("cpu"), torch.float32, LoadSettings(dtype=fmt))


def run(target: LoadedModel, prompt, settings, spec=None, memory=None, eos=None):
    if eos is not None:
        target.model.generation_config.eos_token_id = eos
    if spec is None:
        return collect(plain_events(target, prompt, settings))
    return collect(spec_events(target, None, prompt, settings, spec, None, memory))


@pytest.fixture(scope="module")
def targets() -> dict[str, LoadedModel]:
    return {
        "llama": loaded(llama(0)),
        "qwen2": loaded(qwen2(1)),
        "llama-w8a8": loaded(to_int8_format(llama(2), W8A8), "w8a8"),
    }


@pytest.mark.parametrize("name", ["llama", "qwen2", "llama-w8a8"])
@pytest.mark.parametrize("schedule", [("adaptive", None), ("fixed", 1), ("fixed", 5), ("heuristic", None)],
                         ids=lambda s: f"{s[0]}{s[1] or ''}")
def test_greedy_output_is_the_targets_from_the_prompt_and_from_earlier_answers(targets, name, schedule):
    """Memory off, then every earlier answer remembered (this prompt's own included, as a race run twice): the
    output is plain decoding's, token for token, and the memory drafts once it holds the answer."""
    target = targets[name]
    spec = SpecSettings(mode="suffix", num_draft_tokens_schedule=schedule[0], num_draft_tokens=schedule[1])
    settings = GenerationSettings(max_new_tokens=48)
    memory = SuffixMemory()
    for prompt in PROMPTS * 2:
        reference = run(target, prompt, settings).new_token_ids
        alone = run(target, prompt, settings, spec)
        remembered = run(target, prompt, settings, spec, memory)
        assert alone.new_token_ids == reference and remembered.new_token_ids == reference
        assert set(alone.counters.accepted_by_source) <= {"prompt", "output", "lookup"}
        trees_only = run(target, prompt, settings, replace(spec, suffix_lookup=False), memory)
        assert trees_only.new_token_ids == reference and "lookup" not in trees_only.counters.accepted_by_source
        memory.remember(reference)
    # the second time round every prompt's own answer is remembered: most accepted tokens come from it (with drafts
    # of a fixed size: the adaptive schedule cuts its trees by measured pass times, which a busy machine moves)
    if schedule[0] != "adaptive":
        counters = remembered.counters
        assert counters.accepted > 20
        assert counters.accepted_by_source.get(EARLIER_ANSWER, 0) >= 0.8 * counters.accepted
        assert counters.accepted >= alone.counters.accepted


@pytest.mark.parametrize("limit", [1, 2, 3, 7, 13, 30])
def test_every_length_limit_and_eos_inside_a_path_end_where_plain_does(targets, limit):
    target = loaded(llama(0))
    settings = GenerationSettings(max_new_tokens=limit)
    memory = SuffixMemory()
    reference = run(target, REPEATING, GenerationSettings(max_new_tokens=40)).new_token_ids
    memory.remember(reference)  # the whole answer is in the memory: drafts run over every boundary
    spec = SpecSettings(mode="suffix")
    assert run(target, REPEATING, settings, spec, memory).new_token_ids == reference[:limit]
    eos = reference[min(limit, len(reference) - 1)]  # an EOS that a drafted path holds
    plain = run(target, REPEATING, GenerationSettings(max_new_tokens=40), eos=[eos])
    spec_run = run(target, REPEATING, GenerationSettings(max_new_tokens=40), spec, memory, eos=[eos])
    assert spec_run.new_token_ids == plain.new_token_ids and spec_run.finish_reason == plain.finish_reason == "eos"
    target.model.generation_config.eos_token_id = None


def test_a_tree_drafts_the_likeliest_continuations_sized_by_the_match():
    tree = PromptTree(max_depth=8)
    tree.start([1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3, 4])
    draft = tree.speculate([9, 1, 2, 3], DraftLimits(num_draft_tokens=8, factor=1.0))
    assert draft.match_len == 3 and draft.tokens[0] == 4  # (1 2 3) went on with 4 twice, with 5 once
    assert 5 in draft.tokens and draft.parents[draft.tokens.index(5)] == -1  # the other continuation: a root
    assert all(parent < node for node, parent in enumerate(draft.parents))
    assert draft.probs == sorted(draft.probs, reverse=True) and draft.probs[0] == pytest.approx(2 / 3)
    assert len(tree.speculate([9, 1, 2, 3], DraftLimits(num_draft_tokens=8, factor=0.5)).tokens) == 1  # 3 x 0.5
    chain = tree.speculate([9, 1, 2, 3], DraftLimits(num_draft_tokens=8, tree=False))
    assert chain.parents == list(range(-1, len(chain.tokens) - 1))
    assert tree.from_prompt((2, 3, 5)) and not tree.from_prompt((7, 7, 7)) and not tree.from_prompt((4, 1 << 8))


def test_the_memory_names_the_answer_a_draft_came_from_and_keeps_its_bounds():
    memory = SuffixMemory(max_answers=2, max_tokens=12)
    assert memory.remember([]) is None and memory.answers == 0
    assert memory.remember([1, 2, 3, 4, 5]) == 1
    assert memory.remember([7, 8, 9, 10]) == 2
    draft = memory.speculate([0, 1, 2], DraftLimits(8, factor=2.0))
    numbers = memory.answers_holding(draft, [0, 1, 2], range(2))
    assert draft.tokens[:2] == [3, 4] and [numbers[0], numbers[1]] == [1, 1]
    assert memory.remember([20, 21, 22, 23]) == 3  # over two answers: the oldest is forgotten
    assert memory.answers == 2 and memory.tokens == 8
    assert memory.speculate([0, 1, 2], DraftLimits(8, factor=2.0)).tokens == []
    later = memory.speculate([0, 7, 8], DraftLimits(8, factor=2.0))
    assert memory.answers_holding(later, [0, 7, 8], [0])[0] == 2
    memory.remember(list(range(100, 130)))  # longer than the bound: its first 12 tokens, alone
    assert memory.describe() == {"answers": 1, "tokens": 12, "max_answers": 2, "max_tokens": 12}
    memory.forget()
    assert memory.answers == 0 and memory.speculate([100, 101], DraftLimits(4)).tokens == []
    assert memory.remember([1, 2]) == 5  # the numbering goes on: a hover never names two answers alike


def test_a_memory_whose_drafts_fail_loses_to_the_races_own_tree():
    """The memory's counts and the race's own are each judged by their own record: a memory that matches longer
    but keeps drafting what the target does not write stops winning over the race's own tree."""
    memory = SuffixMemory()
    memory.remember([50, 51, 1, 2, 30, 31, 32, 33])  # after (50 51 1 2) an earlier answer went on with 30 31 ...
    drafter = SuffixDrafter(memory, tree=True)
    prompt = [40, 1, 2, 3, 4, 41]  # ... where this race's prompt holds (1 2) then 3 4
    drafter.start(prompt)
    context = prompt + [50, 51, 1, 2]
    chosen = []
    for _ in range(8):
        proposal = drafter.propose(context, 4)
        chosen.append(proposal.sources[0])
        written = 2 if proposal.tokens[:2] == [3, 4] else 0  # the target writes 3 4
        drafter.feedback(RoundResult(proposal, Verdict(written, 41, tuple(range(written)))))
    assert chosen[0] == drafted_from_answer(1) and chosen[-4:] == ["prompt"] * 4


def test_where_a_token_came_from_is_in_the_hover_and_the_counters():
    assert answer_number(drafted_from_answer(3)) == 3 and answer_number("prompt") is None
    assert source_kind("answer 12") == EARLIER_ANSWER and source_kind("prompt") == "prompt"
    hover = token_title(TokenEvent(5, "x", "accepted", 2, source=drafted_from_answer(3)))
    assert "drafted from earlier answer 3" in hover
    assert "drafted from the prompt" in token_title(TokenEvent(5, "x", "accepted", 2, source="prompt"))
    assert "drafted from this answer so far" in token_title(TokenEvent(5, "x", "accepted", 2, source="output"))


def test_the_mode_is_a_tree_mode_that_drafts_from_memory_and_refuses_without_its_package(monkeypatch):
    method = METHODS["suffix"]
    assert method.proposes_trees and method.drafts_for_free and method.drafts_from_memory
    with pytest.raises(InputError, match="suffix_factor"):
        SpecSettings(mode="suffix", suffix_factor=0).validate()
    monkeypatch.setitem(sys.modules, "arctic_inference.suffix_decoding._C", None)  # the package is missing
    with pytest.raises(InputError, match="needs the arctic-inference package.*requirements-suffix.txt") as caught:
        method.check(None, None, SpecSettings(mode="suffix").options())
    assert "\n" not in str(caught.value)


def test_memories_are_per_visitor_and_bounded():
    memories = SuffixMemories(MemoryLimits(answers=2, tokens=100, visitors=2))
    memories.remember("a", [1, 2, 3])
    assert memories.describe("a")["answers"] == 1 and memories.describe("b")["answers"] == 0
    memories.get("b"), memories.get("c")  # a third visitor: the one idle longest is dropped
    assert len(memories) == 2 and memories.describe("a")["answers"] == 0
    memories.remember("c", [4, 5])
    memories.forget("c")
    assert memories.describe("c")["answers"] == 0 and len(memories) == 2
    memories.drop("c")
    assert len(memories) == 1


class _Request:
    def __init__(self, session_hash: str) -> None:
        self.session_hash = session_hash


def test_the_app_remembers_each_visitors_finished_races_for_them_alone():
    with tiny_app.one_thread():
        handlers = Handlers(tiny_app.config(hosted=True))
        first, second = _Request("visitor-1"), _Request("visitor-2")
        results = list(handlers.api(APP_PROMPT, pair="tiny", mode="suffix", max_new_tokens=24, request=first))
        final = results[-1]
        assert answer_of(final) == [token["id"] for token in final["spec"]["tokens"]]
        assert handlers.memories.describe("visitor-1")["answers"] == 1
        assert handlers.memories.describe("visitor-2")["answers"] == 0
        assert final["methods"]["suffix"]["memory"]["answers"] == 0  # what it held when the race began
        again = list(handlers.api(APP_PROMPT, pair="tiny", mode="suffix", max_new_tokens=24, request=first))[-1]
        assert again["spec"]["text"] == final["spec"]["text"]
        sources = {token["source"] for token in again["spec"]["tokens"] if token["kind"] == "accepted"}
        assert "answer 1" in sources  # the second race drafts from the first one's answer
        other = list(handlers.api(APP_PROMPT, pair="tiny", mode="suffix", max_new_tokens=24, request=second))[-1]
        assert not any((token["source"] or "").startswith("answer") for token in other["spec"]["tokens"])
        assert "2 of at most 16 answers" in handlers.memory_text(first)  # a hosted app's bound
        assert "0 of at most 16 answers" in handlers.forget_memory(first)
        handlers.drop_memory(second)
        assert handlers.memories.describe("visitor-2")["answers"] == 0
    assert visitor_of(None) == "local" and answer_of({"stopped": True}) is None
