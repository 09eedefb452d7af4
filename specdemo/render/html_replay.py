"""A race log as one self-contained HTML page that replays the race at true speed.

Everything is inline (CSS, script, data; no network): the page opens from ``file://``. The panes, cards, legend and
hover titles are the app's own views (:mod:`specdemo.render.views`), rendered here once per round; the script only
appends them when the playback clock passes each round's end on its side's own compute clock. Controls: play /
pause, restart, speed (0.5x to 4x) and a scrubber. ``window.specdemoReplay`` exposes ``play``, ``pause``, ``seek``
and ``setSpeed``; ``document.body.dataset.state`` says ``playing``, ``paused`` or ``ended``.
"""

from __future__ import annotations

import html
import json
import logging
from typing import Any

from ..session.racelog import SIDES, RaceLog
from ..session.state import RaceState
from .views import (
    CSS,
    figures_html,
    identical_html,
    legend_html,
    pane_stats_html,
    pane_titles,
    race_details,
    race_title,
    render_tokens,
    speedup_html,
)

logger = logging.getLogger(__name__)

SPEEDS = (0.5, 1.0, 2.0, 4.0)
CARDS = ("speedup", "figures", "identical")

REPLAY_CSS = """
* { box-sizing: border-box; }
body { margin: 0; padding: 16px; font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif;
  color: #111827; background: #f9fafb; }
main { max-width: 1400px; margin: 0 auto; }
h1 { font-size: 22px; margin: 0 0 4px 0; }
.race-title { font-size: 14px; font-weight: 600; color: #374151; margin: 0; overflow-wrap: anywhere; }
.race-details { font-size: 12.5px; color: #6b7280; margin: 2px 0 8px 0; }
details.prompt { font-size: 13px; margin: 0 0 8px 0; }
details.prompt pre { white-space: pre-wrap; overflow-wrap: anywhere; background: #fff; border: 1px solid #e5e7eb;
  border-radius: 8px; padding: 8px 10px; margin: 6px 0 0 0; max-height: 200px; overflow: auto; }
.controls { display: flex; flex-wrap: wrap; align-items: center; gap: 8px 10px; margin: 8px 0; position: sticky;
  top: 0; background: #f9fafb; padding: 6px 0; z-index: 2; }
.controls button { font: inherit; font-size: 14px; padding: 6px 12px; border-radius: 8px; border: 1px solid #d1d5db;
  background: #fff; color: #111827; cursor: pointer; min-height: 36px; }
.controls button.primary { background: #16a34a; border-color: #16a34a; color: #fff; font-weight: 600; min-width: 84px; }
.controls button[aria-pressed="true"] { background: #111827; border-color: #111827; color: #fff; }
.speeds { display: inline-flex; gap: 4px; }
.scrub { flex: 1 1 220px; display: flex; align-items: center; gap: 8px; min-width: 200px; }
.scrub input { flex: 1; }
.clock { font-variant-numeric: tabular-nums; font-size: 13px; color: #374151; white-space: nowrap; }
.legend-row { display: flex; flex-wrap: wrap; align-items: center; gap: 4px 16px; }
.legend-row label { font-size: 13px; }
.panes { display: grid; grid-template-columns: 1fr 1fr; gap: 14px; margin: 8px 0; }
.pane { min-width: 0; }
.pane .tok-box { max-height: 460px; overflow-y: auto; }
.cards { display: grid; grid-template-columns: 1fr 2fr 1fr; gap: 12px; align-items: stretch; }
footer { font-size: 12px; color: #6b7280; margin-top: 14px; }
@media (max-width: 760px) {
  body { padding: 10px; }
  h1 { font-size: 18px; }
  .panes, .cards { grid-template-columns: 1fr; }
  .pane .tok-box { min-height: 140px; max-height: 42vh; font-size: 12.5px; }
  .fig-main .fig-value { font-size: 28px; }
}
"""

