"""Serving many visitors: bounded work per race, stoppable API races, models freed on pair switches, a race log."""

from __future__ import annotations

import gc
import json
import logging
import time
import weakref

import pytest
import tiny_app
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdemo.app.config import AppConfig
from specdemo.app.handlers import status_text
from specdemo.backends import int8 as drafters
from specdemo.backends import loading as models
from specdemo.backends.loading import LoadSettings, cache_key
from specdemo.core.errors import InputError
from specdemo.render.views import identical_html
from specdemo.session.config import default_max_prompt_tokens
from specdemo.session.pipeline import release_models
from specdemo.session.racer import TIME_BUDGET, Racer
from specdemo.session.request import MAX_CHARS_PER_TOKEN, RaceRequest
from specdemo.session.state import result_dict

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = "hello world the cat sat on the mat"


class SpyLoader:
    """``tiny_app.loader`` that remembers what it was asked to load."""

    def __init__(self) -> None:
        self.loaded: list[str] = []

    def __call__(self, source, settings=LoadSettings(), progress=True, on_progress=None):
        self.loaded.append(source)
        return tiny_app.loader(source, settings, progress, on_progress)


def race_records(caplog: pytest.LogCaptureFixture) -> list[dict]:
    return [
        json.loads(r.getMessage().removeprefix("race "))
        for r in caplog.records
        if r.name == "specdemo.races"
    ]


def test_default_prompt_cap_fits_the_hardware() -> None:
    assert default_max_prompt_tokens("cpu") == 2048
    assert default_max_prompt_tokens("cuda") > 2048
    assert AppConfig(device="cpu").prompt_token_limit() == 2048
    assert AppConfig(device="cpu", max_prompt_tokens=99).prompt_token_limit() == 99


def test_huge_prompt_is_refused_at_once_and_nothing_loads(caplog: pytest.LogCaptureFixture) -> None:
    spy = SpyLoader()
    racer = Racer(tiny_app.config(loader=spy))
    prompt = " ".join(["word"] * 20_000)
    caplog.set_level(logging.INFO, logger="specdemo.races")
    with pytest.raises(InputError, match=r"too long: 99,999 characters.*2,048 prompt tokens"):
        racer.prepare(RaceRequest(prompt, pair="tiny"))
    assert spy.loaded == []  # refused before anything loads or tokenizes
    (record,) = race_records(caplog)
    assert record["ended"] == "refused" and "word" not in json.dumps(record)


def test_prompt_over_the_token_cap_is_refused_before_the_draft_loads_or_any_pass() -> None:
    spy = SpyLoader()
    racer = Racer(tiny_app.config(loader=spy, max_prompt_tokens=5))
    prompt = "one two three four five six seven"  # 7 tokens, well under the character bound
    assert len(prompt) < 5 * MAX_CHARS_PER_TOKEN
    with pytest.raises(InputError, match="7 tokens, over the limit of 5 prompt tokens"):
        racer.prepare(RaceRequest(prompt, pair="tiny", chat=False))
    assert spy.loaded == ["tiny:target"]
    prepared = racer.prepare(RaceRequest("one two three four five", pair="tiny", chat=False, max_new_tokens=4))
    assert len(prepared.prompt_ids) == 5


def test_time_budget_ends_the_race_with_its_figures_so_far(caplog: pytest.LogCaptureFixture) -> None:
    racer = Racer(tiny_app.config(race_time_budget=0.4))
    prepared = racer.prepare(RaceRequest(PROMPT, pair="tiny-slow", num_draft_tokens_schedule="fixed",
                                         num_draft_tokens="2", max_new_tokens=480))
    caplog.set_level(logging.INFO, logger="specdemo.races")
    *_, state = racer.run(prepared)
    assert state.done and state.stop_reason == TIME_BUDGET
    assert 0 < state.plain.counters.new_tokens < 480 and 0 < state.spec.counters.new_tokens < 480
    assert state.identical is True and state.comparison is not None and state.comparison.speedup > 0
    assert "identical so far" in identical_html(state)
    assert status_text(state).startswith("Stopped (time budget)")
    result = result_dict(state)
    assert result["stopped"] is True and result["stop_reason"] == "time budget" and result["spec"]["speedup"] > 0
    (record,) = race_records(caplog)
    assert record["ended"] == "time budget" and record["pair"] == "tiny-slow" and record["mode"] == "draft"
    assert record["plain"]["new_tokens"] == state.plain.counters.new_tokens and record["spec"]["speedup"] > 0
    assert record["num_draft_tokens"] == 2 and record["max_num_draft_tokens"] == 12
    assert record["num_draft_tokens_schedule"] == "fixed"


