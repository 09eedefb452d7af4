"""The app's handlers and pure view functions, driven directly with tiny random models (CPU, float32, seconds)."""

from __future__ import annotations

import json
import re
import warnings
from html import unescape

import gradio as gr
import pandas as pd
import pytest
import tiny_app

from specdemo.app import charts, ui
from specdemo.app import handlers as app_handlers
from specdemo.app.config import AppConfig
from specdemo.app.spaces import gpu
from specdemo.core.errors import InputError
from specdemo.core.events import (
    ACCEPTED,
    BONUS,
    CORRECTED,
    PLAIN,
    REJECTED,
    Counters,
    TokenEvent,
)
from specdemo.methods import MAX_NUM_DRAFT_TOKENS, METHODS
from specdemo.render.views import (
    CSS,
    figures_html,
    identical_html,
    legend_html,
    race_details,
    render_token,
    speedup_html,
    token_title,
)
from specdemo.session import racer as racer_module
from specdemo.session.racelog import RaceLog
from specdemo.session.request import (
    DTYPES,
    RaceRequest,
    parse_draft_length,
    parse_max_new_tokens,
    parse_seed,
)
from specdemo.session.state import RaceState

SPAN = re.compile(r'<span class="tok tok-(\w+)" title="([^"]*)">(.*?)</span>', re.S)
PROMPT = "hello world the cat sat on the mat"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def run(handlers: app_handlers.Handlers, prompt: str = PROMPT, **overrides) -> list[dict]:
    values = dict(
        prompt=prompt,
        pair="tiny",
        target="",
        draft="",
        mode="draft",
        draft_tokens="4",
        max_new_tokens=40,
        temperature=0.0,
        top_p=1.0,
        seed=0,
        dtype="float32",
        quantization="none",
        chat=True,
    )
    values.update(overrides)
    updates = handlers.race(*[values[name] for name in app_handlers.INPUTS])
    return [dict(zip(app_handlers.OUTPUTS, update)) for update in updates]


def spans(pane_html: str) -> list[tuple[str, str, str]]:
    return [(kind, unescape(title), unescape(text)) for kind, title, text in SPAN.findall(pane_html)]


@pytest.fixture()
def handlers() -> app_handlers.Handlers:
    return app_handlers.make_handlers(tiny_app.config())


# ---------------------------------------------------------------------------------------------------------------
# pure functions


def test_render_token_escapes_text_and_title() -> None:
    token = TokenEvent(5, '<b>&"x"\n  y', ACCEPTED, 3, 0.5, 0.25)
    rendered = render_token(token)
    assert "<b>" not in rendered and "&lt;b&gt;&amp;&quot;x&quot;\n  y" in rendered
    assert 'class="tok tok-accepted"' in rendered
    [(kind, title, text)] = spans(rendered)
    assert (kind, text) == ("accepted", '<b>&"x"\n  y')
    assert "round 3" in title and "draft p = 0.500" in title and "target p = 0.250" in title
    odd = render_token(TokenEvent(1, "<script>", "weird", 0))
    assert "tok-plain" in odd and "<script>" not in odd
    assert "draft p" not in token_title(TokenEvent(1, "a", PLAIN, 0, None, 0.9))


def test_legend_names_every_kind() -> None:
    legend = legend_html()
    for kind in (ACCEPTED, CORRECTED, BONUS, PLAIN, REJECTED):
        assert f"tok-{kind}" in legend
    assert "white-space: pre-wrap" in CSS and "line-through" in CSS


def test_chart_frames_from_counters() -> None:
    counters = Counters()
    for drafted, accepted in [(4, 4), (4, 1), (3, 0), (4, 2)]:
        counters.observe(drafted, accepted)
    lengths = charts.accepted_length_frame(counters)
    assert list(lengths["tokens per pass"]) == ["1", "2", "3", "4", "5"]
    assert list(lengths["rounds"]) == [1, 1, 1, 0, 1]
    positions = charts.acceptance_position_frame(counters)
    assert list(positions["draft position"]) == ["1", "2", "3", "4"]
    assert list(positions["acceptance rate"]) == [0.75, 0.5, 0.25, 1 / 3]
    assert charts.accepted_length_frame(Counters()).empty and charts.acceptance_position_frame(Counters()).empty


