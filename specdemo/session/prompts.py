"""Prompt sets: the bundled demo prompts and Spec-Bench style JSON-lines files."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

__all__ = [
    "Prompt",
    "PromptFileError",
    "bundled_prompts_path",
    "categories_of",
    "load_prompts",
]

_SIMPLE_KEYS = ("id", "category", "prompt")
_SPECBENCH_KEYS = ("question_id", "category", "turns")


class PromptFileError(ValueError):
    """A prompt file is missing, malformed, or yields no usable prompts."""


@dataclass(frozen=True)
class Prompt:
    """One prompt: a unique id, a category label and the user text."""

    id: str
    category: str
    text: str


def bundled_prompts_path() -> Path:
    """Path of the prompt set shipped with the package."""
    try:
        from importlib.resources import files

        resource = files("specdemo") / "data" / "prompts.jsonl"
        path = Path(str(resource))
        if path.is_file():
            return path
    except (ModuleNotFoundError, TypeError, ValueError) as exc:  # pragma: no cover - unusual installs
        logger.debug("importlib.resources lookup failed: %s", exc)
    return Path(__file__).resolve().parents[1] / "data" / "prompts.jsonl"


def categories_of(prompts: Iterable[Prompt]) -> list[str]:
    """Distinct categories of ``prompts``, in order of first appearance."""
    seen: dict[str, None] = {}
    for prompt in prompts:
        seen.setdefault(prompt.category, None)
    return list(seen)


def _parse_record(record: Any, where: str) -> Prompt:
    """Turn one decoded JSON line (either supported format) into a Prompt."""
    if not isinstance(record, dict):
        raise PromptFileError(f"{where}: expected a JSON object, got {type(record).__name__}")

    if "turns" in record or "question_id" in record:
        missing = [k for k in _SPECBENCH_KEYS if k not in record]
        if missing:
            raise PromptFileError(
                f"{where}: Spec-Bench record is missing key(s) {', '.join(missing)}"
            )
        turns = record["turns"]
        if not isinstance(turns, list) or not turns:
            raise PromptFileError(f"{where}: 'turns' must be a non-empty list of strings")
        pid, text = str(record["question_id"]), turns[0]
    elif "prompt" in record or "id" in record:
        missing = [k for k in _SIMPLE_KEYS if k not in record]
        if missing:
            raise PromptFileError(f"{where}: prompt record is missing key(s) {', '.join(missing)}")
        pid, text = str(record["id"]), record["prompt"]
    else:
        missing_simple = [k for k in _SIMPLE_KEYS if k not in record]
        missing_sb = [k for k in _SPECBENCH_KEYS if k not in record]
        raise PromptFileError(
            f"{where}: not a prompt record; simple form needs {', '.join(missing_simple)}, "
            f"Spec-Bench form needs {', '.join(missing_sb)} (keys found: {', '.join(sorted(record)) or 'none'})"
        )

    category = record["category"]
    if not isinstance(category, str) or not category.strip():
        raise PromptFileError(f"{where}: 'category' must be a non-empty string")
    if not isinstance(text, str):
        raise PromptFileError(f"{where}: prompt text must be a string, got {type(text).__name__}")
    if not text.strip():
        raise PromptFileError(f"{where}: prompt {pid!r} has an empty text")
    return Prompt(id=pid, category=category, text=text)


def load_prompts(
    path: str | Path | None = None,
    categories: Sequence[str] | None = None,
    limit: int | None = None,
    per_category: int | None = None,
) -> list[Prompt]:
    """Load prompts from a JSON-lines file (the bundled set when ``path`` is None).

    Each non-blank line is either the simple form ``{"id", "category", "prompt"}`` or a
    Spec-Bench record ``{"question_id", "category", "turns"}`` (first turn used).
    ``categories`` keeps exact category matches; ``per_category`` keeps the first N of each category (a balanced
    sample of a large set such as Spec-Bench's); ``limit`` keeps the first N after filtering.
    Raises PromptFileError with a one-line message on any problem.
    """
    if limit is not None and limit < 1:
        raise PromptFileError(f"limit must be at least 1, got {limit}")
    if per_category is not None and per_category < 1:
        raise PromptFileError(f"per-category count must be at least 1, got {per_category}")
    file = bundled_prompts_path() if path is None else Path(path).expanduser()
    if not file.is_file():
        raise PromptFileError(f"prompt file not found: {file}")
    try:
        content = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PromptFileError(f"cannot read prompt file {file}: {exc}") from exc

    prompts: list[Prompt] = []
    first_line_of: dict[str, int] = {}
    for lineno, line in enumerate(content.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{file}:{lineno}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PromptFileError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno})") from exc
        prompt = _parse_record(record, where)
        if prompt.id in first_line_of:
            raise PromptFileError(
                f"{where}: duplicate prompt id {prompt.id!r} (first seen on line {first_line_of[prompt.id]})"
            )
        first_line_of[prompt.id] = lineno
        prompts.append(prompt)

    if not prompts:
        raise PromptFileError(f"prompt file contains no prompts: {file}")

    if categories is not None:
        if isinstance(categories, str):
            categories = [categories]
        wanted = set(categories)
        selected = [p for p in prompts if p.category in wanted]
        if not selected:
            raise PromptFileError(
                f"no prompts in categories {', '.join(sorted(wanted)) or '(none given)'}; "
                f"available: {', '.join(categories_of(prompts))}"
            )
        prompts = selected

    if per_category is not None:
        seen: dict[str, int] = {}
        balanced = []
        for prompt in prompts:
            seen[prompt.category] = seen.get(prompt.category, 0) + 1
            if seen[prompt.category] <= per_category:
                balanced.append(prompt)
        prompts = balanced
    if limit is not None:
        prompts = prompts[:limit]
    logger.debug("loaded %d prompts from %s", len(prompts), file)
    return prompts
