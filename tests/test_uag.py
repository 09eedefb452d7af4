"""Universal assisted generation: a draft with a genuinely different tokenizer, exact output, seam handling."""

from __future__ import annotations

import functools

import pytest
import torch
from test_detok import (
    TRICKY,
    build_byte_level,
    build_metaspace,
    build_sentencepiece_byte_fallback,
)
from test_sampling import _chi_square_p
from tiny import llama, reference_greedy

from specdemo.backends.transformers_lm import CachedLM
from specdemo.core.loop import collect, speculative_decode
from specdemo.core.settings import GenerationSettings, SamplingSettings
from specdemo.methods.draft_length import FixedDraftLength, make_policy
from specdemo.methods.uag import (
    UniversalDrafter,
    reencode_after,
    shared_vocabulary,
    text_after,
    to_target_tokens,
    token_bytes,
)


@functools.lru_cache(maxsize=None)
def tokenizers_pair():
    return build_byte_level(), build_sentencepiece_byte_fallback()


def _models(target_tok, draft_tok):
    target = llama(31, layers=2, vocab=len(target_tok))
    draft = llama(32, layers=1, vocab=len(draft_tok))
    return target, draft


PROMPTS = [
    "def add(a, b):\n    return a + b\n",
    "naïve café — 日本語のテキスト 😀👍🏽",
    "    indented line with trailing spaces   \n",
    "The naïve café owner served crème brûlée",
]


@pytest.mark.parametrize("swap", [False, True], ids=["bytelevel-target", "sentencepiece-target"])
@pytest.mark.parametrize("schedule,k", [("fixed", 1), ("fixed", 3), ("fixed", 6), ("adaptive", None)])
def test_greedy_equals_target_alone(swap: bool, schedule: str, k):
    byte_level, sentencepiece = tokenizers_pair()
    target_tok, draft_tok = (sentencepiece, byte_level) if swap else (byte_level, sentencepiece)
    target, draft = _models(target_tok, draft_tok)
    settings = GenerationSettings(max_new_tokens=20)
    for text in PROMPTS:
        prompt = target_tok(text)["input_ids"]
        expected = reference_greedy(target, prompt, 20)
        drafter = UniversalDrafter(draft, draft_tok, target_tok, SamplingSettings(), [draft_tok.eos_token_id])
        final = collect(speculative_decode(CachedLM(target), drafter, make_policy(schedule, k), prompt, settings, (),
                                           target_tok))
        assert final.new_token_ids == expected, (text, schedule, k)
        assert final.text == target_tok.decode(expected, skip_special_tokens=True)


def test_eos_inside_a_draft_and_a_useful_draft():
    """A draft that writes the target's text verbatim: most proposals are accepted, EOS mid-draft stops the run."""
    byte_level, sentencepiece = tokenizers_pair()
    target = llama(33, layers=2, vocab=len(byte_level))
    prompt = byte_level("def add(a, b):")["input_ids"]
    free_run = reference_greedy(target, prompt, 24)
    eos = free_run[15]
    expected = reference_greedy(target, prompt, 24, eos=[eos])

    class Oracle(UniversalDrafter):
        """Drafts the target's own continuation, written through the draft tokenizer."""

        def propose(self, context, num_draft_tokens):
            if not self._sync_text(context):
                return super().propose(context, num_draft_tokens)
            produced = list(context[len(prompt) :])
            future = free_run[len(produced) : len(produced) + num_draft_tokens + 2]
            draft_ids = sentencepiece(byte_level.decode(future, skip_special_tokens=False), add_special_tokens=False)["input_ids"]
            tokens = to_target_tokens(byte_level, context, sentencepiece.decode(draft_ids))
            return super().propose(context, 0) if not tokens else type(super().propose(context, 0))(tokens[:num_draft_tokens], None)

    draft = llama(34, layers=1, vocab=len(sentencepiece))
    drafter = Oracle(draft, sentencepiece, byte_level, SamplingSettings(), [sentencepiece.eos_token_id])
    final = collect(speculative_decode(CachedLM(target), drafter, FixedDraftLength(5), prompt, GenerationSettings(24), [eos], byte_level))
    assert final.new_token_ids == expected
    assert final.finish_reason == "eos"
    assert final.counters.accepted > 0