def test_badges() -> None:
    state = RaceState()
    assert "pending" in identical_html(state)
    state.done = True
    state.plain.ids = [1, 2, 3]
    assert "identical output (3 tokens)" in identical_html(state)
    state.divergence, state.margin = 1, 0.0625
    tie = identical_html(state)
    assert "near-tie" in tie and "token 2" in tie and "logit margin 0.062" in tie
    state.margin = 4.0
    assert "differ at token 2" in identical_html(state)
    assert "–" in speedup_html(None) and "–" in figures_html(None)


def test_parsers() -> None:
    # no schedule: fixed when a number is given, else adaptive; a number with a schedule: the first round's
    assert parse_draft_length(None, None) == ("adaptive", None) and parse_draft_length("", "5") == ("fixed", 5)
    assert parse_draft_length(" Heuristic ", 3.0) == ("heuristic", 3) and parse_draft_length("adaptive", "") == (
        "adaptive", None)
    assert parse_draft_length("fixed", MAX_NUM_DRAFT_TOKENS) == ("fixed", MAX_NUM_DRAFT_TOKENS)
    assert MAX_NUM_DRAFT_TOKENS == 64  # the bench's limit too
    for schedule, count, field, message in [
        (None, "0", "num_draft_tokens", "num_draft_tokens must be a whole number from 1 to 64, got '0'"),
        (None, "sometimes", "num_draft_tokens", "num_draft_tokens must be a whole number"),
        (None, MAX_NUM_DRAFT_TOKENS + 1, "num_draft_tokens", "num_draft_tokens must be a whole number"),
        (None, 2.5, "num_draft_tokens", "num_draft_tokens must be a whole number"),
        (None, True, "num_draft_tokens", "num_draft_tokens must be a whole number"),
        (None, "adaptive", "num_draft_tokens", "'adaptive' is a schedule: give it as num_draft_tokens_schedule"),
        ("often", 3, "num_draft_tokens_schedule", "must be one of fixed, adaptive, heuristic, got 'often'"),
        ("fixed", None, "num_draft_tokens", "'fixed' needs num_draft_tokens"),
    ]:
        with pytest.raises(InputError, match=re.escape(message)) as caught:
            parse_draft_length(schedule, count)
        assert caught.value.field == field and "\n" not in str(caught.value)
    assert parse_max_new_tokens(64.0, 100) == 64
    for bad in (0, -3, 101, 2.5, "lots", None):
        with pytest.raises(InputError, match="max new tokens"):
            parse_max_new_tokens(bad, 100)
    assert parse_seed(None) is None and parse_seed(7.0) == 7


def test_spaces_decorator_is_a_no_op_without_spaces() -> None:
    def f() -> int:
        return 1

    assert gpu(f) is f and gpu(duration=30)(f) is f and gpu(f, duration=30) is f


# ---------------------------------------------------------------------------------------------------------------
# the race handler


def test_race_colours_both_panes_and_outputs_are_identical(handlers: app_handlers.Handlers) -> None:
    updates = run(handlers)
    final = updates[-1]
    result = final["result"]
    plain, spec = spans(final["plain_output"]), spans(final["spec_output"])
    assert {kind for kind, _, _ in plain} == {"plain"}
    spec_kinds = {kind for kind, _, _ in spec}
    assert "accepted" in spec_kinds and ("corrected" in spec_kinds or "bonus" in spec_kinds)
    # the shown pieces add up to the decoded text exactly; rejected drafts are extra (hidden by default)
    assert "".join(text for _, _, text in plain) == result["plain"]["text"]
    assert "".join(text for kind, _, text in spec if kind != "rejected") == result["spec"]["text"]
    assert result["plain"]["text"] == result["spec"]["text"] and result["spec"]["identical"] is True
    assert len(result["spec"]["kinds"]) == 40 == result["spec"]["new_tokens"]
    assert all("round" in title and "target p" in title for kind, title, _ in spec if kind != "rejected")
    # figures and badge
    assert re.search(r"\d+\.\d\d×", final["speedup"])
    assert re.search(r"after the prompt pass \(\d+% of plain&#x27;s time, the same on both sides\): \d+\.\d\d×",
                     final["speedup"]), final["speedup"]
    assert "identical output (40 tokens)" in final["identical"]
    assert "acceptance rate" in final["figures"] and "expected speedup" in final["figures"]
    assert "done (length)" in final["plain_stats"] and "tok/s" in final["spec_stats"]
    # charts after the run
    race_df = final["race_plot"]
    assert isinstance(race_df, pd.DataFrame) and set(race_df["side"]) == {"plain", "speculative"}
    assert race_df.groupby("side")["tokens"].max().to_dict() == {"plain": 40, "speculative": 40}
    assert int(final["length_plot"]["rounds"].sum()) == result["spec"]["target_passes"] - 1  # after the prompt pass
    assert (final["position_plot"]["acceptance rate"].between(0, 1)).all()
    json.dumps(result)  # the API's JSON is plain JSON


