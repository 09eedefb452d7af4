"""The method registry: each mode is one descriptor in one file, and a new method needs nothing but its file."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import pytest
import torch
from tiny import llama

import specdemo.methods as methods
from specdemo.backends.loading import LoadedModel, LoadSettings
from specdemo.core.errors import InputError
from specdemo.core.loop import collect
from specdemo.core.protocol import Proposal
from specdemo.core.settings import GenerationSettings
from specdemo.methods import METHODS, SpecSettings, get_method, make_drafter
from specdemo.methods.base import BuildContext, Method
from specdemo.session.pipeline import plain_events, spec_events


def test_every_mode_is_one_descriptor_with_its_options():
    assert list(METHODS) == ["draft", "eagle", "eagle-chain", "medusa", "medusa-chain", "ngram", "suffix",
                             "uag"]  # in the order of the file names
    for name, method in METHODS.items():
        assert method.name == name and method.label and callable(method.build)
        assert dataclasses.is_dataclass(method.options), name
        method.options().validate()  # the defaults are valid
        # every option a method reads is a field of SpecSettings, under the same name
        assert {f.name for f in dataclasses.fields(method.options)} <= {f.name for f in dataclasses.fields(SpecSettings)}
    assert [n for n, m in METHODS.items() if m.needs_draft_model] == ["draft", "uag"]
    assert [n for n, m in METHODS.items() if m.drafts_for_free] == ["eagle", "eagle-chain", "medusa", "medusa-chain",
                                                                     "ngram", "suffix"]
    assert [n for n, m in METHODS.items() if m.proposes_trees] == ["eagle", "medusa", "suffix"]
    assert [n for n, m in METHODS.items() if m.drafts_from_memory] == ["suffix"]
    assert [n for n, m in METHODS.items() if m.needs_hidden_states] == ["eagle", "eagle-chain", "medusa", "medusa-chain"]
    assert [n for n, m in METHODS.items() if m.other_tokenizer] == ["uag"]


def test_unknown_modes_and_bad_options_are_refused_in_one_line():
    with pytest.raises(InputError, match="unknown mode 'nope'; choose one of: draft, eagle, eagle-chain, medusa, medusa-chain, ngram, suffix, uag"):
        get_method("nope")
    with pytest.raises(InputError, match="n-gram sizes"):
        SpecSettings(mode="draft", ngram_min=3, ngram_max=2).validate()  # every knob is checked, whatever the mode
    with pytest.raises(InputError, match="between 1 and 64"):
        SpecSettings(max_num_draft_tokens=65).validate()
    assert SpecSettings(mode="ngram", ngram_max=6).options() == methods.ngram.NgramOptions(ngram_max=6)


def test_the_draft_length_is_a_schedule_and_a_number_of_tokens():
    """The schedule names the policy; the number is every round's draft (fixed) or the first round's (the others),
    at most the cap there; each refusal one line naming the setting."""
    SpecSettings().validate()  # adaptive from its own start
    SpecSettings(num_draft_tokens_schedule="fixed", num_draft_tokens=20).validate()  # a fixed k is not capped
    SpecSettings(num_draft_tokens_schedule="heuristic", num_draft_tokens=3).validate()
    for settings, message in [
        (SpecSettings(num_draft_tokens_schedule="fixed"), "'fixed' needs num_draft_tokens"),
        (SpecSettings(num_draft_tokens_schedule="often"), "num_draft_tokens_schedule must be one of fixed, adaptive"),
        (SpecSettings(num_draft_tokens_schedule="fixed", num_draft_tokens=0), "num_draft_tokens must be a whole"),
        (SpecSettings(num_draft_tokens=13), "must be at most max_num_draft_tokens (12) with the adaptive schedule"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)) as caught:
            settings.validate()
        assert "\n" not in str(caught.value)


class _RepeatLast:
    """A toy drafter: proposes the context's last token again, as many times as asked."""

    name = "repeat"
    needs_hidden_states = False
    hidden_layers: tuple[int, ...] | None = None

    def start(self, prompt_ids, prefill=None) -> None:
        pass

    def propose(self, context, num_draft_tokens: int) -> Proposal:
        return Proposal([int(context[-1])] * num_draft_tokens)

    def feedback(self, result) -> None:
        pass


@dataclass(frozen=True)
class _RepeatOptions:
    def validate(self) -> None:
        pass


def test_a_new_method_is_one_descriptor(monkeypatch):
    """Registering one Method is all a new method needs: settings, validation, the drafter and the decoding loop
    pick it up, and its greedy output is the target's own."""
    repeat = Method(name="repeat", label="repeat the last token", build=lambda context: _RepeatLast(),
                    options=_RepeatOptions, drafts_for_free=True)
    monkeypatch.setitem(METHODS, "repeat", repeat)
    target = LoadedModel("tiny", llama(3), None, torch.device("cpu"), torch.float32, LoadSettings(dtype="float32"))
    spec = SpecSettings(mode="repeat", num_draft_tokens_schedule="fixed", num_draft_tokens=3)
    spec.validate()
    settings = GenerationSettings(max_new_tokens=24)
    assert isinstance(make_drafter(spec, target, None, settings), _RepeatLast)
    prompt = [1, 5, 9, 5, 9, 5]
    plain = collect(plain_events(target, prompt, settings))
    spec_run = collect(spec_events(target, None, prompt, settings, spec))
    assert spec_run.new_token_ids == plain.new_token_ids
    assert spec_run.counters.drafted > 0


def test_a_mode_that_needs_a_draft_model_refuses_to_run_without_one():
    target = LoadedModel("tiny", llama(3), None, torch.device("cpu"), torch.float32, LoadSettings(dtype="float32"))
    with pytest.raises(InputError, match="needs a draft model"):
        make_drafter(SpecSettings(mode="draft"), target, None, GenerationSettings(max_new_tokens=4))


def test_build_context_carries_what_a_drafter_may_use():
    assert [f.name for f in dataclasses.fields(BuildContext)] == ["target", "draft", "settings", "options", "policy",
                                                            "memory", "clock", "passes"]