def _first_two_tokens_check(intersection: bool) -> None:
    """Sampled output follows the target: chi-square on the distribution of the first two new tokens."""
    byte_level, sentencepiece = tokenizers_pair()
    target, draft = _models(byte_level, sentencepiece)
    prompt = byte_level("def add(a, b):")["input_ids"]
    sampling = SamplingSettings(temperature=1.0, top_k=3)
    from specdemo.core.acceptance import target_distribution

    with torch.inference_mode():
        first = target_distribution(target(input_ids=torch.tensor([prompt])).logits[0, -1], sampling)
        support = torch.nonzero(first).flatten().tolist()
        second = {t: target_distribution(target(input_ids=torch.tensor([prompt + [t]])).logits[0, -1], sampling) for t in support}
    exact = {(a, b): float(first[a] * second[a][b]) for a in support for b in torch.nonzero(second[a]).flatten().tolist()}
    counts: dict = {}
    trials = 600
    drafted = 0
    for seed in range(trials):
        settings = GenerationSettings(3, SamplingSettings(1.0, 3, 1.0, seed), collect_probs=False)
        drafter = UniversalDrafter(
            draft, sentencepiece, byte_level, settings.sampling, [], torch.Generator().manual_seed(seed),
            target_vocab_size=len(byte_level), intersection=intersection,
        )
        assert (drafter.shared is not None) == intersection
        final = collect(speculative_decode(CachedLM(target), drafter, FixedDraftLength(3), prompt, settings))
        drafted += final.counters.drafted
        ids = final.new_token_ids
        counts[(ids[0], ids[1])] = counts.get((ids[0], ids[1]), 0) + 1
    assert drafted > trials // 4  # drafts were made and verified, not skipped
    assert set(counts) <= set(exact)
    assert _chi_square_p(counts, exact, trials) > 1e-3


def test_sampling_stays_exact_with_point_mass_verification():
    _first_two_tokens_check(intersection=False)


def test_sampling_stays_exact_with_the_shared_vocabulary():
    _first_two_tokens_check(intersection=True)


def test_shared_vocabulary_matches_tokens_by_their_bytes():
    byte_level, sentencepiece = tokenizers_pair()
    mapping = shared_vocabulary(sentencepiece, byte_level)
    assert mapping
    special = set(sentencepiece.all_special_ids) | set(byte_level.all_special_ids)
    draft_bytes, target_bytes = token_bytes(sentencepiece), token_bytes(byte_level)
    for draft_id, target_id in mapping.items():
        assert draft_id not in special and target_id not in special
        assert draft_bytes[draft_id] == target_bytes[target_id]
    # space-led pieces are the same tokens in both conventions (Ġ and ▁)
    space_led = [
        (sentencepiece.convert_ids_to_tokens(d), byte_level.convert_ids_to_tokens(t))
        for d, t in mapping.items()
        if draft_bytes[d].startswith(b" ") and len(draft_bytes[d]) > 1
    ]
    assert space_led and all(a.startswith("\u2581") and b.startswith("\u0120") for a, b in space_led)
    # a byte-fallback piece stands for its byte
    newline = sentencepiece.convert_tokens_to_ids("<0x0A>")
    assert draft_bytes[newline] == b"\n"


def test_shared_draft_tokens_follow_the_probabilities_they_report():
    """Rejection sampling is exact for any draft distribution (test_sampling), provided each draft token is drawn
    from the row it reports: chi-square of the first proposed token against the reported row, in target ids."""
    byte_level, sentencepiece = tokenizers_pair()
    _, draft = _models(byte_level, sentencepiece)
    sampling = SamplingSettings(temperature=0.1, top_k=5)  # a random tiny model is nearly flat: sharpen it
    prompt = byte_level("def add(a, b):")["input_ids"]
    counts: dict = {}
    reported = None
    trials = 500
    for seed in range(trials):
        drafter = UniversalDrafter(draft, sentencepiece, byte_level, sampling, [], torch.Generator().manual_seed(seed),
                                   target_vocab_size=len(byte_level), intersection=True)
        drafter.start(prompt)
        proposal = drafter.propose(prompt, 1)
        row = proposal.draft_probs[0]
        if reported is None:
            reported = row
        assert torch.allclose(row, reported)
        counts[proposal.tokens[0]] = counts.get(proposal.tokens[0], 0) + 1
    expected = {int(t): float(reported[t]) for t in torch.nonzero(reported).flatten()}
    assert len(expected) > 1
    assert _chi_square_p(counts, expected, trials) > 1e-3


def test_a_shared_draft_proposes_target_tokens_with_their_probabilities():
    byte_level, sentencepiece = tokenizers_pair()
    target, draft = _models(byte_level, sentencepiece)
    sampling = SamplingSettings(temperature=1.0)
    drafter = UniversalDrafter(draft, sentencepiece, byte_level, sampling, [], torch.Generator().manual_seed(0),
                               target_vocab_size=len(byte_level), intersection=True)
    prompt = byte_level("def add(a, b):")["input_ids"]
    drafter.start(prompt)
    proposal = drafter.propose(prompt, 4)
    assert len(proposal.tokens) == 4 and proposal.draft_probs is not None
    assert proposal.draft_probs.shape == (4, len(byte_level))
    assert torch.allclose(proposal.draft_probs.sum(dim=1), torch.ones(4))
    shared_targets = set(shared_vocabulary(sentencepiece, byte_level).values())
    for row, token in zip(proposal.draft_probs, proposal.tokens):
        assert row[token] > 0
        assert set(torch.nonzero(row).flatten().tolist()) <= shared_targets


# --- the seams, on hand-made streams ---------------------------------------------------------------------------


