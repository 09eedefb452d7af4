"""Medusa heads: extra prediction heads on the target's own last hidden state (Cai et al. 2024, Medusa-1).

Head k (1-based) guesses the token k + 1 positions ahead of the position whose hidden state it reads; the target's
own LM head gives the token right after. Each head is ``num_layers`` residual blocks ``h + SiLU(W h + b)`` on the
target's final (post-norm) hidden state, then an LM head: the target's own, frozen and shared (this project's
heads; optionally scored over a token subset, as the draft model's head is), or a head of its own (the layout of
FasterDecoding/Medusa's published checkpoints, which this module also loads).

On disk (FasterDecoding's layout): a folder with ``config.json`` (``medusa_num_heads``, ``medusa_num_layers``,
``base_model_name_or_path``) and ``medusa_lm_head.safetensors`` (or ``.pt``) with keys
``{head}.{layer}.linear.weight|bias`` and, for heads with an LM head of their own, ``{head}.{num_layers}.weight``.
"""

from __future__ import annotations

import json
import logging
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ..backends.formats import output_weight
from ..backends.loading import LoadedModel
from ..core.acceptance import target_distribution
from ..core.clock import now
from ..core.errors import InputError
from ..core.files import file_sha256
from ..core.protocol import DraftLengthPolicy, Proposal, RoundResult, TargetPass
from ..core.settings import SamplingSettings
from ..core.tree import build_tree
from .base import (
    BuildContext,
    Method,
    PolicyContext,
    drafter_generator,
    head_token_ids,
    heads_policy,
    to_target_vocab,
    tree_verify_cost,
)

logger = logging.getLogger(__name__)

WEIGHTS_NAMES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
#: the heads shipped for the offline target, and the sha256 of their weights file (checked on load)
SHIPPED_HEADS: dict[str, tuple[Path, str]] = {
    "qwen2.5-coder-1.5b": (
        Path(__file__).resolve().parents[1] / "data" / "medusa" / "qwen2.5-coder-1.5b",
        "9802afabf635fe464379397be83dfda1a07641f72e14e2168248b383eb2e13ff",
    ),
}


class MedusaLoadError(ValueError):
    """Heads that cannot be loaded or do not fit the target, with a message fit to show as is."""


@dataclass(frozen=True)
class MedusaConfig:
    num_heads: int
    num_layers: int
    hidden_size: int
    vocab_size: int  # rows of the LM head the heads score (the target's, when it is shared)
    own_lm_head: bool = False
    head_tokens: int = 0  # score only the lowest this many ids (plus the prompt's); 0 = all
    base_model: str = ""


