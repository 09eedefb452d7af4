"""A race log written as files: the JSON log, the HTML replay, the GIF and the MP4, each whole or not at all.

Used by ``python -m specdemo.record`` and the app's download row. No torch and no Gradio here.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

from ..core.files import atomic_path
from ..session.racelog import RaceLog, dump
from .html_replay import render_html
from .video import GIF_SETTINGS, FrameCallback, VideoSettings, write_gif, write_mp4

logger = logging.getLogger(__name__)

#: the files a race can be written as, in the order they are written (cheap ones first)
FORMATS = ("json", "html", "gif", "mp4")


def write_recording(
    log: RaceLog, kind: str, path: str | Path, speed: float = 1.0, on_frame: FrameCallback | None = None
) -> Path:
    """Write one rendering of ``log`` (``kind`` from :data:`FORMATS`) atomically; returns the path. ``speed``: race
    seconds per video second; ``on_frame(done, total)`` follows a video's frames."""
    if kind not in FORMATS:
        raise ValueError(f"unknown recording format {kind!r}; formats: {', '.join(FORMATS)}")
    path = Path(path)
    with atomic_path(path) as partial:
        if kind == "json":
            dump(log, partial)
        elif kind == "html":
            partial.write_text(render_html(log), encoding="utf-8")
        elif kind == "mp4":
            write_mp4(log, partial, VideoSettings(speed=speed), on_frame)
        else:
            write_gif(log, partial, replace(GIF_SETTINGS, speed=speed), on_frame)
    logger.info("Wrote %s", path)
    return path
