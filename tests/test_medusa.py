"""Medusa heads: tree passes, tree verification, exact greedy output (chain and tree), head files."""

from __future__ import annotations

import json

import pytest
import torch
from tiny import VOCAB, gpt2, llama, qwen2

from specdemo.backends.transformers_lm import CachedLM
from specdemo.core.acceptance import accept_greedy_tree
from specdemo.core.events import ACCEPTED, REJECTED
from specdemo.core.files import file_sha256
from specdemo.core.loop import collect, plain_decode, speculative_decode
from specdemo.core.settings import GenerationSettings, SamplingSettings
from specdemo.core.tree import build_tree, tree_attention_mask, tree_depths
from specdemo.methods.draft_length import FixedDraftLength, TreeBudget
from specdemo.backends.medusa_checkpoint import MedusaLoadError, load_heads
from specdemo.backends.medusa_heads import MedusaConfig, MedusaHeads
from specdemo.methods.medusa import MedusaDrafter

GREEDY = SamplingSettings()
PROMPTS = [[5, 7, 9, 11, 5, 7, 9, 3, 2, 1], [1], [40, 41, 42, 43, 44, 45, 40, 41, 42, 43, 44, 45, 40, 41]]
MODELS = {"llama": lambda: llama(1), "qwen2": lambda: qwen2(3), "gpt2": lambda: gpt2(5)}


def random_heads(model, num_heads: int = 3, seed: int = 0, scale: float = 0.3, own_lm_head: bool = False,
                 num_layers: int = 1) -> MedusaHeads:
    hidden = model.config.get_text_config().hidden_size
    heads = MedusaHeads(MedusaConfig(num_heads, num_layers, hidden, VOCAB, own_lm_head=own_lm_head))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in heads.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * scale)
    return heads.eval()


def copying_heads(model, num_heads: int = 3) -> MedusaHeads:
    """Untrained heads: W = 0, so each head is the target's own LM head (it guesses the target's next token)."""
    hidden = model.config.get_text_config().hidden_size
    return MedusaHeads(MedusaConfig(num_heads, 1, hidden, VOCAB)).eval()


def medusa(model, heads, tree: bool, sampling=GREEDY, **kwargs) -> MedusaDrafter:
    weight = model.get_output_embeddings().weight.detach()
    return MedusaDrafter(heads, weight, sampling, VOCAB, tree=tree, **kwargs)


def plain_ids(model, prompt, settings, eos=()):
    return collect(plain_decode(CachedLM(model), prompt, settings, eos)).new_token_ids


# ----------------------------------------------------------------------------------------------------------------
# tree passes and the cache


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_tree_pass_gives_each_node_the_logits_of_its_own_path_and_keep_leaves_that_path_cached(name):
    model = MODELS[name]()
    prefix = [3, 14, 15, 9, 2, 6]
    root = 5
    #        0   1   2   3   4   5   6
    tokens = [10, 20, 30, 11, 21, 31, 12]
    parents = [-1, 0, 1, -1, 3, 1, 0]
    lm = CachedLM(model)
    lm.run(torch.tensor(prefix))
    tree = lm.run(torch.tensor([root] + tokens), parents=[-1] + [p + 1 for p in parents])
    for node in range(len(tokens)):
        path, walk = [], node
        while walk >= 0:
            path.append(tokens[walk])
            walk = parents[walk]
        reference = CachedLM(model).run(torch.tensor(prefix + [root] + path[::-1])).logits[-1]
        assert torch.allclose(tree.logits[node + 1], reference, atol=1e-4), node
    # keep the path 0 -> 1 -> 5 and check the cache continues as if only that path had been fed
    lm.keep(len(tokens) + 1, [0, 1, 2, 6])
    assert lm.length == len(prefix) + 4
    after = lm.run(torch.tensor([7])).logits[-1]
    reference = CachedLM(model).run(torch.tensor(prefix + [root, 10, 20, 31, 7])).logits[-1]
    assert torch.allclose(after, reference, atol=1e-4)
    assert tree.hidden_states is not None and tree.hidden_states.shape[0] == len(tokens) + 1


def test_tree_mask_and_depths():
    parents = [-1, 0, 0, 1]
    assert tree_depths(parents) == [0, 1, 1, 2]
    mask = tree_attention_mask(parents, 2, torch.float32, torch.device("cpu"))[0, 0]
    visible = (mask == 0).int().tolist()
    assert visible == [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 1, 0], [1, 1, 1, 1, 0, 1]]
    with pytest.raises(ValueError):
        tree_depths([0])