def test_updates_stream_then_final_state_is_always_sent() -> None:
    streaming = run(app_handlers.make_handlers(tiny_app.config(update_interval=0.0)))
    assert len(streaming) > 5
    first = streaming[0]
    assert first["plain_output"] == "" and first["race_plot"] is None and "Racing" in first["status"]
    counts = [len(spans(u["plain_output"])) for u in streaming]
    assert counts == sorted(counts)
    assert all(u["race_plot"] is not None for u in streaming[-1:])
    throttled = run(app_handlers.make_handlers(tiny_app.config(update_interval=60.0)))
    assert len(throttled) == 2  # the starting view and the final state
    assert throttled[-1]["result"]["spec"]["identical"] is True


def test_stop_closes_the_race_and_both_decoders(handlers: app_handlers.Handlers, monkeypatch: pytest.MonkeyPatch) -> None:
    decoders = []
    real_race = racer_module.race

    def spying_race(plain, spec):
        decoders.extend([plain, spec])
        return real_race(plain, spec)

    monkeypatch.setattr(racer_module, "race", spying_race)
    values = dict(zip(app_handlers.INPUTS, [PROMPT, "tiny", "", "", "draft", "2", 400, 0.0, 1.0, 0, "float32", "none", True]))
    updates = handlers.race(*values.values())
    for _ in range(4):
        next(updates)
    assert not any(d.gi_frame is None for d in decoders)  # both decoders are running
    updates.close()  # what Gradio does when the Stop button cancels the event
    assert len(decoders) == 2 and all(d.gi_frame is None for d in decoders)  # both closed
    # and the app keeps working
    assert run(handlers)[-1]["result"]["spec"]["identical"] is True


def test_ngram_mode_needs_no_draft_and_shows_mode(handlers: app_handlers.Handlers) -> None:
    final = run(handlers, prompt="one two three one two three one two three", mode="ngram", pair="tiny-mismatch")[-1]
    assert final["result"]["draft"] is None and final["result"]["mode"] == "ngram"
    assert final["result"]["spec"]["identical"] is True
    assert "n-gram" in final["spec_stats"]


def test_medusa_modes_race_on_the_target_alone_with_named_heads(tmp_path) -> None:
    from tiny import save_tiny_heads

    heads = save_tiny_heads(tmp_path / "heads", vocab=tiny_app.VOCAB)
    handlers = app_handlers.make_handlers(tiny_app.config(medusa_heads=heads))
    for mode in ("medusa", "medusa-chain"):
        final = run(handlers, mode=mode)[-1]
        assert final["result"]["draft"] is None and final["result"]["mode"] == mode
        assert final["result"]["spec"]["identical"] is True
    # without heads for this target: one line, and the app keeps serving
    plain_handlers = app_handlers.make_handlers(tiny_app.config())
    with pytest.raises(gr.Error, match="no Medusa heads ship for"):
        run(plain_handlers, mode="medusa")
    assert run(plain_handlers)[-1]["result"]["spec"]["identical"] is True


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"prompt": ""}, "prompt is empty"),
        ({"prompt": "   \n"}, "prompt is empty"),
        ({"max_new_tokens": 0}, "max new tokens"),
        ({"max_new_tokens": 10**9}, "max new tokens"),
        ({"max_new_tokens": 3.5}, "max new tokens"),
        ({"target": "no-such/model"}, "no such model"),
        ({"draft": "no-such/draft"}, "no such model"),
        ({"pair": "tiny-broken"}, "no config.json"),
        ({"pair": "nope"}, "unknown pair"),
        ({"pair": "tiny-mismatch"}, "different tokenizer"),
        ({"mode": "telepathy"}, "unknown mode"),
        ({"draft_tokens": "lots"}, "num_draft_tokens must be a whole number"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"seed": -4}, "seed"),
        ({"dtype": "int3"}, "dtype"),
        ({"quantization": "4bit"}, "CUDA"),
        ({"max_new_tokens": 500, "prompt": "the " * 100}, "context"),
    ],
)
def test_bad_input_raises_gr_error_and_the_app_keeps_working(handlers: app_handlers.Handlers, overrides, message) -> None:
    with pytest.raises(gr.Error) as caught:
        run(handlers, **overrides)
    assert message in caught.value.message
    assert "\n" not in caught.value.message
    assert run(handlers)[-1]["result"]["spec"]["identical"] is True


