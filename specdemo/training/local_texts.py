"""Prose passages from text on this machine, for training prompts that quote a text (summaries, translations,
questions over a passage, retrieval-style context, extraction): English manual pages, the descriptions of the
installed Python packages, the language reference in ``pydoc_data`` and the standard library's module docstrings.

Nothing here reads the benchmark prompt files. Which passages a machine has depends on what it has installed, so
the prompt pool built from them is stored (:mod:`specdemo.training.prompt_pool`), not rebuilt on each machine.
"""

from __future__ import annotations

import ast
import gzip
import importlib.metadata
import logging
import random
import re
from dataclasses import dataclass
from pathlib import Path

from .common import stdlib_files
from .corpus import _paragraphs

logger = logging.getLogger(__name__)

#: English manual sections read (commands, file formats, overviews, administration)
MAN_SECTIONS = ("man1", "man5", "man7", "man8")
#: a passage's words: enough to say something, short enough for a prompt
PASSAGE_MIN_WORDS, PASSAGE_MAX_WORDS = 60, 220
#: roff escapes: font changes, named and numbered characters, size changes, zero-width and line-join marks
_ROFF_ESCAPES = [
    (re.compile(r"\\f(\(..|\[[^\]]*\]|.)"), ""),
    (re.compile(r"\\s[+-]?\d+"), ""),
    (re.compile(r"\\\((aq|cq|oq)"), "'"),
    (re.compile(r"\\\((dq|lq|rq)"), '"'),
    (re.compile(r"\\\((em|en)"), "-"),
    (re.compile(r"\\\(bu"), "*"),
    (re.compile(r"\\\(.."), ""),
    (re.compile(r"\\\[[^\]]*\]"), ""),
    (re.compile(r"\\\*(\(..|\[[^\]]*\]|.)"), ""),
    (re.compile(r"\\[-]"), "-"),
    (re.compile(r"\\[&c%|^]"), ""),
    (re.compile(r"\\e"), "\\\\"),
    (re.compile(r"\\ "), " "),
]


@dataclass(frozen=True)
class Passage:
    """A prose passage and where it came from (``man:ls(1)``, ``package:requests``, ``pydoc:topic``, ...)."""

    source: str
    text: str


def roff_text(source: str) -> dict[str, list[str]]:
    """A manual page's prose by section (``NAME``, ``DESCRIPTION``, ...): paragraphs of plain text, with roff
    requests dropped and the text of font macros (``.B``, ``.IR`` ...) kept. Good enough for prose passages, not a
    renderer (tables and displays come out as runs of words, and are skipped by the length rules)."""
    sections: dict[str, list[str]] = {}
    section, paragraph = "", []

    def close() -> None:
        if paragraph:
            sections.setdefault(section, []).append(" ".join(" ".join(paragraph).split()))
            paragraph.clear()

    for line in source.splitlines():
        if line.startswith((".", "'")):
            request, _, rest = line[1:].partition(" ")
            if request in ("SH", "SS"):
                close()
                section = _unescape(rest).strip().strip('"').upper() if request == "SH" else section
            elif request in ("PP", "LP", "P", "sp", "TP", "IP", "HP", "br", "RS", "RE", "nf", "fi", "TS", "TE"):
                close()
            elif request in ("B", "I", "BR", "IR", "RB", "RI", "BI", "IB", "SM", "SB"):
                paragraph.append(_unescape(rest.replace('"', "")))
            continue
        paragraph.append(_unescape(line))
    close()
    return sections


def _unescape(text: str) -> str:
    for pattern, replacement in _ROFF_ESCAPES:
        text = pattern.sub(replacement, text)
    return text


def _fits(text: str) -> bool:
    words = len(text.split())
    return PASSAGE_MIN_WORDS <= words <= PASSAGE_MAX_WORDS and sum(c.isalpha() for c in text) > 0.6 * len(text)


def man_passages(root: Path = Path("/usr/share/man"), limit: int = 20000, seed: int = 0) -> list[Passage]:
    """Paragraphs of English manual pages' DESCRIPTION sections (at most ``limit`` pages read, drawn by ``seed``;
    up to three paragraphs each)."""
    pages = [path for section in MAN_SECTIONS for path in sorted((root / section).glob("*.gz"))]
    random.Random(f"man/{seed}").shuffle(pages)
    passages = []
    for path in pages[:limit]:
        try:
            source = gzip.decompress(path.read_bytes()).decode("utf-8", errors="replace")
        except (OSError, EOFError):
            continue
        if source.startswith(".so "):  # a page that points at another
            continue
        paragraphs = [p for p in roff_text(source).get("DESCRIPTION", []) if _fits(p)]
        name = path.name.removesuffix(".gz")
        passages.extend(Passage(f"man:{name}", p) for p in paragraphs[:3])
    return passages


def package_passages() -> list[Passage]:
    """Prose paragraphs of the installed distributions' long descriptions (their READMEs), markup removed."""
    passages = []
    seen: set[str] = set()
    for distribution in sorted(importlib.metadata.distributions(), key=lambda d: d.metadata["Name"] or ""):
        name = distribution.metadata["Name"] or "?"
        if name.lower() in seen or name.lower() == "specdemo":  # not this project's own README
            continue
        seen.add(name.lower())
        description = distribution.metadata.get_payload() or distribution.metadata.get("Description") or ""
        for block in description.split("\n\n"):
            if block.lstrip().startswith(("```", "    ", "..", "|", "<", "[!", "!", ">>>", "$", "#", "=", "-")):
                continue
            text = " ".join(re.sub(r"[`*_]{1,2}|\[([^\]]+)\]\([^)]*\)", r"\1", block).split())
            if _fits(text):
                passages.append(Passage(f"package:{name}", text))
    return passages


def stdlib_passages() -> list[Passage]:
    """Module docstrings of the standard library (their prose paragraphs) and the language reference's prose."""
    passages = [Passage("pydoc", p) for p in _paragraphs() if _fits(p)]
    for path in stdlib_files():
        try:
            doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for block in (doc or "").split("\n\n"):
            text = " ".join(block.split())
            if _fits(text):
                passages.append(Passage(f"stdlib:{path.stem}", text))
    return passages


def local_passages(seed: int = 0) -> list[Passage]:
    """Every passage this machine offers, distinct texts only, in a seeded order."""
    found = man_passages(seed=seed) + package_passages() + stdlib_passages()
    unique = list({passage.text: passage for passage in found}.values())
    random.Random(f"passages/{seed}").shuffle(unique)
    counts: dict[str, int] = {}
    for passage in unique:
        kind = passage.source.split(":")[0]
        counts[kind] = counts.get(kind, 0) + 1
    logger.info("local passages: %s", ", ".join(f"{count} from {kind}" for kind, count in sorted(counts.items())))
    return unique