def test_build_tree_is_best_first_and_ancestor_closed():
    probs = torch.tensor([[0.6, 0.3, 0.1], [0.9, 0.05, 0.05], [0.5, 0.4, 0.1]])
    ids = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    tokens, parents, scores = build_tree(probs, ids, 6)
    assert scores == sorted(scores, reverse=True)
    assert all(parent < node for node, parent in enumerate(parents))
    # 0.6; 0.6 * 0.9 = 0.54; the sibling 0.3; 0.54 * 0.5 = 0.27 and 0.3 * 0.9 = 0.27 (the older candidate
    # first); 0.54 * 0.4 = 0.216
    assert tokens == [1, 4, 2, 7, 4, 8] and parents == [-1, 0, -1, 1, 2, 1]
    chain = build_tree(probs[:, :1], ids[:, :1], 10)
    assert chain[0] == [1, 4, 7] and chain[1] == [-1, 0, 1]


def test_greedy_tree_verdict_takes_the_deepest_matching_path():
    vocab = 6
    #          0  1  2  3
    tokens = torch.tensor([2, 3, 4, 1])
    parents = [-1, -1, 1, 2]
    choice = [3, 0, 4, 1, 5]  # target argmax at rows: root, node0, node1, node2, node3
    logits = torch.nn.functional.one_hot(torch.tensor(choice), vocab).float()
    verdict = accept_greedy_tree(tokens, parents, logits)
    assert verdict.path == (1, 2, 3) and verdict.num_accepted == 3 and verdict.next_token == 5
    assert verdict.last_row == 4
    logits = torch.nn.functional.one_hot(torch.tensor([0, 0, 4, 0, 0]), vocab).float()
    verdict = accept_greedy_tree(tokens, parents, logits)
    assert verdict.path == () and verdict.next_token == 0 and verdict.last_row == 0


# ----------------------------------------------------------------------------------------------------------------
# exact greedy output


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
@pytest.mark.parametrize("kind", ["random", "copying", "sharp"])
def test_greedy_medusa_output_equals_the_target_alone(name, tree, kind):
    model = MODELS[name]()
    heads = {"random": lambda: random_heads(model), "copying": lambda: copying_heads(model),
             "sharp": lambda: random_heads(model, seed=4, scale=2.0)}[kind]()
    for prompt in PROMPTS:
        for budget in (1, 3, 8):
            settings = GenerationSettings(max_new_tokens=24)
            expected = plain_ids(model, prompt, settings)
            drafter = medusa(model, heads, tree, top_width=3)
            ids = collect(speculative_decode(CachedLM(model), drafter, FixedDraftLength(budget), prompt, settings))
            assert ids.new_token_ids == expected, (prompt, budget)


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_every_length_limit_and_eos_inside_a_path(tree):
    model = llama(1)
    heads = copying_heads(model)
    prompt = PROMPTS[0]
    full = plain_ids(model, prompt, GenerationSettings(max_new_tokens=20))
    for limit in range(1, 21):
        settings = GenerationSettings(max_new_tokens=limit)
        drafter = medusa(model, heads, tree)
        event = collect(speculative_decode(CachedLM(model), drafter, FixedDraftLength(6), prompt, settings))
        assert event.new_token_ids == full[:limit]
    for eos_at in range(1, 12):
        eos = [full[eos_at]]
        expected = plain_ids(model, prompt, GenerationSettings(max_new_tokens=20), eos)
        drafter = medusa(model, heads, tree)
        event = collect(speculative_decode(CachedLM(model), drafter, FixedDraftLength(6), prompt,
                                           GenerationSettings(max_new_tokens=20), eos))
        assert event.new_token_ids == expected and event.finish_reason == "eos"


def test_tree_sized_by_the_cost_model_stays_exact_and_can_fall_back_to_plain_steps():
    model = qwen2(3)
    heads = random_heads(model, seed=8)
    prompt = PROMPTS[2]
    settings = GenerationSettings(max_new_tokens=30)
    expected = plain_ids(model, prompt, settings)
    # dear verification: every extra token costs a whole pass, so no tree pays and the drafter proposes nothing
    drafter = medusa(model, heads, True, verify_cost=lambda n: float(n))
    events = list(speculative_decode(CachedLM(model), drafter, TreeBudget(max_num_draft_tokens=8), prompt, settings))
    assert events[-1].new_token_ids == expected
    assert events[-1].counters.drafted == 0
    # free verification: trees use their whole budget
    drafter = medusa(model, heads, True, verify_cost=lambda n: 1.0)
    events = list(speculative_decode(CachedLM(model), drafter, TreeBudget(max_num_draft_tokens=8), prompt, settings))
    assert events[-1].new_token_ids == expected
    assert max(e.drafted for e in events) == 8


