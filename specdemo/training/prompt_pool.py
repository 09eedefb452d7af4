"""The pool of training prompts the heads learn the target's answers to: thousands of distinct requests across
what users race, built offline and stored with the checkout.

Two kinds of prompt make the pool:

- **templated** (:func:`templated_prompts`): the project's chat prompts (advice, explanations, humanities, lists,
  arithmetic, plans, puzzles, rewriting, role play, STEM, writing; :func:`~.corpus.chat_prompt` under the pool's
  own seed), code writing and code editing over the standard library's functions, and prompts that quote
  passages of text on this machine (:mod:`.local_texts`): summaries, translations, questions over a passage,
  extraction, and retrieval-style questions over three numbered documents;
- **written by the target** (:mod:`.magpie`): given only its chat template up to the user's turn, an
  instruction-tuned model writes a plausible request (Magpie, Xu et al. 2024, arXiv 2406.08464).

Every prompt near-identical to one already in the pool is dropped (:mod:`.near_duplicates`). The benchmark prompt
files are never read here; ``tests/test_prompt_pool.py`` checks that no stored prompt is near-identical to a
benchmark prompt. The pool is stored as gzip JSON-lines shards (:class:`~.row_shards.RowShards`) under
``assets/training/pool/``: which passages a machine has depends on what it has installed, and the target's requests
are sampled, so the stored pool, not a rebuild, is what every later run answers.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .common import CHECKOUT_ANSWERS, stdlib_files
from .corpus import (
    CODE_EDITS,
    EXTRACTION_ASKS,
    LANGUAGES,
    PASSAGE_WORDS,
    QUESTION_ASKS,
    SUMMARY_ASKS,
    TRANSLATION_ASKS,
    _paragraphs,
    chat_prompt,
    documented_functions,
    passage,
)
from .local_texts import Passage, local_passages
from .near_duplicates import ShingleIndex
from .row_shards import RowShards

logger = logging.getLogger(__name__)

#: bumped when :func:`templated_prompts` would build a different pool
POOL_VERSION = 1
#: where the pool and the target's answers to it are stored with the checkout
POOL_FOLDER = CHECKOUT_ANSWERS / "pool"
#: the pool's shards: ``prompts-0000.jsonl.gz`` ...
POOL_NAME = "prompts"
#: the share of each templated kind (a kind without material, say no manual pages, gives its share to the rest)
TEMPLATED_SHARES = {
    "chat": 0.30, "code writing": 0.12, "code editing": 0.12, "summary": 0.10, "translation": 0.08,
    "passage question": 0.10, "passage extraction": 0.08, "retrieval": 0.10,
}
#: the seed namespace of the pool's chat prompts (the older chat-answers set used seed 0)
CHAT_SEED_OFFSET = 1000
RETRIEVAL_ASKS = [
    "Answer the question using only the documents below, and say which document you used.\n\n{documents}\n\n"
    "Question: What is {name} for, according to these documents?",
    "{documents}\n\nUsing the documents above, explain what {name} does and when someone would use it. Cite the "
    "document number.",
    "You are given three documents.\n\n{documents}\n\nWhich document is about {name}? Summarize what it says in two "
    "sentences.",
    "Context:\n{documents}\n\nBased on the context, answer: what should a beginner know about {name}?",
]


@dataclass(frozen=True)
class PoolPrompt:
    """One prompt of the pool: its kind, where its material came from, and its text."""

    kind: str
    source: str
    text: str

    def row(self, index: int) -> dict:
        return {"index": index, "kind": self.kind, "source": self.source, "text": self.text}


def stdlib_functions(seed: int) -> list[tuple[str, str, str]]:
    """(module, source, first docstring sentence) of every public standard-library function of 4 to 30 lines with
    a docstring, in a seeded order."""
    found = [(path.stem, source, sentence) for path in stdlib_files()
             for source, sentence in documented_functions(path)]
    random.Random(f"functions/{seed}").shuffle(found)
    return found


def _subject(source: str) -> str:
    """What a passage is about, as a question can name it: a manual page's command, a package's name."""
    name = source.partition(":")[2] or "the language reference"
    return name.rsplit(".", 1)[0] if source.startswith("man:") else name


class _Material:
    """What the templated makers draw from: functions and passages, each used once where it can be."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(f"pool/{POOL_VERSION}/{seed}")
        self.functions = stdlib_functions(seed)
        self.passages = local_passages(seed)
        self.paragraphs = _paragraphs()
        self._next_function = 0
        self._next_passage = 0

    def function(self) -> tuple[str, str, str]:
        function = self.functions[self._next_function % len(self.functions)]
        self._next_function += 1
        return function

    def passage(self) -> Passage:
        chosen = self.passages[self._next_passage % len(self.passages)]
        self._next_passage += 1
        return chosen


