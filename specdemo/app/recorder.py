"""The download row: a finished race's recordings (JSON log, HTML replay, MP4, GIF), written for the page."""

from __future__ import annotations

import logging
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Sequence

import gradio as gr

from ..core.errors import first_line
from ..render.recording import write_recording
from ..session.racelog import RaceLog, RaceLogError

logger = logging.getLogger(__name__)

#: the files of the download row, in order: the cheap ones (written as soon as a race ends), then the videos
RECORD_FILES = ("json", "html")
RECORD_VIDEOS = ("mp4", "gif")
RECORD_LABELS = {"json": "JSON log", "html": "HTML replay", "mp4": "MP4 video", "gif": "GIF"}


class Recorder:
    """Writes a finished race's recordings for download, from the ``/race`` JSON the page holds (its ``"log"``).

    Runs after the race has ended (chained to it, on the device's queue, so it never competes with a race). Each
    call writes into a fresh folder under one temporary folder per app and removes all but the latest few (Gradio
    has copied the files it serves into its own cache by then). A failed render warns in one line and leaves the
    buttons off; the app keeps serving.
    """

    def __init__(self, keep: int = 4) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="specdemo-recordings-"))
        weakref.finalize(self, shutil.rmtree, self.root, ignore_errors=True)
        self.keep = keep
        self.made = 0

    def _folder(self) -> Path:
        self.made += 1
        folder = self.root / f"race-{self.made:05d}"
        folder.mkdir()
        for old in sorted(self.root.iterdir())[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        return folder

    def _write(self, result: dict | None, kinds: Sequence[str]) -> list[Path] | None:
        """The files of ``kinds`` for the race in ``result``; None when there is none or rendering failed."""
        if not isinstance(result, dict) or "log" not in result:
            return None
        try:
            log = RaceLog.from_json(result["log"], source="the race's JSON")
            folder = self._folder()
            return [write_recording(log, kind, folder / f"specdemo-race.{kind}") for kind in kinds]
        except (RaceLogError, OSError, ValueError, RuntimeError) as error:
            logger.exception("Recording the race failed")
            gr.Warning(f"recording failed: {first_line(error)}")
            return None

    @staticmethod
    def _buttons(kinds: Sequence[str], paths: list[Path] | None) -> list[gr.DownloadButton]:
        if paths is None:
            return [gr.DownloadButton(RECORD_LABELS[kind], value=None, interactive=False) for kind in kinds]
        return [
            gr.DownloadButton(f"{RECORD_LABELS[kind]} ({path.stat().st_size / 1e6:.2f} MB)", value=str(path),
                              interactive=True)
            for kind, path in zip(kinds, paths)
        ]

    def files(self, result: dict | None) -> tuple:
        """The JSON log and the HTML replay (milliseconds)."""
        return tuple(self._buttons(RECORD_FILES, self._write(result, RECORD_FILES)))

    def videos(self, result: dict | None) -> tuple:
        """The MP4 and the GIF (seconds on a CPU), and the MP4 again for the preview player."""
        paths = self._write(result, RECORD_VIDEOS)
        return (*self._buttons(RECORD_VIDEOS, paths), str(paths[0]) if paths else None)

    @classmethod
    def clear(cls) -> tuple:
        """Every download off and the preview empty (a new race is starting)."""
        return (*cls._buttons(RECORD_FILES + RECORD_VIDEOS, None), None)
