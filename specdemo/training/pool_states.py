"""The target's states over the prompt pool's answers, cached once for both trainers.

At the pool's scale (millions of positions) one teacher-forced pass of the target costs hours on a CPU, so the
EAGLE trainer (:mod:`specdemo.training.eagle`) and the Medusa trainer (:mod:`specdemo.training.medusa`) share it:
per sequence the shard holds what the EAGLE head reads (the token ids, the states of its layers at every position,
the target's greedy next token from the answer's first prediction on) and what Medusa heads read (the final,
post-norm hidden state at those same answer positions). Whichever trainer runs first writes the shards; the other
reads them. The folder is named by the answers (target, format, answer length), the count, the held-out split and
the layers, not by either trainer's own corpus, so a shard means one thing wherever it is read.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from . import common
from .common import read_shards, write_shards

#: bumped when what a shard holds changes
CACHE_FORMAT = 1


def pool_states_folder(answers_name: str, count: int, held_out_every: int, layers: tuple[int, ...]) -> Path:
    """The folder of the states over the first ``count`` stored answers ``answers_name`` (one in
    ``held_out_every`` held out), with the EAGLE ``layers``, in the user's cache (not under a trainer's
    ``--cache-dir``, which is that trainer's own)."""
    keyed = [CACHE_FORMAT, answers_name, count, held_out_every, list(layers)]
    key = hashlib.sha256(json.dumps(keyed).encode()).hexdigest()[:12]
    return common.CACHE_HOME / "pool-states" / f"{answers_name}-{count}-{key}"


@torch.inference_mode()
def sequence_states(model, ids: list[int], answer_start: int, layers: tuple[int, ...]) -> dict:
    """One teacher-forced pass of the target over ``ids``: the ids (int32), the states of ``layers`` at every
    position and the final hidden state from the answer's first prediction on (bfloat16), and the target's greedy
    next token from there on (-1 before), on the CPU."""
    device = next(model.parameters()).device
    inputs = torch.tensor([ids], device=device)
    start = answer_start - 1  # this position predicts the answer's first token
    out = model.get_decoder()(input_ids=inputs, output_hidden_states=True)
    final = out.last_hidden_state[0, start:]
    greedy = torch.full((inputs.shape[1],), -1, dtype=torch.int32)
    greedy[start:] = model.get_output_embeddings()(final).argmax(-1).cpu().to(torch.int32)
    states = torch.cat([out.hidden_states[layer][0] for layer in layers], dim=-1)
    return {"ids": inputs[0].cpu().to(torch.int32), "states": states.to(torch.bfloat16).cpu(), "greedy": greedy,
            "final": final.to(torch.bfloat16).cpu(), "answer_start": answer_start}


def _combine(rows: list[dict]) -> dict:
    return {"ids": torch.cat([r["ids"] for r in rows]), "states": torch.cat([r["states"] for r in rows]),
            "greedy": torch.cat([r["greedy"] for r in rows]), "final": torch.cat([r["final"] for r in rows]),
            "lengths": torch.tensor([len(r["ids"]) for r in rows]),
            "answer_starts": torch.tensor([r["answer_start"] for r in rows])}


def cache_split(model, sequences: list[dict], folder: Path, name: str, layers: tuple[int, ...]) -> None:
    """Store :func:`sequence_states` of every sequence in shards under ``folder`` (existing shards kept)."""

    def per_sequence(sequence: dict) -> dict:
        return sequence_states(model, sequence["ids"], sequence["answer_start"], layers)

    write_shards(sequences, folder, name, per_sequence, _combine, f"caching target states ({name}, shared)")


def final_states(folder: Path, name: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """What Medusa heads learn from: the final hidden states at every answer position [A, H] (bfloat16) and, per
    sequence, the target's greedy tokens there (from the answer's first prediction on)."""
    hidden, greedy_per_sequence = [], []
    for shard in read_shards(folder, name, mmap=True):
        hidden.append(shard["final"])
        offset = 0
        for length, start in zip(shard["lengths"].tolist(), shard["answer_starts"].tolist()):
            greedy_per_sequence.append(shard["greedy"][offset + start - 1 : offset + length].long())
            offset += length
    return torch.cat(hidden), greedy_per_sequence