REPLAY_JS = """
(() => {
  const data = JSON.parse(document.getElementById('race-data').textContent);
  const byId = (id) => document.getElementById(id);
  const boxes = {plain: byId('plain-output'), spec: byId('spec-output')};
  const heads = {plain: byId('plain-stats'), spec: byId('spec-stats')};
  const cards = {speedup: byId('speedup'), figures: byId('figures'), identical: byId('identical')};
  const playButton = byId('play'), scrubber = byId('scrubber'), clockLabel = byId('clock');
  const timeline = data.timeline, duration = data.duration;
  let clock = 0, next = 0, speed = 1, playing = false, lastTick = null;

  const setState = (state) => { document.body.dataset.state = state; };
  const fmt = (seconds) => seconds.toFixed(2) + ' s';

  function reset() {
    for (const side of ['plain', 'spec']) { boxes[side].innerHTML = ''; heads[side].innerHTML = data.start[side]; }
    for (const key in cards) cards[key].innerHTML = data.start[key];
    next = 0;
  }

  function advance(to) {
    const added = {plain: '', spec: ''};
    while (next < timeline.length && timeline[next].t <= to) {
      const entry = timeline[next++];
      for (const side of ['plain', 'spec']) {
        if (entry[side]) added[side] += entry[side];
        if (entry[side + '_stats']) heads[side].innerHTML = entry[side + '_stats'];
      }
      for (const key in cards) if (entry[key]) cards[key].innerHTML = entry[key];
    }
    for (const side of ['plain', 'spec']) {
      if (added[side]) {
        boxes[side].insertAdjacentHTML('beforeend', added[side]);
        boxes[side].scrollTop = boxes[side].scrollHeight;
      }
    }
  }

  function show() {
    clockLabel.textContent = fmt(clock) + ' / ' + fmt(duration);
    scrubber.value = String(duration > 0 ? Math.round(1000 * clock / duration) : 1000);
  }

  function seek(to) {
    to = Math.max(0, Math.min(duration, to));
    if (to < clock) reset();
    clock = to;
    advance(clock);
    show();
    if (clock >= duration && next >= timeline.length) finish();
    else if (!playing) setState('paused');
  }

  function finish() {
    playing = false;
    playButton.textContent = 'Replay';
    setState('ended');
  }

  function tick(now) {
    if (!playing) return;
    if (lastTick !== null) clock = Math.min(duration, clock + (now - lastTick) / 1000 * speed);
    lastTick = now;
    advance(clock);
    show();
    if (clock >= duration) { finish(); return; }
    requestAnimationFrame(tick);
  }

  function play() {
    if (document.body.dataset.state === 'ended') { reset(); clock = 0; }
    playing = true;
    lastTick = null;
    playButton.textContent = 'Pause';
    setState('playing');
    requestAnimationFrame(tick);
  }

  function pause() {
    playing = false;
    playButton.textContent = 'Play';
    setState('paused');
  }

  function setSpeed(value) {
    speed = value;
    document.querySelectorAll('[data-speed]').forEach((button) => {
      button.setAttribute('aria-pressed', String(Number(button.dataset.speed) === value));
    });
  }

  playButton.addEventListener('click', () => (playing ? pause() : play()));
  byId('restart').addEventListener('click', () => { reset(); clock = 0; show(); play(); });
  document.querySelectorAll('[data-speed]').forEach((button) => {
    button.addEventListener('click', () => setSpeed(Number(button.dataset.speed)));
  });
  scrubber.addEventListener('input', () => {
    const wasPlaying = playing;
    playing = false;
    seek(duration * Number(scrubber.value) / 1000);
    if (wasPlaying && clock < duration) play();
  });
  byId('show-rejected').addEventListener('change', (event) => {
    document.body.classList.toggle('show-rejected', event.target.checked);
  });
  document.addEventListener('keydown', (event) => {
    if (event.key === ' ' && event.target === document.body) { event.preventDefault(); playing ? pause() : play(); }
  });

  window.specdemoReplay = {play, pause, seek, setSpeed, duration};
  reset();
  show();
  play();
})();
"""