def test_custom_models_can_be_switched_off() -> None:
    handlers = app_handlers.make_handlers(tiny_app.config(custom_models=False))
    with pytest.raises(gr.Error, match="switched off"):
        run(handlers, target="tiny:target")
    assert run(handlers)[-1]["result"]["spec"]["identical"] is True


def test_custom_pair_and_warnings(handlers: app_handlers.Handlers) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        final = run(handlers, target="tiny:target", draft="tiny:target", max_new_tokens=12)[-1]
    assert final["result"]["target"] == "tiny:target" and final["result"]["draft"] == "tiny:target"
    assert final["result"]["spec"]["acceptance_rate"] == 1.0
    assert any("draft is the target itself" in str(w.message) for w in caught)


def test_sampling_runs_and_says_why_texts_differ(handlers: app_handlers.Handlers) -> None:
    with pytest.warns(UserWarning, match="Sampling"):
        final = run(handlers, temperature=1.0, top_p=0.9, seed=3, max_new_tokens=24)[-1]
    result = final["result"]
    assert result["temperature"] == 1.0 and len(result["spec"]["kinds"]) == 24
    assert result["spec"]["identical"] is False  # two sampled runs of this seed part ways: the page says why
    assert "sampled" in final["identical"]


def test_api_returns_texts_kinds_and_metrics(handlers: app_handlers.Handlers) -> None:
    *progress, result = handlers.api(PROMPT, pair="tiny", mode="draft", num_draft_tokens="3", max_new_tokens=16, chat=False)
    assert progress and all(p["running"] for p in progress)
    assert result["plain"]["text"] == result["spec"]["text"] and result["spec"]["identical"] is True
    assert set(result["spec"]["kinds"]) <= {ACCEPTED, CORRECTED, BONUS, PLAIN}
    assert result["plain"]["new_tokens"] == 16 and result["spec"]["speedup"] > 0
    assert result["spec"]["speedup"] == result["comparison"]["speedup"] and result["plain"]["speedup"] == 1.0
    assert result["plain"]["identical"] is True and result["spec"]["divergence"] is None
    assert result["num_draft_tokens"] == 3 and result["max_num_draft_tokens"] == 12
    assert result["num_draft_tokens_schedule"] == "fixed"  # a number without a schedule: that many every round
    assert {"speedup", "draft_cost", "verify_cost", "expected_speedup", "decode_speedup", "prefill_share"} <= set(
        result["comparison"]
    )
    assert result["comparison"]["decode_speedup"] > 0 and 0 < result["comparison"]["prefill_share"] < 1
    with pytest.raises(gr.Error, match="prompt is empty"):
        list(handlers.api("", pair="tiny"))


