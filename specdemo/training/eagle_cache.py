"""The EAGLE-3 trainer's cache of the target's states (:mod:`specdemo.training.eagle`): one teacher-forced pass of
the frozen target over every sequence, storing the ids, the states of the layers the head reads (bfloat16) and
the target's greedy next token, in shards (a restart resumes where the cache stopped); and the sets of the
target's own answers in the corpus, answered (or reused from any trainer's cache) and cached.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .common import (
    ANSWERS_FILE,
    answer_sequences,
    answers_elsewhere,
    generate_answers,
    portable_path,
    write_shards,
)
from .corpus import TrainingPrompt
from .eagle_unrolled import Split, load_split
from .pool_states import Deadline, eagle_split, fill_within


@torch.inference_mode()
def sequence_states(model, ids: list[int], answer_start: int, layers: tuple[int, ...]) -> dict:
    """One teacher-forced pass of the target over ``ids``: the ids (int32), the states of ``layers`` at every
    position (bfloat16) and the target's greedy next token from the answer's first prediction on (-1 before),
    on the CPU, with ``answer_start``."""
    inputs = torch.tensor([ids], device=next(model.parameters()).device)
    start = answer_start - 1  # this position predicts the answer's first token
    out = model(input_ids=inputs, output_hidden_states=True, logits_to_keep=inputs.shape[1] - start)
    states = torch.cat([out.hidden_states[layer][0] for layer in layers], dim=-1)
    greedy = torch.full((inputs.shape[1],), -1, dtype=torch.int32)
    greedy[start:] = out.logits[0].argmax(-1).cpu().to(torch.int32)
    return {"ids": inputs[0].cpu().to(torch.int32), "states": states.to(torch.bfloat16).cpu(), "greedy": greedy,
            "answer_start": answer_start}


def cache_split(model, sequences: list[dict], folder: Path, name: str, layers: tuple[int, ...]) -> None:
    """Run the target over ``sequences`` with teacher forcing and store, per sequence, :func:`sequence_states`, in
    shards (existing shards kept)."""

    def per_sequence(sequence: dict) -> dict:
        return sequence_states(model, sequence["ids"], sequence["answer_start"], layers)

    def combine(rows: list[dict]) -> dict:
        return {"ids": torch.cat([r["ids"] for r in rows]), "states": torch.cat([r["states"] for r in rows]),
                "greedy": torch.cat([r["greedy"] for r in rows]),
                "lengths": torch.tensor([len(r["ids"]) for r in rows]),
                "answer_starts": torch.tensor([r["answer_start"] for r in rows])}

    write_shards(sequences, folder, name, per_sequence, combine, f"caching target states ({name})")


@dataclass
class AnswerSet:
    """One set of the target's own answers in the corpus: ``name`` (its figures' key in ``training.json``), the
    answers' ``key`` and ``folder``, the ``shards`` folder of its cached states, its ``prompts`` (None: the
    training prompts) and ``count``, how many of the first answers the head learns from (0: answered only, for
    passage prompts to quote)."""

    name: str
    key: str
    folder: Path
    shards: Path
    prompts: Callable[[], list[TrainingPrompt]] | None
    count: int
    rows: list[dict] = field(default_factory=list)
    counts: dict = field(default_factory=dict)
    #: answers stored elsewhere (the prompt pool's), read instead of generated
    stored: Callable[[], list[dict]] | None = None
    #: its states are the pool's, stored by prompt index in ``shards`` and shared with the Medusa trainer
    #: (:mod:`.pool_states`), not this trainer's own shards
    shared: bool = False
    #: the training and held-out sequences, by split name
    sequences: dict[str, list[dict]] = field(default_factory=dict)

    def prepare(self, loaded, spec, layers: tuple[int, ...],
                deadline: Deadline | None = None) -> tuple[float, float]:
        """The answers (reused from any trainer's cache or the checkout, else generated) and the cached states
        of the first ``count``; (seconds answering, seconds caching). The pool's states are filled within
        ``deadline``: :class:`~.pool_states.FillStopped` when it ends first."""
        started = time.perf_counter()
        reused = None
        if self.stored is not None:
            self.rows = self.stored()
        else:
            own = self.folder / ANSWERS_FILE
            elsewhere = [path for path in answers_elsewhere(self.key) if path != own]
            reused = portable_path(elsewhere[0]) if elsewhere and not own.is_file() else None
            self.rows = generate_answers(loaded, spec, own, start_from=elsewhere[0] if elsewhere else None,
                                         prompts=self.prompts() if self.prompts is not None else None)
        answered = time.perf_counter()
        if not self.count:
            return answered - started, 0.0
        learned = self.rows[: self.count]
        train_seqs, held_seqs = answer_sequences(loaded.tokenizer, learned, spec)
        self.sequences = {"train": train_seqs, "heldout": held_seqs}
        if self.shared:  # mostly recorded while the pool was answered: only what is missing runs the target
            fill_within(loaded.model, train_seqs + held_seqs, self.shards, layers, deadline)
        else:
            cache_split(loaded.model, train_seqs, self.shards, "train", layers)
            cache_split(loaded.model, held_seqs, self.shards, "heldout", layers)
        self.counts = {"training_sequences": len(train_seqs), "held_out_sequences": len(held_seqs),
                       "mean_answer_tokens": round(sum(len(r["answer_ids"]) for r in learned) / max(1, len(learned)),
                                                   1),
                       **({"kinds": dict(sorted(Counter(r["kind"] for r in learned).items()))}
                          if self.prompts is not None or self.stored is not None else {}),
                       "answer_positions": sum(len(r["answer_ids"]) for r in learned),
                       "reused_from": reused}
        return answered - started, time.perf_counter() - answered

    def split(self, name: str) -> Split:
        """The cached states of the ``train`` or ``heldout`` sequences, mapped from the files."""
        if self.shared:
            return eagle_split(self.shards, self.sequences[name])
        return load_split(self.shards, name)