def test_every_race_logs_one_line_without_the_prompt(caplog: pytest.LogCaptureFixture) -> None:
    racer = Racer(tiny_app.config())
    caplog.set_level(logging.INFO, logger="specdemo.races")
    prepared = racer.prepare(RaceRequest(PROMPT, pair="tiny", max_new_tokens=8))
    *_, state = racer.run(prepared)
    states = racer.run(prepared)  # a second race, stopped after its first round
    next(states)
    states.close()
    done, cancelled = race_records(caplog)
    assert done["ended"] == "done" and done["spec"]["identical"] is True
    assert (done["plain"]["new_tokens"], done["spec"]["new_tokens"]) == (8, 8)
    assert done["prompt_tokens"] == len(prepared.prompt_ids) and done["seconds"] > 0
    assert {"pair", "mode", "target", "draft", "dtype", "device", "num_draft_tokens_schedule", "num_draft_tokens",
            "max_num_draft_tokens"} <= set(done)
    assert (done["num_draft_tokens_schedule"], done["num_draft_tokens"]) == ("adaptive", None)
    # each side in the one results schema, as the bench's entries, /race's sides and the race log's figures
    assert set(done["spec"]) == set(result_dict(state)["spec"]) - {"text", "kinds", "tokens", "finish_reason",
                                                                    "rejected"}
    assert done["spec"]["speedup"] > 0 and done["plain"]["speedup"] == 1.0
    assert cancelled["ended"] == "cancelled"
    assert "cat" not in json.dumps(done) + json.dumps(cancelled)


def test_switching_pairs_frees_the_models_the_new_pair_does_not_use() -> None:
    forgotten: list[frozenset] = []
    racer = Racer(tiny_app.config(forget_models=forgotten.append))
    settings = LoadSettings(dtype="auto", device="cpu")  # what the requests ask for
    racer.prepare(RaceRequest(PROMPT, pair="tiny", max_new_tokens=4))
    racer.prepare(RaceRequest(PROMPT, pair="tiny", mode="ngram", max_new_tokens=4))
    racer.prepare(RaceRequest(PROMPT, pair="tiny", max_new_tokens=4))
    racer.prepare(RaceRequest(PROMPT, pair="tiny-slow", max_new_tokens=4))
    racer.prepare(RaceRequest(PROMPT, pair="tiny-slow", target="tiny:target", mode="ngram", max_new_tokens=4))
    assert forgotten == [  # a draft-free mode on the same pair keeps its draft
        frozenset({cache_key("tiny:slow", settings), cache_key("tiny:draft", settings)}),
        frozenset({cache_key("tiny:target", settings), cache_key("tiny:draft", settings)}),
    ]


def test_released_models_take_their_int8_copies_with_them(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64,
    )
    model = LlamaForCausalLM(config).eval()
    assert drafters.int8_copy(model) is drafters.int8_copy(model)
    copy, head = weakref.ref(drafters.int8_copy(model)), weakref.ref(drafters.head_rows(model))
    monkeypatch.setitem(models._cache, ("tiny:weak", "torch.float32", "cpu", None, False), object())
    monkeypatch.setitem(models._cache, ("tiny:kept", "torch.float32", "cpu", None, False), object())
    alive = weakref.ref(model)
    del model
    release_models(keep={("tiny:kept", "torch.float32", "cpu", None, False)})
    gc.collect()
    assert alive() is None
    assert copy() is None and head() is None  # the int8 copy and head went with their model
    assert ("tiny:weak", "torch.float32", "cpu", None, False) not in models._cache
    assert ("tiny:kept", "torch.float32", "cpu", None, False) in models._cache