def test_reencode_merges_a_token_that_spans_the_seam():
    byte_level, _ = tokenizers_pair()
    text = "The naïve café owner"
    stream = byte_level(text[:-3], add_special_tokens=False)["input_ids"]  # "...café ow" ends mid-word
    merged = reencode_after(byte_level, stream, text[-3:], text, add_bos=False)
    assert byte_level.decode(merged) == text
    assert merged == byte_level(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("builder", [build_sentencepiece_byte_fallback, build_metaspace])
def test_reencode_keeps_leading_space_markers(builder):
    tokenizer = builder()
    text = "the naive cafe owner served a colada to the painter and the owner"
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text  # no <unk> here
    cut = text.index(" served")
    stream = tokenizer(text[:cut], add_special_tokens=False)["input_ids"]
    merged = reencode_after(tokenizer, stream, text[cut:], text, add_bos=False)
    assert tokenizer.decode(merged) == text
    # the new word keeps its "▁" marker: the stream equals a fresh encoding of the whole text
    assert merged == tokenizer(text, add_special_tokens=False)["input_ids"]


def test_reencode_adds_no_bos_mid_stream():
    _, sentencepiece = tokenizers_pair()
    sentencepiece_with_bos = sentencepiece
    stream = sentencepiece_with_bos("<s>hello there", add_special_tokens=False)["input_ids"]
    merged = reencode_after(sentencepiece_with_bos, stream, " friend", "<s>hello there friend", add_bos=True)
    assert merged.count(sentencepiece.bos_token_id) == 1


def test_byte_fallback_pieces_and_split_characters():
    _, sentencepiece = tokenizers_pair()
    text = "Unseen chars: 𝄞 ꙮ 🦩"
    ids = sentencepiece(text, add_special_tokens=False)["input_ids"]
    assert any(sentencepiece.convert_ids_to_tokens(i).startswith("<0x") for i in ids)  # byte fallback used
    # a cut inside a character's byte pieces: text_after reports the incomplete tail as U+FFFD, never a wrong char
    for cut in range(1, len(ids)):
        piece = text_after(sentencepiece, ids[:cut], ids[cut:])
        assert piece is None or text.endswith(piece.replace("\ufffd", "")) or "\ufffd" in piece


def test_to_target_tokens_continues_the_context_exactly_even_where_the_text_would_merge_with_it():
    """A draft text that would merge with the context's last token (a newline after a newline: one token when
    written together) is still proposed, as the tokens the target writes after the token it already wrote (a
    draft round that comes back empty is a draft step paid for nothing); any proposal continues the context."""
    byte_level, sentencepiece = tokenizers_pair()
    cases = [("def add(a, b):\n    ret", "urn a + b"), ("x = 1\n", "\n"), ("print(x)\n", "    y"), ("a  ", " b")]
    for tokenizer in (byte_level, sentencepiece):
        for before, text in cases:
            context = tokenizer(before, add_special_tokens=False)["input_ids"]
            tokens = to_target_tokens(tokenizer, context, text)
            if tokenizer is byte_level:  # byte-level pieces always join: every text is proposed
                assert tokens, (before, text)
            if tokens:
                assert tokenizer.decode(context + tokens) == before + text
        assert to_target_tokens(tokenizer, context, "") == []


@pytest.mark.parametrize("text", [t for t in TRICKY if t])
def test_draft_stream_follows_target_text(text: str):
    """After each sync the draft stream decodes exactly to the target's text (prompt + accepted tokens)."""
    byte_level, sentencepiece = tokenizers_pair()
    draft = llama(35, layers=1, vocab=len(sentencepiece))
    drafter = UniversalDrafter(draft, sentencepiece, byte_level, SamplingSettings())
    ids = byte_level(text, add_special_tokens=False)["input_ids"]
    synced = []
    for end in range(1, len(ids) + 1):
        if drafter._sync_text(ids[:end]):  # a prefix that ends inside a character does not sync
            synced.append(end)
            assert sentencepiece.decode(drafter.stream) == byte_level.decode(ids[:end])
    assert synced and synced[-1] == len(ids)  # the whole text syncs, so the check above ran


@pytest.mark.parametrize("k", [1, 3])
def test_a_k_token_draft_takes_k_draft_steps(k: int):
    """Catch-up aside, proposing k tokens runs the draft k times (one step per draft token, no look-ahead step:
    a look-ahead doubled the cost of a one-token draft for no acceptance gained), and proposes at most k tokens."""
    byte_level, sentencepiece = tokenizers_pair()
    draft = llama(36, layers=1, vocab=len(sentencepiece))
    drafter = UniversalDrafter(draft, sentencepiece, byte_level, SamplingSettings(), int8=False)
    context = byte_level(PROMPTS[0], add_special_tokens=False)["input_ids"]
    drafter.propose(context, 1)  # reads the prompt
    steps: list[int] = []
    original = drafter.lm.forward

    def counted(input_ids: torch.Tensor, all_logits: bool = True) -> torch.Tensor:
        steps.append(int(input_ids.numel()))
        return original(input_ids, all_logits)

    drafter.lm.forward = counted  # type: ignore[method-assign]
    proposal = drafter.propose(context, k)
    assert len(steps) == k and all(size == 1 for size in steps[1:])
    assert len(proposal.tokens) <= k
