"""Recording a race: the log and its JSON, the HTML replay (in Chromium), the video, the CLI and the app's downloads.

Races run on the tiny random models (the slow target, so the race lasts about a second and the timing matters).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import tiny_app

from specdemo import record
from specdemo.app import handlers as app_handlers
from specdemo.app import ui
from specdemo.app.recorder import Recorder
from specdemo.render import html_replay, recording, video
from specdemo.render.views import pane_html, race_details
from specdemo.session import racelog
from specdemo.session.racelog import RaceLog, RaceLogError
from specdemo.session.racer import TIME_BUDGET, Racer
from specdemo.session.request import RaceRequest
from specdemo.session.state import RaceState, result_dict

pytestmark = pytest.mark.usefixtures("one_torch_thread", "own_cache")

PROMPT = "hello world the cat sat on the mat"
CHROMIUM = os.environ.get("SPECDEMO_CHROMIUM", "/usr/bin/chromium")


@pytest.fixture(scope="module")
def raced() -> tuple[RaceState, RaceLog]:
    """One finished race on the tiny slow pair, as the app ran it: its final state and its log."""
    racer = Racer(tiny_app.config())
    request = RaceRequest(PROMPT, "tiny-slow", mode="draft", num_draft_tokens="4", max_new_tokens=24, dtype="float32")
    state = None
    for state in racer.run(racer.prepare(request)):
        pass
    assert state is not None and state.done
    return state, state.log()


@pytest.fixture(scope="module")
def log(raced) -> RaceLog:
    return raced[1]


def kinds_and_texts(log: RaceLog, side: str) -> tuple[list[str], str]:
    tokens = [t for r in log.rounds(side) for t in r.tokens]
    return [t.kind for t in tokens], "".join(t.text for t in tokens)


# ---------------------------------------------------------------------------------------------------------------
# the log


def test_log_survives_a_json_round_trip_and_rebuilds_the_race(raced) -> None:
    state, log = raced
    text = racelog.dumps(log)
    again = RaceLog.from_json(json.loads(text))
    assert again == log and racelog.dumps(again) == text
    rebuilt = RaceState.from_log(again)
    for live, replayed in ((state.plain, rebuilt.plain), (state.spec, rebuilt.spec)):
        assert replayed.counters == live.counters  # every running counter, rebuilt in the engine's order
        assert replayed.text == live.text and replayed.ids == live.ids and replayed.shown == live.shown
        assert pane_html(replayed) == pane_html(live)
        assert replayed.finish_reason == live.finish_reason
    assert rebuilt.comparison == state.comparison and rebuilt.identical is True
    assert log.seconds == max(state.plain.counters.seconds, state.spec.counters.seconds)
    figures = json.loads(text)["figures"]  # both sides in the one results schema
    assert figures["spec"]["speedup"] == state.comparison.speedup and figures["spec"]["identical"] is True
    assert figures == {side: run.as_dict() for side, run in state.runs().items()}
    assert figures["spec"]["new_tokens"] == 24 and figures["spec"]["divergence"] is None
    assert log.settings.max_num_draft_tokens == 12
    assert (log.settings.num_draft_tokens_schedule, log.settings.num_draft_tokens) == ("fixed", 4)
    assert "draft tokens 4 ·" in race_details(log.settings)


def test_the_race_api_json_holds_the_log(raced, tmp_path: Path) -> None:
    state, log = raced
    response = result_dict(state)
    assert response["log"] == log.to_json()
    saved = tmp_path / "response.json"
    saved.write_text(json.dumps(response))
    assert racelog.load(saved) == log  # --from takes a saved /race response too
    # and the response's own fields follow from the log
    rebuilt = result_dict(RaceState.from_log(log))
    for key in ("plain", "spec", "comparison", "mode", "num_draft_tokens_schedule", "num_draft_tokens",
                "max_num_draft_tokens", "log"):
        assert rebuilt[key] == response[key], key
    for side in ("plain", "spec"):  # the one results schema, plus the texts and tokens
        assert {k: v for k, v in response[side].items() if k in log.figures()[side]} == log.figures()[side]


def test_log_is_compact(log: RaceLog) -> None:
    data = log.to_json()
    assert data["format"] == "specdemo-race-log" and data["version"] == racelog.VERSION
    plain = data["sides"]["plain"]
    assert all(set(r) <= {"round", "t", "verify_s", "tokens", "finish"} for r in plain)  # no zero counts
    assert [r["t"] for r in plain] == sorted(r["t"] for r in plain)
    assert all(len(row) in (5, len(racelog.TOKEN_FIELDS)) for r in data["sides"]["spec"] for row in r["tokens"])
    assert "counters" not in json.dumps(data) and "accepted_lengths" not in json.dumps(data)


RACED_MODES = ["draft", "ngram", "uag", "medusa", "medusa-chain", "eagle", "eagle-chain", "suffix"]


@pytest.fixture(scope="module")
def heads(tmp_path_factory) -> dict[str, str]:
    from tiny import save_tiny_eagle_head, save_tiny_heads

    folder = tmp_path_factory.mktemp("heads")
    return {"medusa_heads": save_tiny_heads(folder / "medusa", vocab=tiny_app.VOCAB),
            "eagle_head": save_tiny_eagle_head(folder / "eagle", vocab=tiny_app.VOCAB, draft_vocab=96)}


@pytest.mark.parametrize("mode", RACED_MODES)
def test_a_log_rebuilds_every_live_figure_of_every_mode(mode, heads) -> None:
    """What the app showed live (counters, per-position counts, metrics, the comparison) is what a recording
    rebuilds from the log, after a trip through JSON."""
    racer = Racer(tiny_app.config(**heads))
    pair = "tiny-mismatch" if mode == "uag" else "tiny"
    request = RaceRequest(PROMPT, pair, mode=mode, num_draft_tokens="4" if "chain" in mode or mode in (
        "draft", "uag", "ngram") else None, max_new_tokens=24, dtype="float32")
    live = None
    for live in racer.run(racer.prepare(request)):
        pass
    assert live is not None and live.done
    rebuilt = RaceState.from_log(RaceLog.from_json(json.loads(racelog.dumps(live.log()))))
    for side in ("plain", "spec"):
        live_pane, rebuilt_pane = getattr(live, side), getattr(rebuilt, side)
        assert rebuilt_pane.counters == live_pane.counters, side
        assert rebuilt_pane.metrics() == live_pane.metrics(), side
        assert [(t.id, t.kind) for t in rebuilt_pane.shown] == [(t.id, t.kind) for t in live_pane.shown]
    assert rebuilt.comparison == live.comparison
    assert rebuilt.runs() == live.runs()
    settings = live.log().settings  # what the mode records about its parts travels with the log, as the bench's
    assert RaceLog.from_json(json.loads(racelog.dumps(live.log()))).settings == settings
    if mode.startswith("eagle"):
        assert settings.methods is not None and settings.methods[mode]["head_format"] == "float32"
    elif mode == "suffix":  # what its memory held when the race began (None: raced without one)
        assert settings.methods == {"suffix": {"memory": None}}
    else:
        assert settings.methods is None
    if mode in ("medusa", "eagle", "suffix"):  # trees: the per-position counts go by depth, not by node count
        drafted = [r for r in live.spec.rounds if r.drafted]
        depths = [r.drafted if r.depth is None else r.depth for r in drafted]  # None: this round's tree was a chain
        assert drafted and all(1 <= d <= r.drafted for d, r in zip(depths, drafted))
        assert sum(live.spec.counters.drafted_at) == sum(depths)  # the counts went by depth, round by round


def test_a_race_stopped_by_the_time_budget_is_logged_as_such() -> None:
    racer = Racer(tiny_app.config(race_time_budget=0.3))
    request = RaceRequest(PROMPT, "tiny-slow", mode="draft", num_draft_tokens="4", max_new_tokens=400, dtype="float32")
    for state in racer.run(racer.prepare(request)):
        pass
    log = state.log()
    assert log.stop_reason == TIME_BUDGET and log.done and not log.plain[-1].finish_reason
    assert RaceLog.from_json(json.loads(racelog.dumps(log))) == log
    assert RaceState.from_log(log).stop_reason == TIME_BUDGET
    assert "identical so far" in html_replay.render_html(log)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda d: d.update(version=0), "version 0; this specdemo reads version 1"),
        (lambda d: d.update(version=2), "version 2"),
        (lambda d: d.pop("format"), "is not a specdemo race log"),
        (lambda d: d.update(format="something-else"), "is not a specdemo race log"),
        (lambda d: d["sides"].pop("spec"), "damaged race log (missing 'spec')"),
        (lambda d: d["sides"]["plain"][0].update(tokens=[[1, "a"]]), "damaged race log"),
        (lambda d: d["settings"].update(methods={"eagle": "w8a8"}), "settings.methods.'eagle' must be an object"),
        (lambda d: d["settings"].update(methods={"eagle": {"x": "y" * 5000}}), "settings.methods is over 4096"),
    ],
)
def test_older_or_foreign_files_are_refused(log: RaceLog, tmp_path: Path, change, message) -> None:
    data = copy.deepcopy(log.to_json())
    change(data)
    path = tmp_path / "race.json"
    path.write_text(json.dumps(data))
    with pytest.raises(RaceLogError) as caught:
        racelog.load(path)
    assert message in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize(
    "old, schedule, num_draft_tokens, details",
    [
        ({"num_draft_tokens": "adaptive"}, "adaptive", None, "draft tokens adaptive (≤ 12) ·"),
        ({"num_draft_tokens": "heuristic"}, "heuristic", None, "draft tokens heuristic (≤ 12) ·"),
        ({"num_draft_tokens": 4}, "fixed", 4, "draft tokens 4 ·"),
        ({"draft_tokens": "adaptive"}, "adaptive", None, "draft tokens adaptive (≤ 12) ·"),
    ],
)
def test_logs_from_before_the_schedule_had_its_own_field_still_load(
    log: RaceLog, old: dict, schedule: str, num_draft_tokens: int | None, details: str
) -> None:
    """Their num_draft_tokens (once draft_tokens) held the schedule's name, or k for a fixed one."""
    data = copy.deepcopy(log.to_json())
    for name in ("num_draft_tokens_schedule", "num_draft_tokens"):
        data["settings"].pop(name)
    data["settings"].update(old)
    settings = RaceLog.from_json(json.loads(json.dumps(data))).settings
    assert (settings.num_draft_tokens_schedule, settings.num_draft_tokens) == (schedule, num_draft_tokens)
    assert details in race_details(settings)


