"""A race log as video frames (Pillow), encoded as MP4 (H.264 through imageio-ffmpeg's own ffmpeg) or GIF.

Each frame shows the race at one moment of the fair clock: a title line (pair, mode, hardware), both panes with
their coloured, wrapped tokens (scrolling once the text outgrows the pane), each pane's own clock and tokens/s,
and the live speedup; the final card (speedup, acceptance, accepted length, expected speedup, identical or not)
is held at the end. Frames are drawn incrementally (each round's tokens once, onto a tall canvas per pane) and
depend on the log and the :class:`VideoSettings` only: the same log gives the same frames.
"""

from __future__ import annotations

import html
import logging
import math
import re
import unicodedata
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable, Iterator

from PIL import Image, ImageDraw, ImageFont

from ..core.events import REJECTED, TokenEvent
from ..session.racelog import SIDES, RaceLog
from ..session.state import RaceState
from .views import (
    KIND_COLOURS,
    identical_html,
    live_speedup,
    pane_titles,
    race_details,
    race_title,
)

logger = logging.getLogger(__name__)

#: called after each frame with (frames done, frames in all)
FrameCallback = Callable[[int, int], None]

BACKGROUND = "#f9fafb"
INK = "#111827"
MUTED = "#6b7280"
BORDER = "#e5e7eb"
GOOD = "#16a34a"
BAD = "#dc2626"
#: the identical-output badge's text colour, by the badge's kind (as in the app's CSS)
BADGE_COLOURS = {"same": "#166534", "tie": "#92400e", "diff": "#991b1b", "info": "#075985", "pending": MUTED}
#: the layout is designed for this width and scaled to the chosen one
DESIGN_WIDTH = 1280
#: text shrinks with the frame down to this fraction of its design size, no further (a 640-wide GIF stays legible)
MIN_TEXT_SCALE = 0.72
#: the fastest pace of a video: race seconds per video second
MAX_SPEED = 100
#: the longest video a recording makes, in seconds (a longer race needs a higher speed)
MAX_VIDEO_SECONDS = 600


@dataclass(frozen=True)
class VideoSettings:
    """Size, frame rate and pace of a recording."""

    width: int = 1280
    height: int = 720
    fps: int = 30
    speed: float = 1.0  # race seconds per video second (2: twice as fast as the race ran)
    hold_seconds: float = 2.0  # the final card stays this long

    def validate(self) -> None:
        if self.width < 320 or self.height < 180 or self.width % 2 or self.height % 2:
            raise ValueError(f"the video size must be even and at least 320x180, got {self.width}x{self.height}")
        if not 1 <= self.fps <= 60:
            raise ValueError(f"fps must be between 1 and 60, got {self.fps}")
        if not (0.05 <= self.speed <= MAX_SPEED):
            raise ValueError(f"speed must be between 0.05 and {MAX_SPEED}, got {self.speed}")
        if not (0 <= self.hold_seconds <= 60):
            raise ValueError(f"the final card's hold must be between 0 and 60 s, got {self.hold_seconds}")


#: GIFs: half the size and a third of the frame rate, for files small enough for a README
GIF_SETTINGS = VideoSettings(width=640, height=360, fps=10)


@lru_cache(maxsize=None)
def _font(name: str, size: int) -> ImageFont.FreeTypeFont:
    """A DejaVu font shipped with matplotlib (present wherever the project is installed)."""
    import matplotlib

    return ImageFont.truetype(str(Path(matplotlib.get_data_path()) / "fonts" / "ttf" / name), size)


def frame_times(log: RaceLog, video: VideoSettings) -> list[float]:
    """The race clock shown by each frame: from 0 to the race's end in steps of speed / fps, the end included,
    then the end again for the held final card."""
    step = video.speed / video.fps
    racing = math.ceil(log.seconds / step - 1e-9) + 1
    if racing - 1 > MAX_VIDEO_SECONDS * video.fps:
        needed = math.ceil(log.seconds / MAX_VIDEO_SECONDS)
        remedy = f"record it with --speed {needed} or more" if needed <= MAX_SPEED else "record it as --html"
        raise ValueError(f"this race lasts {log.seconds:.0f} s: at speed {video.speed:g} its video would run "
                         f"{racing / video.fps / 60:.0f} min, more than {MAX_VIDEO_SECONDS // 60} min; {remedy}")
    held = round(video.hold_seconds * video.fps)
    return [min(log.seconds, i * step) for i in range(racing)] + [log.seconds] * held


