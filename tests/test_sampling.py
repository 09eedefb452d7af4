"""Sampled speculative output follows the target's distribution exactly (rejection sampling), checked statistically.

Tolerances: chi-square goodness of fit against the exact distribution, with cells of expected count < 5 pooled;
the test fails when p < 0.001. Seeds are fixed, so each run is reproducible (no flakiness), and the sample sizes
give the check power against errors of a few percentage points in any cell.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chisquare
from tiny import llama

from specdemo.backends.transformers_lm import CachedLM
from specdemo.core.acceptance import accept_sampling, target_distribution, warp_logits
from specdemo.core.loop import collect, plain_decode, speculative_decode
from specdemo.core.settings import GenerationSettings, SamplingSettings
from specdemo.methods.draft_length import FixedDraftLength
from specdemo.methods.draft_model import DraftModelDrafter
from specdemo.backends.medusa_heads import MedusaConfig, MedusaHeads
from specdemo.methods.medusa import MedusaDrafter
from specdemo.methods.ngram import NgramDrafter

ALPHA = 1e-3


def _chi_square_p(counts: dict, expected_probs: dict, total: int) -> float:
    observed, expected = [], []
    pooled_obs, pooled_exp = 0.0, 0.0
    for key, prob in expected_probs.items():
        if prob * total < 5:
            pooled_obs += counts.get(key, 0)
            pooled_exp += prob * total
        else:
            observed.append(counts.get(key, 0))
            expected.append(prob * total)
    if pooled_exp > 0:
        observed.append(pooled_obs)
        expected.append(pooled_exp)
    assert sum(observed) == total, "a sample fell outside the support of the target distribution"
    scale = sum(observed) / sum(expected)
    return float(chisquare(observed, [e * scale for e in expected]).pvalue)


def test_rejection_sampling_rows_match_target():
    """With fixed draft and target distributions, each emitted position is distributed as the target row."""
    generator = torch.Generator().manual_seed(0)
    target_probs = torch.tensor([[0.5, 0.2, 0.2, 0.1, 0.0], [0.1, 0.1, 0.3, 0.3, 0.2], [0.2, 0.2, 0.2, 0.2, 0.2]])
    draft_probs = torch.tensor([[0.1, 0.6, 0.1, 0.1, 0.1], [0.25, 0.25, 0.0, 0.25, 0.25]])
    trials = 20000
    first, second = {}, {}
    for _ in range(trials):
        draft = torch.stack([torch.multinomial(row, 1, generator=generator)[0] for row in draft_probs])
        verdict = accept_sampling(draft, draft_probs, target_probs, generator)
        emitted = draft[: verdict.num_accepted].tolist() + [verdict.next_token]
        first[emitted[0]] = first.get(emitted[0], 0) + 1
        if len(emitted) > 1:
            second[emitted[1]] = second.get(emitted[1], 0) + 1
    assert _chi_square_p(first, dict(enumerate(target_probs[0].tolist())), trials) > ALPHA
    assert _chi_square_p(second, dict(enumerate(target_probs[1].tolist())), sum(second.values())) > ALPHA


def test_point_mass_drafts_match_target():
    """Drafters without probabilities (n-gram) propose a point mass; the output still follows the target."""
    generator = torch.Generator().manual_seed(1)
    target_probs = torch.tensor([[0.3, 0.3, 0.4], [0.6, 0.3, 0.1]])
    trials = 20000
    counts = {}
    for _ in range(trials):
        verdict = accept_sampling(torch.tensor([2]), None, target_probs, generator)
        counts[2 if verdict.num_accepted else verdict.next_token] = counts.get(2 if verdict.num_accepted else verdict.next_token, 0) + 1
    assert _chi_square_p(counts, dict(enumerate(target_probs[0].tolist())), trials) > ALPHA


def test_warping_matches_definitions():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    top_k = target_distribution(logits, SamplingSettings(temperature=1.0, top_k=2))
    assert (top_k[2:] == 0).all() and torch.isclose(top_k.sum(), torch.tensor(1.0))
    probs = logits.softmax(-1)
    top_p = target_distribution(logits, SamplingSettings(temperature=1.0, top_p=0.6))
    kept = (top_p > 0).sum().item()
    assert probs[:kept].sum() >= 0.6 and probs[: kept - 1].sum() < 0.6
    hot = warp_logits(logits, SamplingSettings(temperature=2.0))
    assert torch.allclose(hot, logits / 2.0)


VOCAB = 8
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]


def _exact_pairs(model, settings: SamplingSettings) -> dict:
    """Exact distribution of the first two new tokens under the target alone."""
    with torch.inference_mode():
        first = target_distribution(model(input_ids=torch.tensor([PROMPT])).logits[0, -1], settings)
        contexts = torch.tensor([PROMPT + [t] for t in range(VOCAB)])
        second = target_distribution(model(input_ids=contexts).logits[:, -1], settings)
    return {(a, b): float(first[a] * second[a, b]) for a, b in itertools.product(range(VOCAB), repeat=2)}


@pytest.mark.parametrize("drafter_kind", ["draft-model", "ngram", "medusa-chain"])
def test_speculative_sampling_matches_target_end_to_end(drafter_kind: str):
    target = llama(21, layers=1, vocab=VOCAB, hidden=32)
    draft = llama(22, layers=1, vocab=VOCAB, hidden=32)
    sampling = SamplingSettings(temperature=1.3, top_k=6)
    exact = _exact_pairs(target, sampling)
    heads = MedusaHeads(MedusaConfig(2, 1, 32, VOCAB))
    with torch.no_grad():
        for parameter in heads.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=torch.Generator().manual_seed(5)) * 0.5)
    trials = 1500
    counts: dict = {}
    for seed in range(trials):
        settings = GenerationSettings(max_new_tokens=3, sampling=SamplingSettings(1.3, 6, 1.0, seed), collect_probs=False)
        if drafter_kind == "ngram":
            drafter = NgramDrafter(1, 2)
        elif drafter_kind == "medusa-chain":  # the heads' warped softmax is the draft distribution
            generator = torch.Generator().manual_seed(10_000 + seed)
            drafter = MedusaDrafter(heads, target.get_output_embeddings().weight.detach(), settings.sampling, VOCAB,
                                    generator=generator)
        else:
            generator = torch.Generator().manual_seed(10_000 + seed)
            drafter = DraftModelDrafter(draft, settings.sampling, VOCAB, generator=generator)
        ids = collect(speculative_decode(CachedLM(target), drafter, FixedDraftLength(2), PROMPT, settings)).new_token_ids
        key = (ids[0], ids[1])
        counts[key] = counts.get(key, 0) + 1
    assert _chi_square_p(counts, exact, trials) > ALPHA


def test_plain_sampling_is_seeded_and_follows_target():
    target = llama(21, layers=1, vocab=VOCAB, hidden=32)
    sampling = SamplingSettings(temperature=1.3, top_k=6)
    a = collect(plain_decode(CachedLM(target), PROMPT, GenerationSettings(5, SamplingSettings(1.3, 6, 1.0, 7)))).new_token_ids
    b = collect(plain_decode(CachedLM(target), PROMPT, GenerationSettings(5, SamplingSettings(1.3, 6, 1.0, 7)))).new_token_ids
    assert a == b
    exact = _exact_pairs(target, sampling)
    counts: dict = {}
    trials = 800
    for seed in range(trials):
        ids = collect(plain_decode(CachedLM(target), PROMPT, GenerationSettings(2, SamplingSettings(1.3, 6, 1.0, seed), collect_probs=False))).new_token_ids
        counts[tuple(ids)] = counts.get(tuple(ids), 0) + 1
    assert _chi_square_p(counts, exact, trials) > ALPHA