def test_the_recorded_demo_race_still_loads() -> None:
    """assets/race-demo.json, written when the setting was ``draft_tokens: "adaptive"``, before the cap was logged."""
    demo = racelog.load(Path(__file__).resolve().parents[1] / "assets" / "race-demo.json")
    assert (demo.settings.num_draft_tokens_schedule, demo.settings.num_draft_tokens) == ("adaptive", None)
    assert "draft tokens adaptive ·" in race_details(demo.settings) and demo.done
    assert RaceLog.from_json(json.loads(racelog.dumps(demo))) == demo  # and it is written in today's fields


def _first_spec_round(d: dict) -> dict:
    return d["sides"]["spec"][1]


HOSTILE = [  # what a browser could send to the app's recorder, or a file could hold: each refused in one line
    (lambda d: _first_spec_round(d).update(t=float("inf")), "spec round 1's t must be a number"),
    (lambda d: _first_spec_round(d).update(t=1e5), "spec round 1's t must be a number from 0 to 86400"),
    (lambda d: _first_spec_round(d).update(t=-1.0), "spec round 1's t"),
    (lambda d: _first_spec_round(d).update(verify_s=float("nan")), "verify_s must be a number"),
    (lambda d: _first_spec_round(d).update(finish=5), "finish must be text"),
    (lambda d: _first_spec_round(d).update(drafted=10**7), "drafted must be a whole number from 0 to 64"),
    (lambda d: _first_spec_round(d).update(drafted=True), "drafted must be a whole number"),
    (lambda d: _first_spec_round(d).update(accepted=65), "accepted must be a whole number"),
    (lambda d: _first_spec_round(d).update(round="1"), "spec round 1's round must be a whole number"),
    (lambda d: _first_spec_round(d).update(round=7), "spec round 1 is numbered 7"),
    (lambda d: _first_spec_round(d).update(tokens=[[1, "a", "plain", None, None]] * 70), "at most 65 items"),
    (lambda d: _first_spec_round(d).update(tokens={}), "tokens must be a list"),
    (lambda d: _first_spec_round(d)["tokens"][0].__setitem__(2, "purple"), "kind must be one of plain"),
    (lambda d: _first_spec_round(d)["tokens"][0].__setitem__(1, ["x"]), "text must be text"),
    (lambda d: _first_spec_round(d)["tokens"][0].__setitem__(0, -3), "id must be a whole number"),
    (lambda d: _first_spec_round(d)["tokens"][0].__setitem__(4, 7.5), "target_prob must be a number from 0"),
    (lambda d: _first_spec_round(d)["tokens"][0].append("<script>"), "source must be one of head, lookup"),
    (lambda d: _first_spec_round(d)["tokens"].__setitem__(0, [1, "a"]), "must hold id, text, kind"),
    (lambda d: d["sides"]["spec"][2].update(t=0.0), "spec round 2's clock runs back"),
    (lambda d: d["sides"].update(spec={}), "the spec side must be a list"),
    (lambda d: d["sides"].update(plain=[d["sides"]["plain"][0]] * 40000), "at most 32834 items"),
    (lambda d: d.update(sides=[1]), "sides must be an object"),
    (lambda d: d["outcome"].update(stop_reason=[1]), "outcome.stop_reason must be text"),
    (lambda d: d["outcome"].update(done=5), "outcome.done must be true or false"),
    (lambda d: d["outcome"].update(divergence={"position": "x"}), "divergence.position must be a whole number"),
    (lambda d: d["outcome"].update(divergence=3), "outcome.divergence must be an object"),
    (lambda d: d.update(outcome=[]), "outcome must be an object"),
    (lambda d: d["settings"].update(prompt={}), "settings.prompt must be text"),
    (lambda d: d["settings"].update(temperature="hot"), "settings.temperature must be a number"),
    (lambda d: d["settings"].update(max_new_tokens=10**9), "settings.max_new_tokens must be a whole number"),
    (lambda d: d["settings"].update(num_draft_tokens=[4]), "settings.num_draft_tokens must be a whole number"),
    (lambda d: d["settings"].update(num_draft_tokens=65), "settings.num_draft_tokens must be a whole number"),
    (lambda d: d["settings"].update(num_draft_tokens_schedule=5), "settings.num_draft_tokens_schedule must be text"),
    (lambda d: d["settings"].update(num_draft_tokens=None), "settings.num_draft_tokens must be a whole number with"),
    (lambda d: d["settings"].update(chat="yes"), "settings.chat must be true or false"),
    (lambda d: d["settings"].pop("target"), "settings lack 'target'"),
    (lambda d: d.update(settings=[1]), "settings must be an object"),
    (lambda d: d.update(token_fields="id"), "token fields"),
]