def test_api_takes_the_schedule_and_the_first_rounds_draft(handlers: app_handlers.Handlers) -> None:
    *_, result = handlers.api(PROMPT, pair="tiny", num_draft_tokens_schedule="heuristic", num_draft_tokens=2,
                              max_new_tokens=12)
    assert (result["num_draft_tokens_schedule"], result["num_draft_tokens"]) == ("heuristic", 2)
    assert result["spec"]["identical"] is True
    *_, result = handlers.api(PROMPT, pair="tiny", max_new_tokens=8)
    assert (result["num_draft_tokens_schedule"], result["num_draft_tokens"]) == ("adaptive", None)
    assert "draft tokens adaptive (≤ 12)" in race_details(RaceLog.from_json(result["log"]).settings)
    with pytest.raises(gr.Error, match="num_draft_tokens_schedule must be one of fixed, adaptive, heuristic"):
        list(handlers.api(PROMPT, pair="tiny", num_draft_tokens_schedule="often"))
    with pytest.raises(gr.Error, match="'adaptive' is a schedule"):  # the old single setting: a pointer to the new
        list(handlers.api(PROMPT, pair="tiny", num_draft_tokens="adaptive"))


def test_a_refused_draft_length_is_shown_on_its_input(handlers: app_handlers.Handlers) -> None:
    run_values = dict(zip(app_handlers.INPUTS, [PROMPT, "tiny", "", "", "draft", "lots", 16, 0.0, 1.0, 0,
                                                 "float32", "none", True]))
    checks = dict(zip(app_handlers.INPUTS, handlers.race_validator(*run_values.values())))
    assert checks["draft_tokens"]["is_valid"] is False and "num_draft_tokens" in checks["draft_tokens"]["message"]
    assert checks["prompt"]["is_valid"] is True
    checks = dict(zip(app_handlers.API_INPUTS, handlers.api_validator(PROMPT, num_draft_tokens_schedule="often")))
    assert checks["num_draft_tokens_schedule"]["is_valid"] is False and checks["prompt"]["is_valid"] is True
    checks = dict(zip(app_handlers.API_INPUTS, handlers.api_validator(PROMPT, num_draft_tokens_schedule="fixed")))
    assert checks["num_draft_tokens"]["is_valid"] is False and "needs num_draft_tokens" in checks[
        "num_draft_tokens"]["message"]


def test_warm_up_runs_once_per_pair() -> None:
    handlers = app_handlers.make_handlers(tiny_app.config(warmup_tokens=4))
    first = handlers.racer.prepare(RaceRequest(PROMPT, "tiny", mode="draft", max_new_tokens=8, dtype="float32"))
    again = handlers.racer.prepare(RaceRequest(PROMPT, "tiny", mode="draft", max_new_tokens=8, dtype="float32"))
    assert first.warmup_seconds > 0 and again.warmup_seconds == 0


# ---------------------------------------------------------------------------------------------------------------
# the page


def _components(demo: gr.Blocks) -> dict[str, dict]:
    return {c["props"].get("elem_id"): c for c in demo.config["components"] if c["props"].get("elem_id")}


def test_page_has_ids_examples_queue_and_api() -> None:
    demo = ui.build_app(tiny_app.config())
    components = _components(demo)
    for elem_id in ("prompt", "run", "stop", "pair", "mode", "plain-output", "spec-output", "speedup", "identical"):
        assert elem_id in components, elem_id
    assert components["custom-target"]["props"]["visible"] is True
    assert components["quantization"]["props"]["interactive"] is False
    mode_choices = [value for _, value in components["mode"]["props"]["choices"]]
    assert mode_choices == list(METHODS)
    (dtype,) = [c for c in demo.config["components"] if c["props"].get("label") == "dtype"]
    assert [value for _, value in dtype["props"]["choices"]] == list(DTYPES)
    assert {"int8", "w8a8"} <= set(DTYPES)
    dependencies = demo.config["dependencies"]
    race_deps = [d for d in dependencies if d.get("api_name") == "race"]
    assert len(race_deps) == 1
    fns = {fn.api_name: fn for fn in demo.fns.values()}
    for name in ("race", "race_stream"):  # one race at a time on the device, API calls included
        assert fns[name].concurrency_limit == 1 and fns[name].concurrency_id == "device"
    stream_id = [d["id"] for d in dependencies if d.get("api_name") == "race_stream"]
    assert any(d.get("cancels") == stream_id for d in dependencies)  # the Stop button
    labels = [c["props"].get("sample_labels") for c in demo.config["components"] if c["type"] == "dataset"]
    assert labels and [label.split(":")[0] for label in labels[0]] == [
        "Chat", "Code writing", "Code editing", "Summarization", "Translation"
    ]