def test_app_arguments_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util
    from pathlib import Path

    def load_app():
        spec = importlib.util.spec_from_file_location("app", Path(__file__).parents[1] / "app.py")
        app = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(app)
        return app

    monkeypatch.delenv("SPECDEMO_MAX_PROMPT_TOKENS", raising=False)
    monkeypatch.delenv("SPECDEMO_RACE_TIME_BUDGET", raising=False)
    monkeypatch.delenv("SPACE_ID", raising=False)
    args = load_app().build_parser().parse_args([])
    assert args.max_prompt_tokens is None and args.race_time_budget is None
    args = load_app().build_parser().parse_args(["--max-prompt-tokens", "512", "--race-time-budget", "90"])
    assert args.max_prompt_tokens == 512 and args.race_time_budget == 90.0
    monkeypatch.setenv("SPECDEMO_MAX_PROMPT_TOKENS", "1000")
    monkeypatch.setenv("SPECDEMO_RACE_TIME_BUDGET", "30")
    args = load_app().build_parser().parse_args([])
    assert args.max_prompt_tokens == 1000 and args.race_time_budget == 30.0
    with pytest.raises(SystemExit):
        load_app().build_parser().parse_args(["--max-prompt-tokens", "0"])
    monkeypatch.setenv("SPECDEMO_MAX_PROMPT_TOKENS", "lots")
    with pytest.raises(SystemExit, match="SPECDEMO_MAX_PROMPT_TOKENS must be a number"):
        load_app().build_parser()


# ----------------------------------------------------------------------------------------------------------------
# the /race API served for real: a cancelled or disconnected client frees the worker

gradio_client = pytest.importorskip("gradio_client", reason="gradio_client is not installed: pip install gradio_client")


@pytest.fixture(scope="module")
def served():
    """The app on tiny models, with the decoders of every race kept to see when a race is closed."""
    spied: list = []
    with tiny_app.served_with_spied_races(spied, update_interval=0.05) as url:
        yield url, spied


def wait_for(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def closed(decoders) -> bool:
    return all(d.gi_frame is None for d in decoders)


def start_slow_race(client, spied: list):
    """Submit a long race on the slow tiny target and wait until it runs; returns its job."""
    spied.clear()
    job = client.submit(PROMPT, "tiny-slow", "draft", "fixed", 1, 480, api_name="/race")
    assert wait_for(lambda: len(spied) >= 2, 60), "the race never started"
    return job


def test_a_cancelled_api_race_frees_the_queue(served, caplog) -> None:
    caplog.set_level(logging.INFO, logger="specdemo.races")
    url, spied = served
    client = gradio_client.Client(url, verbose=False)
    job = start_slow_race(client, spied)
    time.sleep(0.3)
    job.cancel()
    assert wait_for(lambda: closed(spied[:2]), 60), "the cancelled race is still running"
    # stopped by the cancel, not run to its end (480 tokens on the slow target would take about 10 s more)
    assert [r["ended"] for r in race_records(caplog)] == ["cancelled"]
    assert client.predict(prompt=PROMPT, pair="tiny", max_new_tokens=8, api_name="/race")["spec"]["identical"] is True


def test_a_disconnected_api_client_frees_the_worker(served, caplog) -> None:
    import httpx

    caplog.set_level(logging.INFO, logger="specdemo.races")
    url, spied = served
    spied.clear()
    with httpx.Client(base_url=url, timeout=30) as http:
        posted = http.post(
            "gradio_api/call/race",
            json={"data": [PROMPT, "tiny-slow", "draft", "fixed", 1, 480, 0.0, 1.0, 0, True, "", "", ""]},
        )
        event_id = posted.json()["event_id"]
        with http.stream("GET", f"gradio_api/call/race/{event_id}") as stream:
            for line in stream.iter_lines():
                if line.startswith("data:") and "running" in line:
                    break  # the race is under way: now hang up
    assert wait_for(lambda: len(spied) >= 2, 60)
    assert wait_for(lambda: closed(spied[:2]), 60), "the race of a client that hung up is still running"
    assert [r["ended"] for r in race_records(caplog)] == ["cancelled"]  # stopped, not run to its end
    client = gradio_client.Client(url, verbose=False)
    assert client.predict(prompt=PROMPT, pair="tiny", max_new_tokens=8, api_name="/race")["spec"]["identical"] is True


def test_bad_input_is_refused_at_once_while_a_race_holds_the_worker(served) -> None:
    url, spied = served
    client = gradio_client.Client(url, verbose=False)
    job = start_slow_race(client, spied)
    try:
        for kwargs, message in [
            ({"prompt": " ".join(["word"] * 20_000)}, "prompt: the prompt is too long: 99,999 characters"),
            ({"prompt": PROMPT, "mode": "nope"}, "mode: unknown mode 'nope'"),
            ({"prompt": PROMPT, "max_new_tokens": 10**7}, "max_new_tokens: max new tokens must be"),
        ]:
            with pytest.raises(Exception, match=message):
                client.predict(api_name="/race", **kwargs)
        assert not job.done()  # refused while the race still held the worker: not queued behind it
    finally:
        job.cancel()
    assert wait_for(lambda: closed(spied[:2]), 5.0)
