"""Requests written by the target itself (Magpie, Xu et al. 2024, arXiv 2406.08464): an instruction-tuned model
given only its chat template up to the start of the user's turn writes, sampled, what a user would ask.

A plain pre-query template lets the model pick any subject; Qwen2.5-Coder then mostly asks for code. So each
request is steered by a system message naming a domain (:data:`DOMAINS`: writing, advice, role play, reasoning,
math, science, history, coding, code editing, data, ...), as Magpie's task-specific variants do; the answers are
later written under the ordinary chat template, as a race asks. A request is kept when the model ended the user's
turn itself within :data:`MAX_REQUEST_TOKENS`, is between :data:`MIN_REQUEST_CHARS` and :data:`MAX_REQUEST_CHARS`
long and holds no template marker; a near-identical one is dropped by the pool.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from typing import TYPE_CHECKING

from ..core.settings import SamplingSettings
from .batch_generation import generate_batch

if TYPE_CHECKING:
    from ..backends.loading import LoadedModel

logger = logging.getLogger(__name__)

#: the longest request, in tokens (a request running past it is dropped, not cut)
MAX_REQUEST_TOKENS = 160
MIN_REQUEST_CHARS, MAX_REQUEST_CHARS = 24, 1500
#: sampling as Magpie's: the model's own distribution, barely trimmed
REQUEST_SAMPLING = SamplingSettings(temperature=1.0, top_p=0.99)
#: what the user of each request wants help with (the system message names it)
DOMAINS = [
    "writing an email or a letter", "a piece of creative writing such as a story or a poem", "editing and improving "
    "a text they wrote", "personal advice about work, study or relationships", "planning a trip or an event",
    "health, fitness and nutrition", "personal finance and budgeting", "cooking and recipes",
    "a role-play in which you act as a character they describe", "a logic puzzle or a reasoning question",
    "a math word problem", "algebra, calculus or probability", "a physics or chemistry question",
    "a biology or medicine question", "a history question", "philosophy and ethics", "economics and business",
    "law and everyday legal questions", "learning a foreign language", "translating a text they give you",
    "summarizing a text they paste in", "extracting information from a text or a table they give you",
    "writing a Python program", "debugging code they paste in", "refactoring or reviewing code they paste in",
    "JavaScript and web development", "SQL and databases", "shell commands and Linux administration",
    "data analysis with pandas", "algorithms and data structures", "machine learning concepts",
    "explaining a technical concept simply", "brainstorming ideas", "comparing products or options",
    "a question about geography and travel", "music, film and books", "games and sports",
    "parenting and education", "careers and job interviews", "home improvement and gardening",
]
#: the system message's wording
SYSTEM_MESSAGE = ("You are a helpful AI assistant. The user will ask you for help with {domain}. The user's request "
                  "is specific and detailed.")
_MARK = "\ue000USER\ue001"


def pre_query(tokenizer, domain: str) -> tuple[str, str]:
    """The chat template's text up to where the user's message begins (a system message naming ``domain``), and
    what the template writes right after a user's message (where the model ends the user's turn)."""
    rendered = tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM_MESSAGE.format(domain=domain)}, {"role": "user", "content": _MARK}],
        tokenize=False,
    )
    before, _, after = rendered.partition(_MARK)
    if not after and _MARK not in rendered:
        raise ValueError("the tokenizer's chat template does not show the user's message")
    return before, after


def _end_of_turn_ids(tokenizer, after: str, eos_ids: list[int]) -> list[int]:
    ids = tokenizer(after, add_special_tokens=False)["input_ids"]
    return list(dict.fromkeys(([ids[0]] if ids else []) + eos_ids))


def usable(text: str) -> bool:
    text = text.strip()
    return (MIN_REQUEST_CHARS <= len(text) <= MAX_REQUEST_CHARS and "<|" not in text and "|>" not in text
            and not text.lower().startswith(("assistant", "system", "user:")))


def write_requests(loaded: "LoadedModel", count: int, seed: int, start: int = 0) -> list[tuple[str, str]]:
    """Up to ``count`` requests (domain, text) sampled in one batch; request ``start + i`` of a run is steered by
    domain ``(start + i) % len(DOMAINS)`` and the batch is seeded by ``seed`` and ``start``, so a resumed run
    samples what the stopped one would have. Unusable samples are left out (fewer than ``count`` come back)."""
    tokenizer = loaded.tokenizer
    domains = [DOMAINS[(start + i) % len(DOMAINS)] for i in range(count)]
    headers, stops = [], []
    for domain in domains:
        before, after = pre_query(tokenizer, domain)
        headers.append(tokenizer(before, add_special_tokens=False)["input_ids"])
        stops = _end_of_turn_ids(tokenizer, after, loaded.eos_token_ids)
    sampling = dataclasses.replace(REQUEST_SAMPLING, seed=random.Random(
        f"requests/{seed}/{start}").randrange(1 << 31))
    written = generate_batch(loaded, headers, MAX_REQUEST_TOKENS, stops, sampling)
    requests = []
    for domain, (ids, stopped) in zip(domains, written):
        text = tokenizer.decode(ids, skip_special_tokens=True).strip()
        if stopped and usable(text):
            requests.append((domain, text))
    return requests
