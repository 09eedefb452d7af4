"""Sampling is exact at every position of a multi-token draft, and for the bonus token after it.

Each end-to-end run writes 6 tokens with 4 tokens drafted in its one verify round (the prefill writes token 1;
``min(k, remaining - 1)`` leaves room for 4 drafts and the bonus), so output positions 2 to 5 are the draft's and
position 6 is the bonus when all four were kept. Every position is checked against the target alone: a sampled
token at position j must follow the target's distribution given the prompt and the tokens sampled before it, so
over many runs the count of each token is compared with the sum of those conditional probabilities (a chi-square
on conditional expectations; cells expected under 5 pooled). The draft tokens themselves are checked the same way
against the draft distributions the drafter reported, so a drafter cannot report one row and sample from another.

Fixed seeds: each run is reproducible. The sample sizes catch the mistakes these tests were written against (a
bonus drawn from the wrong row, a residual taken against the wrong row, a draft probability from the wrong step;
see the closing note of the issue "Hosted safely and proven exact").
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chi2
from tiny import llama

from specdemo.backends.transformers_lm import CachedLM
from specdemo.core.acceptance import accept_sampling, target_distribution
from specdemo.core.loop import collect, speculative_decode
from specdemo.core.settings import GenerationSettings, SamplingSettings
from specdemo.methods.draft_length import FixedDraftLength

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: threads only spin against each other

ALPHA = 1e-3
VOCAB = 8
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]
NEW_TOKENS = 6
NUM_DRAFT = 4
SAMPLING = dict(temperature=1.0, top_k=0, top_p=1.0)


def conditional_chi_square_p(tokens: list[int], probs: list[torch.Tensor]) -> float:
    """p-value of "each token was drawn from its own row": per token id, the observed count against the summed
    probabilities of the rows (cells expected under 5 pooled)."""
    if not tokens:
        return 1.0
    rows = torch.stack([p.double() for p in probs])
    expected = rows.sum(0)
    observed = torch.bincount(torch.tensor(tokens), minlength=rows.shape[1]).double()
    assert float(observed[expected == 0].sum()) == 0, "a token the distribution rules out was drawn"
    big = expected >= 5
    cells_observed = observed[big].tolist() + ([float(observed[~big].sum())] if (~big).any() else [])
    cells_expected = expected[big].tolist() + ([float(expected[~big].sum())] if (~big).any() else [])
    if len(cells_expected) < 2:
        return 1.0
    statistic = sum((o - e) ** 2 / e for o, e in zip(cells_observed, cells_expected) if e > 0)
    return float(chi2.sf(statistic, len(cells_expected) - 1))


# ----------------------------------------------------------------------------------------------------------------
# the acceptance rule alone: fixed rows, every position and the bonus


def test_rejection_sampling_is_exact_at_every_position_and_for_the_bonus():
    """Fixed draft and target rows (the target's row j does not depend on the tokens before it here), a 4-token
    draft: output position j follows target row j, the bonus included."""
    generator = torch.Generator().manual_seed(0)
    target_probs = torch.tensor([
        [0.40, 0.20, 0.20, 0.10, 0.10, 0.00],
        [0.05, 0.05, 0.30, 0.30, 0.20, 0.10],
        [0.30, 0.30, 0.05, 0.05, 0.10, 0.20],
        [0.10, 0.40, 0.10, 0.10, 0.10, 0.20],
        [0.02, 0.08, 0.10, 0.20, 0.30, 0.30],  # the bonus row
    ])
    draft_probs = torch.tensor([
        [0.30, 0.30, 0.10, 0.10, 0.10, 0.10],
        [0.10, 0.10, 0.40, 0.20, 0.10, 0.10],
        [0.25, 0.25, 0.10, 0.10, 0.20, 0.10],
        [0.15, 0.35, 0.15, 0.15, 0.10, 0.10],
    ])
    emitted: list[list[int]] = [[] for _ in range(NUM_DRAFT + 1)]
    for _ in range(30000):
        draft = torch.multinomial(draft_probs, 1, generator=generator)[:, 0]
        verdict = accept_sampling(draft, draft_probs, target_probs, generator)
        for position, token in enumerate(draft[: verdict.num_accepted].tolist() + [verdict.next_token]):
            emitted[position].append(token)
    for position, tokens in enumerate(emitted):
        assert len(tokens) > 1500, position  # every position, the bonus too, is reached often
        p = conditional_chi_square_p(tokens, [target_probs[position]] * len(tokens))
        assert p > ALPHA, f"output position {position + 1}: p = {p:.2g}"


# ----------------------------------------------------------------------------------------------------------------
# end to end, one drafter at a time


def _target():
    model = llama(41, layers=1, vocab=VOCAB, hidden=32)
    with torch.no_grad():  # sharper rows that differ from context to context: mistakes show
        model.lm_head.weight.mul_(6.0)
    return model


def _perturbed(model, seed: int, scale: float):
    import copy

    draft = copy.deepcopy(model)
    with torch.no_grad():
        for parameter in draft.parameters():
            parameter.add_(scale * torch.randn(parameter.shape, generator=torch.Generator().manual_seed(seed)))
    return draft


def _medusa(model, sampling, generator):
    from specdemo.backends.medusa_heads import MedusaConfig, MedusaHeads
    from specdemo.methods.medusa import MedusaDrafter

    heads = MedusaHeads(MedusaConfig(NUM_DRAFT, 1, model.config.hidden_size, VOCAB))
    with torch.no_grad():
        for parameter in heads.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=torch.Generator().manual_seed(5)) * 0.5)
    return MedusaDrafter(heads, model.get_output_embeddings().weight.detach(), sampling, VOCAB, generator=generator)


def _eagle(model, sampling, generator):
    from specdemo.backends.eagle3_head import EagleConfig, EagleHead, default_hidden_layers
    from specdemo.methods.eagle import EagleDrafter

    hidden = model.config.hidden_size
    head = EagleHead(EagleConfig(hidden, 4, 2, hidden // 4, 2 * hidden, VOCAB, 6,
                                 default_hidden_layers(model.config.num_hidden_layers)))
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=torch.Generator().manual_seed(7)) * 0.5)
        head.draft_ids.copy_(torch.tensor([0, 1, 2, 4, 5, 7]))
    return EagleDrafter(head.eval(), model.get_input_embeddings(), sampling, VOCAB, generator=generator)


DRAFTERS = {
    "draft-model": lambda target, sampling, generator: __import__(
        "specdemo.methods.draft_model", fromlist=["DraftModelDrafter"]).DraftModelDrafter(
        _perturbed(target, 3, 0.02), sampling, VOCAB, generator=generator, int8=False),
    "ngram": lambda target, sampling, generator: __import__(
        "specdemo.methods.ngram", fromlist=["NgramDrafter"]).NgramDrafter(1, 4),
    "suffix": lambda target, sampling, generator: __import__(
        "specdemo.methods.suffix", fromlist=["SuffixDrafter"]).SuffixDrafter(None, tree=False, factor=4.0),
    "medusa-chain": _medusa,
    "eagle-chain": _eagle,
}
TRIALS = {"draft-model": 1500, "ngram": 1500, "suffix": 1500, "medusa-chain": 1500, "eagle-chain": 3000}
#: the drafters whose drafts are point masses (reported as None), and which draft only where the text repeats
POINT_MASS = ("ngram", "suffix")


class Recording:
    """A drafter that keeps every proposal (tokens and the draft rows it reported)."""

    def __init__(self, drafter) -> None:
        self.drafter, self.proposals = drafter, []

    def __getattr__(self, name):
        return getattr(self.drafter, name)

    def propose(self, context, num_draft_tokens):
        proposal = self.drafter.propose(context, num_draft_tokens)
        self.proposals.append(proposal)
        return proposal


def sampled_runs(kind: str, trials: int, target=None, drafters=None):
    """(outputs, proposals) of ``trials`` seeded runs of ``kind``: each output 6 tokens, each first proposal up to
    4 tokens with its reported rows."""
    target = target if target is not None else _target()
    make = (drafters or DRAFTERS)[kind]
    outputs, proposals = [], []
    for seed in range(trials):
        sampling = SamplingSettings(**SAMPLING, seed=seed)
        drafter = Recording(make(target, sampling, torch.Generator().manual_seed(10_000 + seed)))
        settings = GenerationSettings(max_new_tokens=NEW_TOKENS, sampling=sampling, collect_probs=False)
        final = collect(speculative_decode(CachedLM(target), drafter, FixedDraftLength(NUM_DRAFT), PROMPT, settings))
        outputs.append(final.new_token_ids)
        proposals.append(drafter.proposals[0] if drafter.proposals else None)
    return target, outputs, proposals


def target_rows(target, outputs: list[list[int]], prompt: list[int] = PROMPT,
                sampling: dict = SAMPLING) -> torch.Tensor:
    """[runs, 6, V]: the target's distribution at each output position given the prompt and the run's tokens."""
    with torch.inference_mode():
        ids = torch.tensor([prompt + out for out in outputs])
        logits = target(input_ids=ids).logits[:, len(prompt) - 1 : len(prompt) - 1 + NEW_TOKENS]
        return target_distribution(logits.float(), SamplingSettings(**sampling))


def position_p_values(target, outputs, prompt: list[int] = PROMPT, sampling: dict = SAMPLING) -> list[float]:
    rows = target_rows(target, outputs, prompt, sampling)
    return [conditional_chi_square_p([out[j] for out in outputs], list(rows[:, j]))
            for j in range(NEW_TOKENS)]


def draft_p_values(proposals) -> list[float]:
    """Per draft position: were the drafted tokens drawn from the rows the drafter reported?"""
    values = []
    for j in range(NUM_DRAFT):
        chosen = [(int(p.tokens[j]), p.draft_probs[j]) for p in proposals
                  if p is not None and p.draft_probs is not None and len(p.tokens) > j]
        values.append(conditional_chi_square_p([t for t, _ in chosen], [row for _, row in chosen]))
    return values


@pytest.mark.parametrize("kind", list(DRAFTERS))
def test_sampled_output_follows_the_target_at_every_position(kind):
    target, outputs, proposals = sampled_runs(kind, TRIALS[kind])
    assert all(len(out) == NEW_TOKENS for out in outputs)
    drafted = [p for p in proposals if p is not None and len(p.tokens) == NUM_DRAFT]
    assert len(drafted) > TRIALS[kind] // (10 if kind in POINT_MASS else 3), "the runs must draft 4 tokens"
    for position, p in enumerate(position_p_values(target, outputs), start=1):
        assert p > ALPHA, f"{kind}: output position {position}: p = {p:.2g}"
    if kind not in POINT_MASS:  # n-gram and suffix drafts are point masses, reported as None
        for position, p in enumerate(draft_p_values(proposals), start=1):
            assert p > ALPHA, f"{kind}: draft position {position}: p = {p:.2g}"


def test_sampled_uag_output_follows_the_target_at_every_position():
    """Drafting through text with another tokenizer (uag), sampling on the shared vocabulary: 4-token drafts, every
    output position against the target alone, and the shared tokens against the rows the drafter reported."""
    from test_uag import _models, tokenizers_pair

    from specdemo.methods.uag import UniversalDrafter

    byte_level, sentencepiece = tokenizers_pair()
    target, draft = _models(byte_level, sentencepiece)
    prompt = byte_level("def add(a, b):")["input_ids"]
    sampling = dict(temperature=1.0, top_k=3, top_p=1.0)  # a random tiny model is nearly flat: a narrow support
    outputs, proposals = [], []
    trials = 900
    for seed in range(trials):
        settings = GenerationSettings(NEW_TOKENS, SamplingSettings(**sampling, seed=seed), collect_probs=False)
        drafter = Recording(UniversalDrafter(draft, sentencepiece, byte_level, settings.sampling, [],
                                             torch.Generator().manual_seed(10_000 + seed),
                                             target_vocab_size=len(byte_level), intersection=True, int8=False))
        final = collect(speculative_decode(CachedLM(target), drafter, FixedDraftLength(NUM_DRAFT), prompt, settings))
        outputs.append(final.new_token_ids)
        proposals.append(drafter.proposals[0] if drafter.proposals else None)
    assert all(len(out) == NEW_TOKENS for out in outputs)
    assert sum(1 for p in proposals if p is not None and len(p.tokens) >= 2) > trials // 3
    for position, p in enumerate(position_p_values(target, outputs, prompt, sampling), start=1):
        assert p > ALPHA, f"uag: output position {position}: p = {p:.2g}"
    for position, p in enumerate(draft_p_values(proposals), start=1):
        assert p > ALPHA, f"uag: draft position {position}: p = {p:.2g}"