@pytest.mark.parametrize("change, message", HOSTILE, ids=[m for _, m in HOSTILE])
def test_hostile_logs_are_refused_in_one_line(log: RaceLog, change, message) -> None:
    data = copy.deepcopy(log.to_json())
    change(data)
    with pytest.raises(RaceLogError) as caught:
        RaceLog.from_json(json.loads(json.dumps(data)), source="the log")
    assert message in str(caught.value) and "\n" not in str(caught.value), str(caught.value)


def test_an_oversized_file_is_refused_before_it_is_read(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "race.json"
    path.write_text("{}" + " " * 2000)
    monkeypatch.setattr(racelog, "MAX_LOG_BYTES", 1000)
    with pytest.raises(RaceLogError, match="more than any race log"):
        racelog.load(path)


def test_a_race_too_long_for_a_video_is_refused_with_a_remedy(log: RaceLog) -> None:
    long = copy.deepcopy(log)
    long.spec[-1].clock = 3000.0
    with pytest.raises(ValueError, match="more than 10 min; record it with --speed 5 or more"):
        video.frame_times(long, video.VideoSettings())
    assert len(video.frame_times(long, video.VideoSettings(speed=5))) == 600 * 30 + 1 + 2 * 30
    long.spec[-1].clock = 80000.0
    with pytest.raises(ValueError, match="record it as --html"):
        video.frame_times(long, video.VideoSettings(speed=100))


def test_the_cli_and_the_recorder_refuse_a_hostile_log(log: RaceLog, tmp_path: Path, capsys) -> None:
    data = log.to_json()
    data["sides"]["spec"][1]["drafted"] = 10**7
    path = tmp_path / "hostile.json"
    path.write_text(json.dumps(data))
    assert record.main(["--from", str(path), "--html", str(tmp_path / "out.html")]) == 2
    err = capsys.readouterr().err
    assert "drafted must be a whole number from 0 to 64" in err and not (tmp_path / "out.html").exists()
    with pytest.warns(UserWarning, match="recording failed: .*drafted must be a whole number"):
        assert not any(button.interactive for button in Recorder().files({"log": data}))


def test_non_json_and_missing_files_are_refused(tmp_path: Path) -> None:
    page = tmp_path / "race.html"
    page.write_text("<html></html>")
    with pytest.raises(RaceLogError, match="is not JSON"):
        racelog.load(page)
    with pytest.raises(RaceLogError, match="cannot read"):
        racelog.load(tmp_path / "missing.json")
    with pytest.raises(RaceLogError, match="not a specdemo race log"):
        RaceLog.from_json([1, 2, 3])


# ---------------------------------------------------------------------------------------------------------------
# the HTML replay


def test_replay_page_is_self_contained_and_escapes_its_data(log: RaceLog) -> None:
    hostile = copy.deepcopy(log)
    hostile.plain[1].tokens[0].text = "</script><script>alert(1)</script>&amp;"
    page = html_replay.render_html(hostile)
    assert page.count("</script>") == 2  # the data's and the player's own
    assert not re.search(r"(src|href)=\"?(https?:)?//", page)  # nothing fetched from anywhere
    assert "@media (max-width" in page and 'name="viewport"' in page
    assert html_replay.render_html(log) == html_replay.render_html(log)  # deterministic
    data = json.loads(re.search(r'<script id="race-data" type="application/json">(.*?)</script>', page, re.S)[1])
    assert data["timeline"][-1]["t"] == hostile.seconds and data["duration"] == hostile.seconds
    assert "alert(1)" in "".join(entry.get("plain", "") for entry in data["timeline"])


@pytest.fixture(scope="module")
def browser():
    from conftest import need_browser

    sync_api = need_browser(CHROMIUM)
    from test_browser import ARGS

    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        yield browser
        browser.close()


@pytest.mark.browser
def test_replay_plays_to_the_end_in_chromium(log: RaceLog, browser, tmp_path: Path) -> None:
    path = tmp_path / "race.html"
    recording.write_recording(log, "html", path)
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    requests: list[str] = []
    page.on("request", lambda request: requests.append(request.url))
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(path.as_uri())
    page.click("[data-speed='4']")
    page.wait_for_function("document.body.dataset.state === 'ended'", timeout=30_000)
    assert not errors and requests == [path.as_uri()]
    for side in ("plain", "spec"):
        kinds, text = kinds_and_texts(log, side)
        shown = page.locator(f"#{side}-output .tok:not(.tok-rejected)")
        assert shown.evaluate_all("spans => spans.map(s => s.className.split('tok-')[1])") == kinds
        assert "".join(shown.all_text_contents()) == text
        assert "done" in page.inner_text(f"#{side}-stats")
    assert f"{log.figures()['spec']['speedup']:.2f}×" in page.inner_text("#speedup")
    assert "identical output (24 tokens)" in page.inner_text("#identical")
    assert "round" in (page.locator("#spec-output .tok-accepted").first.get_attribute("title") or "")
    # the controls: scrub back to the middle, then restart from zero
    page.evaluate("window.specdemoReplay.seek(window.specdemoReplay.duration / 2)")
    assert page.evaluate("document.body.dataset.state") == "paused"
    half = page.locator("#plain-output .tok").count()
    assert 0 < half < len(kinds_and_texts(log, "plain")[0])
    page.click("#restart")
    assert page.evaluate("document.body.dataset.state") == "playing"
    context.close()


@pytest.mark.browser
def test_replay_is_readable_on_a_phone(log: RaceLog, browser, tmp_path: Path) -> None:
    path = tmp_path / "race.html"
    recording.write_recording(log, "html", path)
    context = browser.new_context(viewport={"width": 390, "height": 844}, device_scale_factor=2, is_mobile=True)
    page = context.new_page()
    page.goto(path.as_uri())
    page.evaluate("window.specdemoReplay.seek(window.specdemoReplay.duration)")
    assert page.evaluate("document.documentElement.scrollWidth") <= 390  # no sideways scrolling
    plain, spec = page.locator("#plain-output").bounding_box(), page.locator("#spec-output").bounding_box()
    assert spec["y"] > plain["y"] + plain["height"] - 1  # the panes stack
    context.close()


# ---------------------------------------------------------------------------------------------------------------
# the video


def test_mp4_decodes_to_the_race_clock_at_the_chosen_speed(log: RaceLog, tmp_path: Path) -> None:
    imageio = pytest.importorskip("imageio", reason="imageio reads the video back: pip install imageio")
    path = tmp_path / "race.mp4"
    settings = video.VideoSettings(speed=0.5)
    recording.write_recording(log, "mp4", path, speed=0.5)
    reader = imageio.get_reader(path)
    try:
        meta = reader.get_meta_data()
        count = reader.count_frames()
        first = reader.get_data(0)
    finally:
        reader.close()
    assert meta["codec"] == "h264" and meta["pix_fmt"].startswith("yuv420p") and meta["fps"] == 30
    assert first.shape == (720, 1280, 3)
    assert count == len(video.frame_times(log, settings))
    expected = log.seconds / 0.5 + 2.0  # the race at half speed, then the final card for two seconds
    assert abs(count / 30 - expected) <= 2 / 30
    assert abs(meta["duration"] - expected) <= 3 / 30


def test_same_log_same_frames(log: RaceLog) -> None:
    small = video.VideoSettings(width=640, height=360, fps=10, speed=2.0)

    def hashes() -> list[str]:
        return [hashlib.sha256(frame.tobytes()).hexdigest() for frame in video.frames(log, small)]

    first = hashes()
    assert first == hashes() == hashes()
    assert len(set(first)) > 3  # the frames do change as the race runs
    assert first[-1] == first[-2]  # the final card is held


def test_frames_keep_the_latest_text_in_view_when_it_overflows(log: RaceLog) -> None:
    long = copy.deepcopy(log)
    for rounds in (long.plain, long.spec):
        for logged in rounds:
            for token in logged.tokens:
                token.text = token.text + "\n" * 3  # many more lines than a pane holds
    frames = list(video.frames(long, video.VideoSettings(width=640, height=360, fps=10, hold_seconds=0)))
    drawer = video._Frames(long, video.VideoSettings(width=640, height=360))
    drawer.at(long.seconds)
    canvas = drawer.canvases["plain"]
    assert canvas.row >= canvas.visible_rows and canvas.window().height == canvas.visible_rows * canvas.line_height
    assert frames[-1].size == (640, 360)


def test_gif_keeps_every_kind_colour(log: RaceLog, tmp_path: Path) -> None:
    import numpy as np
    from PIL import Image

    from specdemo.render.views import KIND_COLOURS

    path = tmp_path / "race.gif"
    recording.write_recording(log, "gif", path, speed=2.0)
    settings = replace(video.GIF_SETTINGS, speed=2.0)
    racing = len(video.frame_times(log, settings)) - round(settings.hold_seconds * settings.fps)
    drawn = np.asarray(list(video.frames(log, settings))[racing // 2], dtype=int)
    with Image.open(path) as gif:
        assert gif.size == (640, 360) and gif.n_frames >= 2 and gif.info.get("loop") == 0
        gif.seek(racing // 2)  # frames before the held card are all distinct here: the clocks tick
        shown = np.asarray(gif.convert("RGB"), dtype=int)
    on_screen = []
    for kind, (background, _) in KIND_COLOURS.items():
        colour = np.array([int(background[i : i + 2], 16) for i in (1, 3, 5)])
        drawn_there = (drawn == colour).all(axis=2)
        if drawn_there.sum() > 20:  # the kind is on screen: the GIF shows its colour there, near enough
            on_screen.append(kind)
            assert np.abs(shown[drawn_there] - colour).max(axis=1).mean() < 12, background
    assert {"plain", "accepted"} <= set(on_screen), on_screen  # a draft race mid-way shows both at least
    assert not list(tmp_path.glob(".*partial*"))


def test_video_settings_are_checked() -> None:
    for bad in (dict(speed=0), dict(fps=0), dict(width=641), dict(hold_seconds=-1)):
        with pytest.raises(ValueError):
            video.VideoSettings(**bad).validate()


# ---------------------------------------------------------------------------------------------------------------
# the command line


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[str, str]:
    from tiny import save_tiny_pair

    return save_tiny_pair(tmp_path_factory.mktemp("pair"))


def test_cli_races_and_writes_every_file(pair, tmp_path: Path, capsys) -> None:
    target, draft = pair
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text("def add(a, b):")
    paths = {kind: tmp_path / f"race.{kind}" for kind in recording.FORMATS}
    argv = ["--target", target, "--draft", draft, "--prompt-file", str(prompt_file), "--max-new-tokens", "12",
            "--num-draft-tokens", "3", "--dtype", "float32", "--device", "cpu", "--speed", "4", "--quiet"]
    argv += [option for kind, path in paths.items() for option in (f"--{kind}", str(path))]
    assert record.main(argv) == 0
    assert all(path.stat().st_size > 1000 for path in paths.values())
    log = racelog.load(paths["json"])
    assert log.settings.target == target and log.settings.pair is None and log.settings.num_draft_tokens == 3
    assert log.settings.num_draft_tokens_schedule == "fixed"  # --num-draft-tokens alone: k every round
    assert log.settings.prompt == "def add(a, b):" and log.done and len(kinds_and_texts(log, "spec")[0]) == 12
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["prompt.txt", *(p.name for p in paths.values())])
    # --from re-renders the saved log: the same page again
    again = tmp_path / "again.html"
    assert record.main(["--from", str(paths["json"]), "--html", str(again), "--quiet"]) == 0
    assert again.read_text() == html_replay.render_html(log)
    assert "wrote" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--prompt", "hi"], "nothing to write"),
        (["--json", "{tmp}/race.json"], "nothing to race"),
        (["--prompt", "hi", "--prompt-file", "{tmp}/p.txt", "--json", "{tmp}/race.json"], "not both"),
        (["--prompt", "hi", "--json", "{tmp}/no/such/folder/race.json"], "does not exist"),
        (["--prompt", "hi", "--json", "{tmp}/a.json", "--html", "{tmp}/a.json"], "same file"),
        (["--prompt", "hi", "--mp4", "{tmp}/race.mp4", "--speed", "0"], "speed"),
        (["--from", "{tmp}/race.json", "--prompt", "hi", "--json", "{tmp}/out.json"], "drop --prompt"),
        (["--from", "{tmp}/missing.json", "--json", "{tmp}/out.json"], "cannot read"),
        (["--prompt", "hi", "--target", "{tmp}/nothing-here", "--draft", "{tmp}/nothing", "--json", "{tmp}/r.json"],
         "nothing-here"),
        (["--prompt", "hi", "--pair", "nope", "--json", "{tmp}/race.json"], "unknown pair"),
        (["--prompt-file", "{tmp}/missing.txt", "--target", "{target}", "--draft", "{draft}", "--dtype", "float32",
          "--json", "{tmp}/race.json"], "prompt file"),
        (["--prompt", "hi", "--target", "{target}", "--draft", "{draft}", "--mode", "telepathy", "--dtype", "float32",
          "--json", "{tmp}/race.json"], "unknown mode"),
        (["--prompt", "hi", "--target", "{target}", "--draft", "{draft}", "--num-draft-tokens-schedule", "often",
          "--json", "{tmp}/race.json"], "num_draft_tokens_schedule must be one of fixed, adaptive, heuristic"),
        (["--prompt", "hi", "--target", "{target}", "--draft", "{draft}", "--num-draft-tokens-schedule", "fixed",
          "--json", "{tmp}/race.json"], "'fixed' needs num_draft_tokens"),
    ],
)
def test_cli_refuses_bad_input_in_one_line_and_writes_nothing(pair, tmp_path: Path, capsys, argv, message) -> None:
    values = {"tmp": str(tmp_path), "target": pair[0], "draft": pair[1]}
    argv = [part.format(**values) for part in argv]
    assert record.main([*argv, "--quiet"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("error: ") and message in error and "\n" not in error
    assert list(tmp_path.iterdir()) == []


def test_a_failed_render_leaves_no_partial_file(log: RaceLog, tmp_path: Path, monkeypatch) -> None:
    saved = tmp_path / "race.json"
    racelog.dump(log, saved)

    def broken_mp4(log, path, settings, on_frame=None):
        Path(path).write_bytes(b"half a video")
        raise OSError("the encoder stopped")

    monkeypatch.setattr(recording, "write_mp4", broken_mp4)
    assert record.main(["--from", str(saved), "--mp4", str(tmp_path / "race.mp4"), "--quiet"]) == 2
    assert [p.name for p in tmp_path.iterdir()] == ["race.json"]


# ---------------------------------------------------------------------------------------------------------------
# the app


def test_rerendering_a_log_imports_neither_torch_nor_gradio(log: RaceLog, tmp_path: Path) -> None:
    """``--from`` loads no model: the render path (race log, views, replay, video) must not pull in torch."""
    saved = tmp_path / "race.json"
    racelog.dump(log, saved)
    page = tmp_path / "race.html"
    script = (
        "import sys\n"
        "from specdemo import record\n"
        f"code = record.main(['--from', {str(saved)!r}, '--html', {str(page)!r}, '--quiet'])\n"
        "heavy = sorted(name for name in ('torch', 'gradio', 'transformers') if name in sys.modules)\n"
        "print(code, heavy)\n"
    )
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=root, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(root)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "0 []", done.stdout
    assert page.read_text() == html_replay.render_html(log)


def test_app_offers_the_recordings_after_a_race(tmp_path: Path) -> None:
    handlers = app_handlers.make_handlers(tiny_app.config())
    values = dict(zip(app_handlers.INPUTS, [PROMPT, "tiny", "", "", "draft", "4", 16, 0.0, 1.0, 0, "float32", "none", True]))
    updates = [dict(zip(app_handlers.OUTPUTS, update)) for update in handlers.race(*values.values())]
    result = updates[-1]["result"]
    assert updates[0]["result"] is None  # a new race clears the JSON the recordings are made from
    recorder = Recorder()
    json_button, html_button = recorder.files(result)
    mp4_button, gif_button, preview = recorder.videos(result)
    buttons = {"json": json_button, "html": html_button, "mp4": mp4_button, "gif": gif_button}
    for kind, button in buttons.items():
        assert button.interactive and "MB)" in button.label, kind
    paths = {kind: Path(button.value["path"] if isinstance(button.value, dict) else button.value)
             for kind, button in buttons.items()}
    assert all(path.is_file() and path.suffix == f".{kind}" for kind, path in paths.items())
    assert Path(preview).read_bytes() == paths["mp4"].read_bytes()
    assert racelog.load(paths["json"]).to_json() == result["log"]
    # nothing to record (a stopped race): the buttons stay off
    assert not any(button.interactive for button in recorder.files(None))
    cleared = Recorder.clear()
    assert len(cleared) == 5 and cleared[-1] is None and not any(b.interactive for b in cleared[:-1])


def test_a_failed_recording_warns_and_the_app_keeps_serving(monkeypatch) -> None:
    handlers = app_handlers.make_handlers(tiny_app.config())
    values = [PROMPT, "tiny", "", "", "draft", "4", 12, 0.0, 1.0, 0, "float32", "none", True]
    result = dict(zip(app_handlers.OUTPUTS, list(handlers.race(*values))[-1]))["result"]

    def broken(*args, **kwargs):
        raise OSError("disk full\nsecond line")

    from specdemo.app import recorder as recorder_module

    monkeypatch.setattr(recorder_module, "write_recording", broken)
    recorder = Recorder()
    with pytest.warns(UserWarning, match="recording failed: disk full$"):
        mp4, gif, preview = recorder.videos(result)
    assert not mp4.interactive and not gif.interactive and preview is None
    with pytest.warns(UserWarning, match="recording failed"):
        recorder.files({"log": {"format": "other"}})
    monkeypatch.undo()
    assert all(button.interactive for button in recorder.files(result))


def test_page_has_the_download_row_chained_after_the_race() -> None:
    demo = ui.build_app(tiny_app.config())
    ids = {c["props"].get("elem_id") for c in demo.config["components"]}
    assert {"download-json", "download-html", "download-mp4", "download-gif", "video-preview"} <= ids
    fns = list(demo.fns.values())
    names = [fn.name for fn in fns]
    assert "files" in names and "videos" in names
    for fn in fns:
        if fn.name in ("files", "videos"):  # on the device's queue: never alongside a race
            assert fn.concurrency_id == "device" and fn.concurrency_limit == 1
    dependencies = demo.config["dependencies"]
    race = next(d for d in dependencies if d.get("api_name") == "race_stream")
    files = next(d for d in dependencies if d.get("trigger_after") == race["id"])
    videos = next(d for d in dependencies if d.get("trigger_after") == files["id"])
    assert files["trigger_only_on_success"] and videos["trigger_only_on_success"]
    assert {c["id"] for c in demo.config["components"] if c["props"].get("elem_id") == "download-mp4"} <= set(
        videos["outputs"]
    )