class ResidualBlock(nn.Module):
    """``h + SiLU(W h + b)`` with W zero-initialised, so an untrained head starts as the target's own head."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + nn.functional.silu(self.linear(hidden))


class MedusaHeads(nn.Module):
    """The heads. ``features`` maps hidden states [n, H] to each head's input to an LM head, [K, n, H];
    ``logits`` scores them with the shared LM head weight (rows ``token_ids`` only, when given) or each head's own."""

    def __init__(self, config: MedusaConfig) -> None:
        super().__init__()
        self.config = config
        self.blocks = nn.ModuleList(
            nn.Sequential(*[ResidualBlock(config.hidden_size) for _ in range(config.num_layers)])
            for _ in range(config.num_heads)
        )
        self.lm_heads = (
            nn.ModuleList(nn.Linear(config.hidden_size, config.vocab_size, bias=False) for _ in range(config.num_heads))
            if config.own_lm_head
            else None
        )

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.stack([block(hidden) for block in self.blocks])

    def logits(
        self, hidden: torch.Tensor, shared_weight: torch.Tensor | None, token_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """[K, n, V'] logits; V' = len(token_ids) when given (rows of the vocabulary), else the whole vocabulary."""
        features = self.features(hidden)
        if self.lm_heads is not None:
            rows = [head(features[k]) for k, head in enumerate(self.lm_heads)]
            stacked = torch.stack(rows)
            return stacked if token_ids is None else stacked.index_select(-1, token_ids)
        if shared_weight is None:
            raise ValueError("these heads share the target's LM head: pass its weight")
        weight = shared_weight if token_ids is None else shared_weight.index_select(0, token_ids)
        return features.to(weight.dtype) @ weight.T  # an int8-weight target's head is shared as bfloat16

    # -- files ---------------------------------------------------------------------------------------------------
    def state_in_fasterdecoding_layout(self) -> dict[str, torch.Tensor]:
        state: dict[str, torch.Tensor] = {}
        for k, block in enumerate(self.blocks):
            for layer, residual in enumerate(block):
                state[f"{k}.{layer}.linear.weight"] = residual.linear.weight.detach()
                state[f"{k}.{layer}.linear.bias"] = residual.linear.bias.detach()
            if self.lm_heads is not None:
                state[f"{k}.{self.config.num_layers}.weight"] = self.lm_heads[k].weight.detach()
        return state

    def save(self, folder: Path, dtype: torch.dtype = torch.bfloat16, extra: dict | None = None) -> str:
        """Write config.json and medusa_lm_head.safetensors; returns the weights file's sha256."""
        from safetensors.torch import save_file

        folder.mkdir(parents=True, exist_ok=True)
        state = {name: tensor.to(dtype).contiguous() for name, tensor in self.state_in_fasterdecoding_layout().items()}
        weights = folder / WEIGHTS_NAMES[0]
        save_file(state, str(weights))
        config = {
            "medusa_num_heads": self.config.num_heads,
            "medusa_num_layers": self.config.num_layers,
            "base_model_name_or_path": self.config.base_model,
            "hidden_size": self.config.hidden_size,
            "vocab_size": self.config.vocab_size,
            "shared_lm_head": not self.config.own_lm_head,
            "head_tokens": self.config.head_tokens,
            "torch_dtype": str(dtype).replace("torch.", ""),
        }
        config.update(extra or {})
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        return file_sha256(weights)


def _read_state(folder: Path) -> tuple[dict[str, torch.Tensor], Path]:
    for name in WEIGHTS_NAMES:
        path = folder / name
        if not path.is_file():
            continue
        try:
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file

                return load_file(str(path)), path
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as error:  # corrupt or foreign file: one line, not a traceback
            raise MedusaLoadError(f"cannot read Medusa heads from {path}: {type(error).__name__}: {error}") from None
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise MedusaLoadError(f"{path} holds no tensor dictionary of Medusa heads")
        return state, path
    raise MedusaLoadError(f"no Medusa heads in {folder}: expected {' or '.join(WEIGHTS_NAMES)} and config.json")


def load_heads(
    source: str | Path,
    hidden_size: int,
    vocab_size: int,
    expected_sha256: str | None = None,
) -> MedusaHeads:
    """Heads from a folder in FasterDecoding's layout, checked against the target's hidden size and vocabulary.

    ``expected_sha256``: refuse a weights file whose digest differs (the shipped heads are checked this way).
    """
    folder = Path(source).expanduser()
    if not folder.is_dir():
        raise MedusaLoadError(f"Medusa heads not found: {source} is not a folder")
    try:
        raw = json.loads((folder / "config.json").read_text())
        num_heads = int(raw["medusa_num_heads"])
        num_layers = int(raw.get("medusa_num_layers", 1))
    except FileNotFoundError:
        raise MedusaLoadError(f"no config.json in {folder}: not a Medusa heads folder") from None
    except (ValueError, KeyError, TypeError) as error:
        raise MedusaLoadError(f"{folder / 'config.json'} is not a Medusa config ({error})") from None
    state, weights_path = _read_state(folder)
    if expected_sha256 is not None:
        digest = file_sha256(weights_path)
        if digest != expected_sha256:
            raise MedusaLoadError(
                f"{weights_path} is damaged or replaced: sha256 {digest[:16]}…, expected {expected_sha256[:16]}…"
            )
    if num_heads < 1 or num_layers < 0:
        raise MedusaLoadError(f"{folder}: medusa_num_heads must be >= 1 and medusa_num_layers >= 0")
    own_lm_head = f"0.{num_layers}.weight" in state
    for k in range(num_heads):
        for layer in range(num_layers):
            weight = state.get(f"{k}.{layer}.linear.weight")
            if weight is None or f"{k}.{layer}.linear.bias" not in state:
                raise MedusaLoadError(f"{weights_path}: missing weights of head {k}, layer {layer}")
            if tuple(weight.shape) != (hidden_size, hidden_size):
                raise MedusaLoadError(
                    f"these Medusa heads are for hidden size {weight.shape[-1]}, the target's is {hidden_size}"
                )
        if own_lm_head:
            head = state.get(f"{k}.{num_layers}.weight")
            if head is None:
                raise MedusaLoadError(f"{weights_path}: head {k} has no LM head weight")
            if head.shape[1] != hidden_size:
                raise MedusaLoadError(
                    f"these Medusa heads are for hidden size {head.shape[1]}, the target's is {hidden_size}"
                )
            if head.shape[0] != vocab_size:
                raise MedusaLoadError(
                    f"these Medusa heads score a vocabulary of {head.shape[0]} tokens, the target's has {vocab_size}"
                )
    declared_vocab = raw.get("vocab_size")
    if not own_lm_head and declared_vocab is not None and int(declared_vocab) != vocab_size:
        raise MedusaLoadError(f"these Medusa heads are for a vocabulary of {declared_vocab} tokens, the target's has "
                              f"{vocab_size}")
    if num_layers == 0 and not own_lm_head:
        raise MedusaLoadError(f"{weights_path}: heads with no layers need an LM head of their own")
    config = MedusaConfig(
        num_heads=num_heads,
        num_layers=num_layers,
        hidden_size=hidden_size,
        vocab_size=vocab_size,
        own_lm_head=own_lm_head,
        head_tokens=int(raw.get("head_tokens", 0) or 0),
        base_model=str(raw.get("base_model_name_or_path", "")),
    )
    heads = MedusaHeads(config)
    own = heads.state_in_fasterdecoding_layout()
    with torch.no_grad():
        for name, tensor in own.items():
            tensor.copy_(state[name].float())
    heads.eval().requires_grad_(False)
    return heads


def shipped_heads_for(target_source: str) -> tuple[Path, str] | None:
    """(folder, sha256) of the heads shipped with specdemo for this target (an offline-pack name), or None."""
    from ..backends.offline import is_offline_source, offline_name

    if not is_offline_source(target_source):
        return None
    return SHIPPED_HEADS.get(offline_name(target_source))


# ----------------------------------------------------------------------------------------------------------------
# drafting


#: the most rounds a tree drafter sits out (heads not scored) after trees that did not pay, before it looks again
MAX_REST = 32


class MedusaDrafter:
    """Drafts from Medusa heads on the hidden state of the target's last accepted position: no second model.

    Head k's guess is the token k + 1 places after that position, i.e. k places after the token the target has
    just written. ``tree=False`` drafts a chain of each head's top token (sampled from each head's warped
    distribution under sampling settings, which rejection sampling makes exact); ``tree=True`` (greedy only)
    drafts the most likely nodes of the tree of the heads' top ``top_width`` tokens. ``verify_cost`` (seconds of a
    verify pass over n tokens, from the measured cost curve) sizes each tree: the node count that maximises
    expected tokens per second, none when a plain step is better; without it a tree uses its whole budget.
    ``head_tokens``: score this many of the lowest token ids plus the prompt's and EOS (None = the heads' own
    setting; 0 = the whole vocabulary).
    """

    name = "medusa"
    needs_hidden_states = True

    def __init__(
        self,
        heads: MedusaHeads,
        lm_head_weight: torch.Tensor | None,
        sampling: SamplingSettings,
        target_vocab_size: int,
        eos_token_ids: Sequence[int] = (),
        tree: bool = False,
        top_width: int = 4,
        head_tokens: int | None = None,
        generator: torch.Generator | None = None,
        verify_cost: Callable[[int], float] | None = None,
    ) -> None:
        if tree and not sampling.greedy:
            raise ValueError("a Medusa tree is verified greedily only; sampled runs use the chain")
        self.heads = heads
        self.lm_head_weight = lm_head_weight
        self.sampling = sampling
        self.target_vocab_size = target_vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.tree = tree
        self.top_width = top_width
        self.head_tokens = heads.config.head_tokens if head_tokens is None else head_tokens
        self.generator = generator
        self.verify_cost = verify_cost
        self._hidden: torch.Tensor | None = None
        self._token_ids: torch.Tensor | None = None
        self._weight: torch.Tensor | None = None
        self._expected = 0.0  # predicted accepted tokens, summed over rounds (decayed), for calibrating scores
        self._observed = 0.0
        self._last_expected = 0.0  # the tree just proposed: its predicted accepted tokens
        self._heads_seconds: float | None = None  # scoring the heads, seconds a round (an average that leans low)
        self._rest = 1  # rounds to sit out (heads not scored) after the next round whose best tree does not pay
        self._resting = 0  # rounds left to sit out now

    @property
    def num_heads(self) -> int:
        return self.heads.config.num_heads

    def start(self, prompt_ids: Sequence[int], prefill: TargetPass | None = None) -> None:
        if prefill is None or prefill.hidden_states is None:
            raise ValueError("Medusa heads need the target's hidden states from the prompt's pass")
        self._hidden = prefill.hidden_states[-1]
        self._rest, self._resting = 1, 0
        device = self._hidden.device
        vocab = self.target_vocab_size
        self._token_ids = None
        if self.head_tokens and self.head_tokens < vocab:
            ids = head_token_ids(self.head_tokens, vocab, prompt_ids, self.eos_token_ids)
            self._token_ids = torch.tensor(ids, dtype=torch.long, device=device)
        self._weight = None
        if self.heads.lm_heads is None:
            assert self.lm_head_weight is not None
            with torch.inference_mode():
                weight = self.lm_head_weight[:vocab]
                self._weight = weight if self._token_ids is None else weight.index_select(0, self._token_ids)

    @torch.inference_mode()
    def _head_logits(self) -> torch.Tensor:
        assert self._hidden is not None
        hidden = self._hidden.view(1, -1)
        if self._weight is not None:
            return self.heads.logits(hidden, self._weight)[:, 0]
        return self.heads.logits(hidden, None, self._token_ids)[:, 0]

    def _vocab_id(self, index: torch.Tensor) -> torch.Tensor:
        return index if self._token_ids is None else self._token_ids[index]

    @torch.inference_mode()
    def propose(self, context: Sequence[int], max_tokens: int) -> Proposal:
        if max_tokens <= 0 or self._hidden is None:
            return Proposal()
        if self._resting > 0:  # the last trees did not pay for the heads: a plain step, heads not even scored
            self._resting -= 1
            return Proposal()
        started = now(self._hidden.device)
        logits = self._head_logits()[: min(self.num_heads, max_tokens) if not self.tree else self.num_heads]
        if self.tree:
            probs = logits.float().softmax(-1)
            top = probs.topk(min(self.top_width, probs.shape[-1]), dim=-1)
            tokens, parents, scores = build_tree(top.values, self._vocab_id(top.indices), max_tokens)
            seconds = now(self._hidden.device) - started
            self._heads_seconds = seconds if self._heads_seconds is None else min(seconds, 0.8 * self._heads_seconds
                                                                                  + 0.2 * seconds)
            count = self._tree_size(scores)
            self._last_expected = sum(scores[:count])
            self._pace(count)
            return Proposal(tokens[:count], None, 0.0, parents[:count])
        if self.sampling.greedy:
            return Proposal([int(t) for t in self._vocab_id(logits.argmax(-1)).tolist()])
        rows, tokens = [], []
        for head_logits in logits:
            probs = target_distribution(head_logits, self.sampling)
            choice = torch.multinomial(probs, 1, generator=self.generator)
            tokens.append(int(self._vocab_id(choice)[0]))
            rows.append(to_target_vocab(probs, self._token_ids, self.target_vocab_size))
        return Proposal(tokens, torch.stack(rows))

    def _pace(self, count: int) -> None:
        """After a tree that pays, score the heads every round; after one that does not, sit out ``_rest`` rounds
        (1, 2, 4 ... up to :data:`MAX_REST` while no tree pays), and let the calibration of the heads' scores drift
        back toward trusting them, so that a later stretch of predictable text can win them back."""
        if self.verify_cost is None:
            return
        if count > 0:
            self._rest = 1
            return
        self._resting = self._rest
        self._rest = min(2 * self._rest, MAX_REST)
        self._expected *= 0.9
        self._observed *= 0.9

    def _tree_size(self, scores: list[float]) -> int:
        """How many of the best nodes pay for their place in the verify pass, the heads' own cost counted (all,
        without a cost model)."""
        if self.verify_cost is None or not scores:
            return len(scores)
        # heads' probabilities are not calibrated: scale them by how many tokens such trees really gave
        ratio = (self._observed + 1.0) / (self._expected + 1.0)
        heads = self._heads_seconds or 0.0
        best_count, best_rate = 0, 1.0 / self.verify_cost(1)
        expected = 1.0
        for count, score in enumerate(scores, start=1):
            expected += ratio * score
            rate = expected / (heads + self.verify_cost(count + 1))
            if rate > best_rate:
                best_count, best_rate = count, rate
        return best_count

    def feedback(self, result: RoundResult) -> None:
        if result.target_pass is None or result.target_pass.hidden_states is None:
            raise ValueError("Medusa heads need the target's hidden states from every verify pass")
        self._hidden = result.target_pass.hidden_states[result.verdict.last_row]
        if self.tree and result.num_drafted:
            self._expected = 0.9 * self._expected + self._last_expected
            self._observed = 0.9 * self._observed + result.num_accepted


# ----------------------------------------------------------------------------------------------------------------
# the two modes


@dataclass(frozen=True)
class MedusaOptions:
    """``medusa_heads``: a folder of heads (FasterDecoding's layout); None: the heads shipped for the target."""

    medusa_heads: str | None = None

    def validate(self) -> None:
        pass


#: Medusa heads loaded per target model (freed with it), by source folder
_HEADS: "weakref.WeakKeyDictionary[torch.nn.Module, dict[str, MedusaHeads]]" = weakref.WeakKeyDictionary()


def heads_for(target: LoadedModel, source: str | None = None) -> MedusaHeads:
    """The Medusa heads for ``target`` in its format and on its device: from ``source`` (a folder), or the heads
    shipped for an offline target (sha256-checked); InputError with one line when there are none or they misfit."""
    expected_sha256 = None
    if source is None:
        shipped = shipped_heads_for(target.source)
        if shipped is None:
            raise InputError(
                f"no Medusa heads ship for {target.source}: name a heads folder (--medusa-heads PATH), or use "
                "offline:qwen2.5-coder-1.5b",
                field="medusa_heads",
            )
        folder, expected_sha256 = shipped
        source = str(folder)
    per_model = _HEADS.setdefault(target.model, {})
    if source in per_model:
        return per_model[source]
    head = target.model.get_output_embeddings()
    try:
        heads = load_heads(source, head.in_features, head.out_features, expected_sha256)
    except MedusaLoadError as error:
        raise InputError(str(error), field="medusa_heads") from None
    heads = heads.to(device=target.device, dtype=target.dtype)
    per_model[source] = heads
    return heads


def _check(target: LoadedModel, draft: LoadedModel | None, options: Any) -> None:
    heads_for(target, options.medusa_heads)  # none shipped for this target, or misfit: one line, before any pass


def _build(context: BuildContext, tree: bool) -> MedusaDrafter:
    target, settings = context.target, context.settings
    weight = output_weight(target.model)
    tree = tree and settings.sampling.greedy  # sampling is exact on a chain only
    policy = context.policy
    return MedusaDrafter(
        heads_for(target, context.options.medusa_heads),
        weight,
        settings.sampling,
        target_vocab_size=weight.shape[0],
        eos_token_ids=target.eos_token_ids,
        tree=tree,
        generator=drafter_generator(settings.sampling.seed, target.device),
        verify_cost=tree_verify_cost(policy, tree),
    )


def _policy(context: PolicyContext, tree: bool) -> DraftLengthPolicy:
    # a chain is at most one token per head
    return heads_policy(context, tree, heads_for(context.target, context.options.medusa_heads).config.num_heads)


METHODS = (
    Method(
        name="medusa",
        label="Medusa heads on the target, a tree of candidates (no draft model)",
        build=lambda context: _build(context, tree=True),
        options=MedusaOptions,
        drafts_for_free=True,
        proposes_trees=True,
        needs_hidden_states=True,
        check=_check,
        make_policy=lambda context: _policy(context, tree=True),
    ),
    Method(
        name="medusa-chain",
        label="Medusa heads on the target, each head's top token (no draft model)",
        build=lambda context: _build(context, tree=False),
        options=MedusaOptions,
        drafts_for_free=True,
        needs_hidden_states=True,
        check=_check,
        make_policy=lambda context: _policy(context, tree=False),
    ),
)