def _printable(text: str) -> str:
    """A token piece as the grid draws it: tabs as four spaces, other control characters dropped."""
    text = text.replace("\t", "    ")
    return "".join(c for c in text if c == "\n" or unicodedata.category(c)[0] != "C")


class _TokenCanvas:
    """One pane's text: tokens wrapped on a monospace grid and drawn once, onto a canvas that grows downwards."""

    def __init__(self, columns: int, rows: int, cell: tuple[float, int], font: ImageFont.FreeTypeFont) -> None:
        self.columns, self.visible_rows = columns, rows
        self.cell_width, self.line_height = cell
        self.font = font
        self.image = Image.new("RGB", (math.ceil(columns * self.cell_width), 2 * rows * self.line_height), "white")
        self.draw = ImageDraw.Draw(self.image)
        self.row, self.column = 0, 0

    def _grow(self) -> None:
        taller = Image.new("RGB", (self.image.width, 2 * self.image.height), "white")
        taller.paste(self.image, (0, 0))
        self.image, self.draw = taller, ImageDraw.Draw(taller)

    def _segment(self, text: str, kind: str) -> None:
        if (self.row + 2) * self.line_height > self.image.height:
            self._grow()
        background, ink = KIND_COLOURS.get(kind, KIND_COLOURS["plain"])
        x = self.column * self.cell_width
        y = self.row * self.line_height
        self.draw.rectangle(
            (round(x), y + 1, round(x + len(text) * self.cell_width) - 1, y + self.line_height - 2), fill=background
        )
        self.draw.text((x, y + self.line_height // 2), text, font=self.font, fill=ink, anchor="lm")
        self.column += len(text)

    def add(self, token: TokenEvent) -> None:
        lines = _printable(token.text).split("\n")
        for number, line in enumerate(lines):
            if number:
                self.row, self.column = self.row + 1, 0
            if self.column + len(line) > self.columns >= len(line) and self.column:
                # wrap before a token that fits on a line of its own, at its leading space if it has one
                if line.startswith(" "):
                    if self.column < self.columns:
                        self._segment(" ", token.kind)
                    line = line[1:]
                self.row, self.column = self.row + 1, 0
            while line:
                if self.column >= self.columns:
                    self.row, self.column = self.row + 1, 0
                room = self.columns - self.column
                self._segment(line[:room], token.kind)
                line = line[room:]

    def window(self) -> Image.Image:
        """The rows in view: the first ones, or the last ones once the text outgrows the pane."""
        top = max(0, self.row + 1 - self.visible_rows)
        return self.image.crop(
            (0, top * self.line_height, self.image.width, (top + self.visible_rows) * self.line_height)
        )


def _fit(text: str, font: ImageFont.FreeTypeFont, width: int) -> str:
    """``text``, cut short with an ellipsis where it would be wider than ``width`` pixels."""
    if font.getlength(text) <= width:
        return text
    while text and font.getlength(text + "…") > width:
        text = text[:-1]
    return text + "…"


def _plain_text(markup: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", markup)).strip()


class _Frames:
    """Draws the frames of one log at one size."""

    def __init__(self, log: RaceLog, video: VideoSettings) -> None:
        self.log, self.video = log, video
        self.scale = video.width / DESIGN_WIDTH
        px = self.px
        self.text_scale = max(self.scale, MIN_TEXT_SCALE)
        size = self.tx
        self.title_font = _font("DejaVuSans-Bold.ttf", size(21))
        self.text_font = _font("DejaVuSans.ttf", size(15))
        self.small_font = _font("DejaVuSans.ttf", size(13))
        self.head_font = _font("DejaVuSans-Bold.ttf", size(17))
        self.stats_font = _font("DejaVuSansMono.ttf", size(15))
        self.big_font = _font("DejaVuSans-Bold.ttf", size(64))
        self.card_font = _font("DejaVuSans-Bold.ttf", size(26))
        token_font = _font("DejaVuSansMono.ttf", size(15))
        margin, gap = px(24), px(20)
        self.pane_width = (video.width - 2 * margin - gap) // 2
        self.pane_left = {"plain": margin, "spec": margin + self.pane_width + gap}
        self.head_top = self.tx(112)
        self.box_top = self.head_top + self.tx(58)
        self.footer_top = video.height - self.tx(44)
        padding = px(10)
        cell = (token_font.getlength("M"), round(token_font.size * 1.55))
        rows = max(1, (self.footer_top - px(10) - self.box_top - 2 * padding) // cell[1])
        columns = max(8, int((self.pane_width - 2 * padding) // cell[0]))
        self.text_origin = padding
        self.canvases = {side: _TokenCanvas(columns, rows, cell, token_font) for side in SIDES}
        self.box_height = rows * cell[1] + 2 * padding
        self.titles = dict(zip(SIDES, pane_titles(log.settings)))
        self.state = RaceState(log.settings)
        self.timeline = log.timeline()
        self.next = 0
        self.ends = {side: (log.rounds(side)[-1].clock if log.rounds(side) else 0.0) for side in SIDES}
        self.background = self._background()

    def px(self, value: float) -> int:
        """A length of the 1280-pixel-wide design at this video's size."""
        return max(1, round(value * self.scale))

    def tx(self, value: float) -> int:
        """A font size, or a length that holds text, at this video's size (text shrinks less than the frame)."""
        return max(1, round(value * self.text_scale))

    def _background(self) -> Image.Image:
        video, px, tx = self.video, self.px, self.tx
        image = Image.new("RGB", (video.width, video.height), BACKGROUND)
        draw = ImageDraw.Draw(image)
        settings = self.log.settings
        draw.text((px(24), tx(14)), "Speculative decoding race", font=self.title_font, fill=INK)
        room = video.width - 2 * px(24)
        draw.text((px(24), tx(44)), _fit(race_title(settings), self.text_font, room), font=self.text_font,
                  fill="#374151")
        draw.text((px(24), tx(66)), _fit(race_details(settings), self.small_font, room), font=self.small_font,
                  fill=MUTED)
        x = px(24)
        for kind, label in (("accepted", "accepted draft"), ("corrected", "corrected"), ("bonus", "bonus"),
                            ("plain", "plain (target alone)")):
            background, ink = KIND_COLOURS[kind]
            width = round(self.small_font.getlength(label)) + tx(12)
            draw.rounded_rectangle((x, tx(86), x + width, tx(105)), tx(3), fill=background)
            draw.text((x + tx(6), tx(95.5)), label, font=self.small_font, fill=ink, anchor="lm")
            x += width + px(10)
        for side in SIDES:
            left = self.pane_left[side]
            draw.rounded_rectangle(
                (left, self.box_top, left + self.pane_width, self.box_top + self.box_height),
                px(8), fill="white", outline=BORDER, width=max(1, px(1)),
            )
        return image

    def _advance(self, clock: float) -> None:
        while self.next < len(self.timeline) and self.timeline[self.next].counters.seconds <= clock:
            event = self.timeline[self.next]
            self.next += 1
            pane = self.state.plain if event.side == "plain" else self.state.spec
            pane.add(event)
            for token in event.tokens:
                if token.kind != REJECTED:
                    self.canvases[event.side].add(token)

    def _pane_head(self, draw: ImageDraw.ImageDraw, side: str, clock: float) -> None:
        tx = self.tx
        pane = self.state.plain if side == "plain" else self.state.spec
        left, top = self.pane_left[side], self.head_top
        title = self.titles[side][0]
        draw.text((left, top), title, font=self.head_font, fill=INK)
        if pane.finished:
            chip, colours = f"done ({pane.finish_reason})", ("#dcfce7", "#166534")
        elif self.log.stop_reason and clock >= self.log.seconds:
            chip, colours = f"stopped ({self.log.stop_reason})", ("#e5e7eb", "#374151")
        else:
            chip, colours = "running…", ("#fef3c7", "#92400e")
        chip_left = left + round(self.head_font.getlength(title)) + tx(10)
        chip_width = round(self.small_font.getlength(chip)) + tx(14)
        draw.rounded_rectangle((chip_left, top + tx(1), chip_left + chip_width, top + tx(20)), tx(9), fill=colours[0])
        draw.text((chip_left + tx(7), top + tx(11)), chip, font=self.small_font, fill=colours[1], anchor="lm")
        own_clock = min(clock, self.ends[side])
        counters = pane.counters
        rate = counters.new_tokens / counters.seconds if counters.seconds > 0 else 0.0
        stats = f"{rate:.2f} tok/s  {own_clock:.2f} s  {counters.new_tokens} tokens  {counters.target_passes} passes"
        draw.text((left, top + tx(28)), _fit(stats, self.stats_font, self.pane_width), font=self.stats_font, fill=INK)

    def _footer(self, draw: ImageDraw.ImageDraw, clock: float) -> None:
        px, video = self.px, self.video
        left, right = px(24), video.width - px(24)
        duration = self.log.seconds
        draw.rounded_rectangle((left, self.footer_top, right, self.footer_top + px(6)), px(3), fill=BORDER)
        done = left + round((right - left) * (clock / duration if duration > 0 else 1.0))
        draw.rounded_rectangle((left, self.footer_top, max(left + px(6), done), self.footer_top + px(6)), px(3),
                               fill=GOOD)
        speed = f" (shown at {video.speed:g}x)" if video.speed != 1 else ""
        draw.text((left, self.footer_top + self.tx(12)), f"race clock {clock:6.2f} s of {duration:.2f} s{speed}",
                  font=self.small_font, fill=MUTED)
        live = live_speedup(self.state)
        if live is not None:
            text = f"speculative ÷ plain tokens/s so far: {live:.2f}×"
            draw.text((right, self.footer_top + self.tx(12)), text, font=self.small_font, fill=INK, anchor="ra")

    def at(self, clock: float) -> Image.Image:
        """The frame at this moment of the race clock (moments must not go backwards)."""
        self._advance(clock)
        image = self.background.copy()
        draw = ImageDraw.Draw(image)
        for side in SIDES:
            self._pane_head(draw, side, clock)
            origin = (self.pane_left[side] + self.text_origin, self.box_top + self.text_origin)
            image.paste(self.canvases[side].window(), origin)
        self._footer(draw, clock)
        return image

    def final_card(self, image: Image.Image) -> Image.Image:
        """The last frame with the final figures on a card in the middle."""
        tx, video = self.tx, self.video
        state = self.state
        state.conclude(self.log)
        shaded = Image.blend(image, Image.new("RGB", image.size, INK), 0.35)
        draw = ImageDraw.Draw(shaded)
        width, height = min(tx(760), video.width - 2 * self.px(24)), min(tx(330), video.height - 2 * self.px(12))
        left, top = (video.width - width) // 2, (video.height - height) // 2
        comparison = state.comparison
        speedup = comparison.speedup if comparison else None
        accent = GOOD if speedup and speedup >= 1 else BAD
        draw.rounded_rectangle((left, top, left + width, top + height), tx(14), fill="white", outline=accent,
                               width=tx(3))
        centre = video.width // 2
        headline = f"{speedup:.2f}× speedup" if speedup else "no speedup measured"
        note = _fit("speculative vs plain decoding, tokens/s on each side's own compute time", self.small_font, width)
        draw.text((centre, top + tx(64)), headline, font=self.big_font, fill=accent, anchor="mm")
        draw.text((centre, top + tx(118)), note, font=self.small_font, fill=MUTED, anchor="mm")
        metrics = state.spec.metrics()
        expected = comparison.expected_speedup if comparison else None
        figures = [
            ("acceptance", "–" if metrics.acceptance_rate is None else f"{metrics.acceptance_rate:.0%}"),
            ("accepted length", "–" if metrics.mean_accepted_length is None
             else f"{metrics.mean_accepted_length:.2f}"),
            ("expected speedup", "–" if expected is None else f"{expected:.2f}×"),
        ]
        column = width // len(figures)
        for number, (label, value) in enumerate(figures):
            x = left + column * number + column // 2
            draw.text((x, top + tx(176)), value, font=self.card_font, fill=INK, anchor="mm")
            draw.text((x, top + tx(206)), label, font=self.small_font, fill=MUTED, anchor="mm")
        rates = "   ".join(
            f"{name} {pane.metrics().tokens_per_s:.2f} tok/s in {pane.counters.seconds:.2f} s"
            for name, pane in (("plain", state.plain), ("speculative", state.spec))
        )
        draw.text((centre, top + tx(244)), rates, font=self.small_font, fill=INK, anchor="mm")
        badge = identical_html(state)
        verdict = _plain_text(badge)
        colour = BADGE_COLOURS.get(re.search(r"badge-(\w+)", badge)[1], INK)
        draw.text((centre, top + tx(286)), verdict, font=self.text_font, fill=colour, anchor="mm")
        return shaded


def frames(log: RaceLog, video: VideoSettings = VideoSettings()) -> Iterator[Image.Image]:
    """Every frame of the recording, in order (RGB images of the chosen size)."""
    video.validate()
    drawer = _Frames(log, video)
    times = frame_times(log, video)
    racing = len(times) - round(video.hold_seconds * video.fps)
    last = None
    for number, clock in enumerate(times):
        if number < racing:
            last = drawer.at(clock)
            yield last
        else:
            if number == racing:
                last = drawer.final_card(last if last is not None else drawer.at(clock))
            yield last


def write_mp4(log: RaceLog, path: str | Path, video: VideoSettings = VideoSettings(),
              on_frame: FrameCallback | None = None) -> None:
    """H.264 (yuv420p, fast start) through the ffmpeg that imageio-ffmpeg ships; no system ffmpeg needed."""
    import imageio_ffmpeg

    total = len(frame_times(log, video))
    writer = imageio_ffmpeg.write_frames(
        str(path),
        (video.width, video.height),
        fps=video.fps,
        codec="libx264",
        quality=None,
        macro_block_size=2,
        ffmpeg_log_level="error",
        output_params=["-preset", "veryfast", "-tune", "stillimage", "-crf", "24", "-movflags", "+faststart"],
    )
    writer.send(None)
    try:
        for number, image in enumerate(frames(log, video), 1):
            writer.send(image.tobytes())
            if on_frame:
                on_frame(number, total)
    finally:
        writer.close()


def _palette(log: RaceLog, video: VideoSettings) -> Image.Image:
    """One palette for every frame of a GIF: the colours of the last race frame, of the final card, and of every
    token kind (so a kind that has scrolled out of view by the end keeps its colour earlier on)."""
    drawer = _Frames(log, video)
    last = drawer.at(log.seconds)
    card = drawer.final_card(last)
    sample = Image.new("RGB", (video.width, 2 * video.height + 64), "white")
    sample.paste(last, (0, 0))
    sample.paste(card, (0, video.height))
    draw = ImageDraw.Draw(sample)
    colours = [colour for pair in KIND_COLOURS.values() for colour in pair]
    width = video.width // len(colours)
    for number, colour in enumerate(colours):
        draw.rectangle((number * width, 2 * video.height, (number + 1) * width, 2 * video.height + 64), fill=colour)
    return sample.quantize(colors=256, method=Image.Quantize.MEDIANCUT)


def write_gif(log: RaceLog, path: str | Path, video: VideoSettings = GIF_SETTINGS,
              on_frame: FrameCallback | None = None) -> None:
    """An animated GIF on one fixed palette (the final frame's colours), repeating forever."""
    total = len(frame_times(log, video))
    palette = _palette(log, video)
    images = []
    for number, image in enumerate(frames(log, video), 1):
        images.append(image.quantize(palette=palette, dither=Image.Dither.NONE))
        if on_frame:
            on_frame(number, total)
    images[0].save(
        str(path), format="GIF", save_all=True, append_images=images[1:], duration=round(1000 / video.fps), loop=0
    )