def test_no_custom_models_hides_the_boxes() -> None:
    components = _components(ui.build_app(tiny_app.config(custom_models=False)))
    assert components["custom-target"]["props"]["visible"] is False
    assert components["custom-draft"]["props"]["visible"] is False


def test_app_arguments() -> None:
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("app", Path(__file__).parents[1] / "app.py")
    app = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(app)
    args = app.build_parser().parse_args([])
    assert args.host == "127.0.0.1" and args.share is False and args.custom_models is None  # main decides: on unless hosted
    args = app.build_parser().parse_args(["--no-custom-models", "--pair", "smollm2-1.7b", "--port", "7999"])
    assert args.custom_models is False and args.pair == "smollm2-1.7b" and args.port == 7999
    with pytest.raises(SystemExit):
        app.build_parser().parse_args(["--pair", "nope"])
    # one tuple of formats: app.py, the app's dropdown (above) and the bench offer the same
    from specdemo import bench

    def dtype_choices(parser) -> list[str]:
        return next(action.choices for action in parser._actions if "--dtype" in action.option_strings)

    assert dtype_choices(app.build_parser()) == dtype_choices(bench.build_parser()) == list(DTYPES)
    assert app.build_parser().parse_args(["--dtype", "w8a8"]).dtype == "w8a8"


def test_uag_presets_select_the_uag_mode():
    from specdemo.app.ui import mode_for_pair
    from specdemo.session.presets import PRESETS

    config = AppConfig()
    assert mode_for_pair(config, "offline-smollm-qwen-coder", "draft") == "uag"
    assert mode_for_pair(config, "offline-qwen-coder", "uag") == "draft"
    assert mode_for_pair(config, "offline-qwen-coder", "ngram") == "ngram"
    assert all(mode_for_pair(config, key, "draft") == preset.mode for key, preset in PRESETS.items())


def test_the_cost_curve_is_measured_once_and_charted(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECDEMO_CACHE", str(tmp_path))
    from specdemo.session import calibration

    from specdemo.session import racer

    # a tiny model's timings are noise: neither its curve's shape nor its plain steps say anything here
    monkeypatch.setattr(calibration, "curve_problem", lambda *args: None)
    monkeypatch.setattr(racer, "refresh_if_stale", lambda *args: None)
    handlers = app_handlers.make_handlers(tiny_app.config(calibrate=True))
    outputs = list(handlers.race(PROMPT, "tiny", "", "", "draft", "3", 12, 0.0, 1.0, 0, "float32", "none", True))
    chart = outputs[0][app_handlers.OUTPUTS.index("cost_plot")]
    frame = chart["value"]
    assert chart["visible"] is True and "On this machine" in chart["title"]
    assert list(frame["tokens in the pass"]) == ["1", "2", "4", "8", "16"]
    assert frame["cost (one-token passes)"][0] == 1.0 and set(frame["speculation"]) <= set(charts.COST_COLOURS)
    result = outputs[-1][app_handlers.OUTPUTS.index("result")]
    assert result["calibration"]["lengths"] == [1, 2, 4, 8, 16] and result["calibration"]["draft"] == "tiny:draft"
    assert result["methods"] is None  # draft mode records nothing about its parts (an EAGLE race: its head)
    # cached, the cost curve and --compile auto's verdict on compiled passes: the next race measures neither
    assert sorted(path.name.startswith("compile-") for path in tmp_path.rglob("*.json")) == [False, True]
    list(handlers.race(PROMPT, "tiny", "", "", "draft", "3", 12, 0.0, 1.0, 0, "float32", "none", True))
    assert handlers.racer.prepare(RaceRequest(PROMPT, pair="tiny")).calibration.from_cache


def test_pair_info_names_the_target_format(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECDEMO_CACHE", str(tmp_path))
    assert "*Target format:* float32" in ui._pair_info(tiny_app.config(), "tiny")
    auto = ui._pair_info(tiny_app.config(dtype="auto", calibrate=True), "tiny")
    assert "*Target format:* auto: w8a8, int8 or bfloat16" in auto and "measured at the first race" in auto