def test_a_tree_drafter_whose_trees_do_not_pay_stops_scoring_its_heads_for_a_while():
    model = qwen2(3)
    heads = random_heads(model, seed=8)
    prompt = PROMPTS[2]
    settings = GenerationSettings(max_new_tokens=60)
    drafter = medusa(model, heads, True, verify_cost=lambda n: float(n))  # no tree ever pays
    scored = []
    original = drafter._head_logits
    drafter._head_logits = lambda: scored.append(1) or original()
    events = list(speculative_decode(CachedLM(model), drafter, TreeBudget(max_num_draft_tokens=8), prompt, settings))
    assert events[-1].new_token_ids == plain_ids(model, prompt, settings)
    # rests of 1, 2, 4, 8, 16, 32 rounds between looks: 59 rounds look at the heads 6 times, not 59
    assert len(scored) == 6
    # free verification: a tree pays every round, so the heads are scored every round
    drafter = medusa(model, heads, True, verify_cost=lambda n: 1.0)
    scored.clear()
    original = drafter._head_logits
    drafter._head_logits = lambda: scored.append(1) or original()
    events = list(speculative_decode(CachedLM(model), drafter, TreeBudget(max_num_draft_tokens=8), prompt, settings))
    # every round but two: the policy's timed plain step (round 2) and the last, with room for no draft
    assert len(scored) == events[-1].counters.rounds - 2


class OracleTree:
    """Knows the target's output: proposes the right two tokens with a wrong sibling at each level, so every
    round accepts two nodes off the prefix of the rows (the cache must keep rows 0, 1, 3)."""

    name = "oracle-tree"
    needs_hidden_states = False
    hidden_layers: tuple[int, ...] | None = None

    def __init__(self, prompt, output, complete=True):
        self.full = list(prompt) + list(output)
        self.complete = complete

    def start(self, prompt_ids, prefill=None):
        pass

    def propose(self, context, num_draft_tokens):
        from specdemo.core.protocol import Proposal

        at = len(context)
        right = self.full[at : at + 2]
        if len(right) < 2:
            return Proposal()
        wrong = [(t + 1) % VOCAB for t in right]
        if not self.complete:  # the second level misses: the target corrects it
            return Proposal([wrong[0], right[0], wrong[1]], None, 0.0, [-1, -1, 1])
        return Proposal([wrong[0], right[0], wrong[1], right[1]], None, 0.0, [-1, -1, 1, 1])

    def feedback(self, result):
        pass


def test_a_tree_round_keeps_its_path_and_shows_the_candidates_turned_down():
    model = llama(1)

    class Tokens:
        def decode(self, ids, skip_special_tokens=False):
            return "".join(f"<{i}>" for i in ids)

    prompt = PROMPTS[0]
    settings = GenerationSettings(max_new_tokens=30)
    expected = plain_ids(model, prompt, settings)
    events = list(speculative_decode(CachedLM(model), OracleTree(prompt, expected), FixedDraftLength(4), prompt,
                                     settings, tokenizer=Tokens()))
    assert events[-1].new_token_ids == expected
    rounds = [e for e in events if e.round > 0 and e.drafted == 4]
    assert rounds and all(e.accepted == 2 for e in rounds)
    assert all([t.kind for t in e.tokens] == [ACCEPTED, ACCEPTED, "bonus"] for e in rounds[:-1])  # ran to a leaf
    assert rounds[-1].counters.drafted_at == rounds[-1].counters.accepted_at == [len(rounds)] * 2  # per depth
    events = list(speculative_decode(CachedLM(model), OracleTree(prompt, expected, complete=False),
                                     FixedDraftLength(3), prompt, settings, tokenizer=Tokens()))
    assert events[-1].new_token_ids == expected
    rounds = [e for e in events if e.round > 0 and e.drafted == 3]
    assert rounds and all(e.accepted == 1 for e in rounds)
    for event in rounds[:-1]:
        assert [t.kind for t in event.tokens] == [ACCEPTED, "corrected"]
        assert [t.kind for t in event.rejected] == [REJECTED]  # the candidate turned down where the target wrote
        assert event.rejected[0].id == (event.tokens[1].id + 1) % VOCAB