def _script_json(value: Any) -> str:
    """JSON that is safe inside a ``<script>`` element: no ``<``, ``>`` or ``&`` characters at all."""
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def replay_data(log: RaceLog) -> dict[str, Any]:
    """What the page's script plays: the starting views, then one timeline entry per round (both sides merged in
    order of their own clocks) holding the round's new token spans and the views that changed, then the final
    views at the end of the race."""
    titles = dict(zip(SIDES, pane_titles(log.settings)))
    state = RaceState(log.settings)
    panes = {"plain": state.plain, "spec": state.spec}

    def head(side: str, running: bool) -> str:
        return pane_stats_html(panes[side], *titles[side], running=running)

    start = {side: head(side, running=False) for side in SIDES}
    start.update(speedup=speedup_html(None), figures=figures_html(None), identical=identical_html(None))
    timeline: list[dict[str, Any]] = []
    shown = dict(start)
    for event in log.timeline():
        pane = panes[event.side]
        before = len(pane.shown)
        pane.add(event)
        entry: dict[str, Any] = {"t": event.counters.seconds, event.side: render_tokens(pane.shown[before:])}
        views = {
            f"{event.side}_stats": head(event.side, running=True),
            "speedup": speedup_html(state),
            "figures": figures_html(state),
            "identical": identical_html(state),
        }
        for key, value in views.items():
            if shown.get(key) != value:
                entry[key] = shown[key] = value
        timeline.append(entry)
    state.conclude(log)
    final = {f"{side}_stats": head(side, running=False) for side in SIDES}
    final.update(speedup=speedup_html(state), figures=figures_html(state), identical=identical_html(state))
    timeline.append({"t": log.seconds, **final})
    return {"duration": log.seconds, "start": start, "timeline": timeline}


def render_html(log: RaceLog) -> str:
    """The whole page as one string (deterministic: the same log gives the same page)."""
    settings = log.settings
    title = race_title(settings)
    speeds = "".join(
        f'<button type="button" data-speed="{speed:g}" aria-pressed="{str(speed == 1.0).lower()}">{speed:g}×</button>'
        for speed in SPEEDS
    )
    panes = "".join(
        f'<section class="pane"><div id="{side}-stats"></div><div class="tok-box" id="{side}-output"></div></section>'
        for side in SIDES
    )
    cards = "".join(f'<div id="{card}"></div>' for card in CARDS)
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>Speculative decoding race: {html.escape(title)}</title>
<style>{CSS}{REPLAY_CSS}</style>
</head>
<body data-state="paused">
<main>
<h1>⚡ Speculative decoding race (replay)</h1>
<p class="race-title">{html.escape(title)}</p>
<p class="race-details">{html.escape(race_details(settings))}</p>
<details class="prompt"><summary>Prompt</summary><pre>{html.escape(settings.prompt)}</pre></details>
<div class="controls">
<button type="button" id="play" class="primary">Play</button>
<button type="button" id="restart">Restart</button>
<span class="speeds" role="group" aria-label="speed">{speeds}</span>
<span class="scrub"><input type="range" id="scrubber" min="0" max="1000" value="0" aria-label="position">
<span class="clock" id="clock"></span></span>
</div>
<div class="legend-row">{legend_html()}
<label><input type="checkbox" id="show-rejected"> show rejected drafts (struck through)</label></div>
<div class="panes">{panes}</div>
<div class="cards">{cards}</div>
<footer>Each pane fills on its own side's compute clock, as in the app's fair race; hover a token for its
round and probabilities. Recorded with specdemo (python -m specdemo.record).</footer>
</main>
<script id="race-data" type="application/json">{_script_json(replay_data(log))}</script>
<script>{REPLAY_JS}</script>
</body>
</html>
"""