def _makers(material: _Material, seed: int) -> dict[str, Callable[[int], PoolPrompt]]:
    """Each templated kind's maker: prompt number ``i`` of that kind."""
    rng = material.rng

    def chat(i: int) -> PoolPrompt:
        made = chat_prompt(i, seed + CHAT_SEED_OFFSET, material.paragraphs)
        return PoolPrompt(made.kind, "template", made.text)

    def code_writing(i: int) -> PoolPrompt:
        module, _, sentence = material.function()
        ask = rng.choice(["Write a Python function that does the following: {}.",
                          "Implement this in Python, with a docstring and an example: {}.",
                          "Write a small, well-tested Python function: {}. Include pytest tests."])
        return PoolPrompt("code writing", f"stdlib:{module}", ask.format(sentence))

    def code_editing(i: int) -> PoolPrompt:
        module, source, _ = material.function()
        return PoolPrompt("code editing", f"stdlib:{module}", f"{rng.choice(CODE_EDITS)}\n\n```python\n{source}```")

    def quoted(kind: str, asks: list[str], words: int = PASSAGE_WORDS) -> Callable[[int], PoolPrompt]:
        def make(i: int) -> PoolPrompt:
            chosen = material.passage()
            text = passage(chosen.text, words)
            ask = rng.choice(asks)
            return PoolPrompt(kind, chosen.source, ask.format(
                text=text, language=rng.choice(LANGUAGES), n=rng.randint(2, 4), words=rng.choice([40, 60, 80])))
        return make

    def retrieval(i: int) -> PoolPrompt:
        documents = [rng.choice(material.passages) for _ in range(3)]
        asked = rng.randrange(3)
        listed = "\n\n".join(f"[{n + 1}] {passage(d.text, 90)}" for n, d in enumerate(documents))
        text = rng.choice(RETRIEVAL_ASKS).format(documents=listed, name=_subject(documents[asked].source))
        return PoolPrompt("retrieval", documents[asked].source, text)

    makers: dict[str, Callable[[int], PoolPrompt]] = {"chat": chat}
    if material.functions:
        makers.update({"code writing": code_writing, "code editing": code_editing})
    if material.passages:
        makers.update({
            "summary": quoted("summary", SUMMARY_ASKS),
            "translation": quoted("translation", TRANSLATION_ASKS, PASSAGE_WORDS // 2),
            "passage question": quoted("passage question", QUESTION_ASKS),
            "passage extraction": quoted("passage extraction", EXTRACTION_ASKS),
            "retrieval": retrieval,
        })
    return makers


def templated_prompts(count: int, seed: int = 0, index: ShingleIndex | None = None) -> list[PoolPrompt]:
    """``count`` distinct templated prompts in the shares of :data:`TEMPLATED_SHARES`, kinds interleaved in a
    seeded order; one near-identical to an earlier one (or to a text of ``index``) is drawn again."""
    material = _Material(seed)
    makers = _makers(material, seed)
    shares = {kind: share for kind, share in TEMPLATED_SHARES.items() if kind in makers}
    total = sum(shares.values())
    wanted = {kind: round(count * share / total) for kind, share in shares.items()}
    wanted["chat"] += count - sum(wanted.values())
    order = [kind for kind, n in wanted.items() for _ in range(n)]
    random.Random(f"order/{seed}").shuffle(order)
    index = index if index is not None else ShingleIndex()
    made: dict[str, int] = {kind: 0 for kind in wanted}
    prompts: list[PoolPrompt] = []
    for kind in order:
        for _attempt in range(20):
            prompt = makers[kind](made[kind])
            made[kind] += 1
            if index.closest(prompt.text) is None:
                index.add(prompt.text)
                prompts.append(prompt)
                break
    logger.info("templated prompts: %d of %d asked (%s)", len(prompts), count,
                ", ".join(f"{kind} {sum(p.kind == kind or (kind == 'chat' and p.source == 'template') for p in prompts)}"
                          for kind in wanted))
    return prompts


def pool_shards(folder: Path = POOL_FOLDER) -> RowShards:
    return RowShards(folder, POOL_NAME)


def read_pool(folder: Path = POOL_FOLDER) -> list[PoolPrompt]:
    """The stored pool, in index order (empty when none is stored)."""
    rows = pool_shards(folder).rows()
    missing = [i for i in range(len(rows)) if i not in rows]
    if missing:
        raise ValueError(f"{folder}: the prompt pool misses indexes {missing[:5]} ...: its shards are incomplete")
    return [PoolPrompt(rows[i]["kind"], rows[i]["source"], rows[i]["text"]) for i in range(len(rows))]


def pool_index(prompts: list[PoolPrompt]) -> ShingleIndex:
    index = ShingleIndex()
    for prompt in prompts:
        index.add(prompt.text)
    return index


def store_templated(count: int, seed: int = 0, folder: Path = POOL_FOLDER) -> list[PoolPrompt]:
    """The stored pool, started with ``count`` templated prompts when it holds none yet."""
    stored = read_pool(folder)
    if stored:
        return stored
    prompts = templated_prompts(count, seed)
    shards = pool_shards(folder)
    shards.append(prompt.row(i) for i, prompt in enumerate(prompts))
    shards.seal(only_full=False)
    return prompts