def test_sampled_runs_refuse_a_tree():
    model = llama(1)
    with pytest.raises(ValueError, match="greedily"):
        medusa(model, copying_heads(model), True, sampling=SamplingSettings(temperature=1.0))


# ----------------------------------------------------------------------------------------------------------------
# files


def test_heads_round_trip_and_sha256_check(tmp_path):
    model = qwen2(3)
    heads = random_heads(model)
    digest = heads.save(tmp_path / "h", torch.float32)
    loaded = load_heads(tmp_path / "h", 64, VOCAB, expected_sha256=digest)
    hidden = torch.randn(2, 64)
    weight = model.get_output_embeddings().weight.detach()
    assert torch.allclose(loaded.logits(hidden, weight), heads.logits(hidden, weight), atol=1e-6)
    with pytest.raises(MedusaLoadError, match="damaged or replaced"):
        load_heads(tmp_path / "h", 64, VOCAB, expected_sha256="0" * 64)
    with pytest.raises(MedusaLoadError, match="hidden size 64, the target's is 32"):
        load_heads(tmp_path / "h", 32, VOCAB)
    config = json.loads((tmp_path / "h" / "config.json").read_text())
    config["vocab_size"] = 1000
    (tmp_path / "h" / "config.json").write_text(json.dumps(config))
    with pytest.raises(MedusaLoadError, match="vocabulary of 1000"):
        load_heads(tmp_path / "h", 64, VOCAB)
    assert file_sha256(tmp_path / "h" / "medusa_lm_head.safetensors") == digest


@pytest.mark.parametrize("num_layers", [1, 0])
def test_fasterdecoding_checkpoints_with_their_own_lm_heads_load_and_stay_exact(tmp_path, num_layers):
    """A checkpoint as FasterDecoding/Medusa writes it: config.json + medusa_lm_head.pt, own LM head per head."""
    model = llama(1)
    hidden = 64
    state = {}
    generator = torch.Generator().manual_seed(3)
    for k in range(4):
        for layer in range(num_layers):
            state[f"{k}.{layer}.linear.weight"] = torch.randn(hidden, hidden, generator=generator) * 0.1
            state[f"{k}.{layer}.linear.bias"] = torch.randn(hidden, generator=generator) * 0.1
        state[f"{k}.{num_layers}.weight"] = torch.randn(VOCAB, hidden, generator=generator)
    folder = tmp_path / "vicuna-medusa"
    folder.mkdir()
    torch.save(state, folder / "medusa_lm_head.pt")
    (folder / "config.json").write_text(json.dumps(
        {"medusa_num_heads": 4, "medusa_num_layers": num_layers, "base_model_name_or_path": "lmsys/vicuna-7b-v1.3"}
    ))
    heads = load_heads(folder, hidden, VOCAB)
    assert heads.lm_heads is not None and heads.config.num_heads == 4
    settings = GenerationSettings(max_new_tokens=20)
    for tree in (False, True):
        drafter = MedusaDrafter(heads, None, GREEDY, VOCAB, tree=tree)
        ids = collect(speculative_decode(CachedLM(model), drafter, FixedDraftLength(5), PROMPTS[0], settings))
        assert ids.new_token_ids == plain_ids(model, PROMPTS[0], settings)
    with pytest.raises(MedusaLoadError, match="vocabulary of 96 tokens, the target's has 500"):
        load_heads(folder, hidden, 500)


@pytest.mark.parametrize("damage", ["missing", "garbage", "no-config", "bad-config"])
def test_bad_head_folders_are_refused_in_one_line(tmp_path, damage):
    folder = tmp_path / "h"
    random_heads(qwen2(3)).save(folder, torch.float32)
    if damage == "missing":
        (folder / "medusa_lm_head.safetensors").unlink()
    elif damage == "garbage":
        (folder / "medusa_lm_head.safetensors").write_bytes(b"not a tensor file")
    elif damage == "no-config":
        (folder / "config.json").unlink()
    else:
        (folder / "config.json").write_text("{}")
    with pytest.raises(MedusaLoadError) as error:
        load_heads(folder, 64, VOCAB)
    assert "\n" not in str(error.value)
    with pytest.raises(MedusaLoadError, match="not a folder"):
        load_heads(tmp_path / "nowhere", 64, VOCAB)
