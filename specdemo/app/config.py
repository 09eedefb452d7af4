"""What the app serves: the session's settings (:class:`~specdemo.session.config.SessionConfig`) plus the page's."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ..session.config import SessionConfig
from ..session.prompts import Prompt, PromptFileError, load_prompts

logger = logging.getLogger(__name__)

#: the draft-tokens control's choices: the two schedules that choose k themselves, then fixed lengths
DRAFT_TOKENS_CHOICES = ["adaptive", "heuristic", *[str(k) for k in range(1, 13)]]
#: categories of the labelled examples, in display order
EXAMPLE_CATEGORIES = ("chat", "code-writing", "code-editing", "summarization", "translation")


@dataclass
class AppConfig(SessionConfig):
    """The session's settings, and the page's: update rate, initial control values, examples, queue, ZeroGPU."""

    update_interval: float = 0.25  # seconds between UI updates during a race (the final state is always sent)
    max_new_tokens: int = 128  # the max-new-tokens control's initial value
    draft_tokens: str = "adaptive"  # the draft-tokens control's initial value: adaptive, heuristic or "1".."12"
    examples: list[Prompt] | None = None  # None: the bundled prompt set
    gpu_duration: int = 120  # ZeroGPU seconds per race
    max_queue: int | None = 32
    title: str = "Speculative decoding race"


def draft_length_of(choice: Any) -> tuple[Any, Any]:
    """The request's (``num_draft_tokens_schedule``, ``num_draft_tokens``) of a draft-tokens choice: "adaptive" or
    "heuristic" from the schedule's own start, anything else that many tokens every round (checked with the rest of
    the request)."""
    return (choice, None) if choice in DRAFT_TOKENS_CHOICES[:2] else ("fixed", choice)


def example_prompts(config: AppConfig) -> list[tuple[str, str]]:
    """(label, text) of one prompt per example category, from the bundled prompt set."""
    try:
        prompts = config.examples if config.examples is not None else load_prompts()
    except PromptFileError as error:
        logger.warning("No examples: %s", error)
        return []
    chosen: list[tuple[str, str]] = []
    for category in EXAMPLE_CATEGORIES:
        for prompt in prompts:
            if prompt.category == category:
                words = " ".join(prompt.text.split()[:6])
                label = f"{category.replace('-', ' ').capitalize()}: {words}…"
                chosen.append((label, prompt.text))
                break
    return chosen
