"""Batches of continuations (the trainers' and the pool's answers, the pool's requests): sampled batches draw from
the project's own warped distribution, seeded; rows stop where they should (a tiny target, float32, CPU). The
greedy batch against transformers' ``generate`` is checked in ``test_pool_states.py``."""

from __future__ import annotations

import pytest
import torch
from tiny import save_tiny_pair

from specdemo.backends.loading import LoadSettings, load_model
from specdemo.core.acceptance import target_distribution
from specdemo.core.settings import SamplingSettings
from specdemo.training.batch_generation import generate_batch
from specdemo.training.common import chat_header

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return load_model(save_tiny_pair(tmp_path_factory.mktemp("pair"))[0], LoadSettings(dtype="float32"))


def test_a_sampled_batch_is_seeded_and_a_cold_one_is_greedy(loaded):
    headers = [chat_header(loaded.tokenizer, text) for text in ("Hi.", "Name three rivers.", "Why?")]
    sampling = SamplingSettings(temperature=1.0, top_p=0.95, seed=5)
    first = generate_batch(loaded, headers, 8, [], sampling)
    assert first == generate_batch(loaded, headers, 8, [], sampling)  # the seed decides the draws
    assert first != generate_batch(loaded, headers, 8, [], SamplingSettings(temperature=1.0, top_p=0.95, seed=6))
    greedy = generate_batch(loaded, headers, 8, [])
    assert generate_batch(loaded, headers, 8, [], SamplingSettings(temperature=1e-4, seed=5)) == greedy
    # a stop token ends its row (kept, and flagged); min_new_tokens holds it back
    stop = greedy[1][0][2]
    stopped = generate_batch(loaded, headers, 8, [stop])
    assert stopped[1] == (greedy[1][0][:3], True) and all(len(ids) <= 8 for ids, _ in stopped)
    held = generate_batch(loaded, headers, 8, [stop], min_new_tokens=8)
    assert all(len(ids) == 8 and stop not in ids for ids, _ in held)


def test_sampled_first_tokens_follow_the_warped_distribution(loaded):
    """6,000 copies of one prompt, one token each: every token's frequency within five standard errors of the
    warped probability (temperature and top-p as the races use them), none drawn outside the nucleus."""
    header = chat_header(loaded.tokenizer, "Tell me something.")
    sampling = SamplingSettings(temperature=0.7, top_p=0.6, seed=3)
    count = 6000
    drawn = generate_batch(loaded, [header] * count, 1, [], sampling)
    with torch.inference_mode():
        logits = loaded.model(input_ids=torch.tensor([header])).logits[0, -1]
    probs = target_distribution(logits, sampling)
    frequencies = torch.bincount(torch.tensor([ids[0] for ids, _ in drawn]), minlength=probs.numel()) / count
    assert (probs == 0).any() and not frequencies[probs == 0].any()
    error = (probs * (1 - probs) / count).sqrt()
    assert ((frequencies - probs).abs() <= 5 * error + 1e-4).all()


def test_batch_sizes_are_timed_on_prompts_of_the_middle_lengths(loaded, monkeypatch):
    """Each size answers headers of like lengths (sorted, from the middle), not the first ones as they come."""
    from specdemo.training import batch_generation

    batches = []
    real = batch_generation.generate_batch
    monkeypatch.setattr(batch_generation, "generate_batch",
                        lambda loaded, headers, *args, **kwargs: batches.append(list(headers)) or real(
                            loaded, headers, *args, **kwargs))
    headers = [[7] * length for length in (30, 2, 9, 5, 40, 3, 7, 4)]
    batch, rates = batch_generation.fastest_batch_size(loaded, headers, new_tokens=2, sizes=(2, 4))
    assert batch in (2, 4) and set(rates) == {2, 4}
    assert [len(h) for h in batches[1]] == [5, 7] and [len(h) for h in batches[2]] == [4, 5, 7, 9]
