"""Errors meant for users: one plain line, fit to show as is."""

from __future__ import annotations


class InputError(ValueError):
    """Bad user input, with a message fit to show as is; ``field`` names the input at fault when one is."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


def first_line(error: BaseException) -> str:
    """The first line of an error's message (its type's name when the message is empty)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
