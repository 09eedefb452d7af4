"""The app served for real (in this process, on tiny models) and called through ``gradio_client``."""

from __future__ import annotations

import time

import pytest

gradio_client = pytest.importorskip("gradio_client", reason="gradio_client is not installed: pip install gradio_client")

import tiny_app  # noqa: E402

PROMPT = "hello world the cat sat on the mat"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def spied():
    """Decoders handed to the race, to see that a cancelled race closes them."""
    return []


@pytest.fixture(scope="module")
def url(spied):
    with tiny_app.served_with_spied_races(spied, update_interval=0.05) as served_url:
        yield served_url


@pytest.fixture(scope="module")
def client(url):
    return gradio_client.Client(url, verbose=False)


def test_race_endpoint_returns_texts_kinds_and_metrics(client) -> None:
    result = client.predict(
        prompt=PROMPT, pair="tiny", mode="draft", num_draft_tokens="3", max_new_tokens=24, api_name="/race"
    )
    assert result["plain"]["text"] == result["spec"]["text"] and result["spec"]["identical"] is True
    assert len(result["spec"]["kinds"]) == 24 and "accepted" in result["spec"]["kinds"]
    assert result["spec"]["speedup"] > 0 and result["spec"]["acceptance_rate"] is not None
    assert result["target"] == "tiny:target" and result["draft"] == "tiny:draft"
    assert (result["num_draft_tokens_schedule"], result["num_draft_tokens"]) == ("fixed", 3)
    ngram = client.predict(prompt="one two three one two three", pair="tiny", mode="ngram", api_name="/race")
    assert ngram["draft"] is None and ngram["spec"]["identical"] is True
    assert (ngram["num_draft_tokens_schedule"], ngram["num_draft_tokens"]) == ("adaptive", None)
    heuristic = client.predict(prompt=PROMPT, pair="tiny", num_draft_tokens_schedule="heuristic", num_draft_tokens=2,
                               max_new_tokens=12, api_name="/race")
    assert (heuristic["num_draft_tokens_schedule"], heuristic["num_draft_tokens"]) == ("heuristic", 2)


def test_race_endpoint_is_documented(client) -> None:
    info = client.view_api(print_info=False, return_format="dict")
    assert "/race" in info["named_endpoints"]
    names = [p["parameter_name"] for p in info["named_endpoints"]["/race"]["parameters"]]
    assert names[:5] == ["prompt", "pair", "mode", "num_draft_tokens_schedule", "num_draft_tokens"]


def test_bad_input_is_a_plain_error_and_the_app_keeps_working(client) -> None:
    for kwargs, message in [
        ({"prompt": ""}, "prompt is empty"),
        ({"prompt": PROMPT, "max_new_tokens": 10**7}, "max new tokens"),
        ({"prompt": PROMPT, "target": "no-such/model"}, "no such model"),
        ({"prompt": PROMPT, "pair": "tiny-mismatch"}, "different tokenizer"),
        ({"prompt": PROMPT, "num_draft_tokens_schedule": "often"}, "num_draft_tokens_schedule must be one of"),
    ]:
        with pytest.raises(Exception, match=message):
            client.predict(api_name="/race", **kwargs)
    assert client.predict(prompt=PROMPT, pair="tiny", max_new_tokens=8, api_name="/race")["spec"]["identical"] is True


def test_requests_queue_one_race_at_a_time(client) -> None:
    jobs = [client.submit(prompt=PROMPT, pair="tiny", max_new_tokens=16, api_name="/race") for _ in range(3)]
    results = [job.result(timeout=120) for job in jobs]
    assert all(r["spec"]["identical"] for r in results)


def test_cancelling_a_running_race_closes_it(client, spied, caplog) -> None:
    import json
    import logging

    caplog.set_level(logging.INFO, logger="specdemo.races")
    spied.clear()
    inputs = [PROMPT, "tiny-slow", "", "", "draft", "1", 480, 0.0, 1.0, 0, "float32", "none", True]
    job = client.submit(*inputs, api_name="/race_stream")
    deadline = time.monotonic() + 60
    while not spied and time.monotonic() < deadline:
        time.sleep(0.02)
    assert spied, "the race never started"
    time.sleep(0.5)
    job.cancel()  # what the Stop button does
    deadline = time.monotonic() + 60
    while any(d.gi_frame is not None for d in spied[-2:]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(d.gi_frame is None for d in spied[-2:]), "the cancelled race's decoders are still open"
    ended = [json.loads(r.getMessage().removeprefix("race "))["ended"] for r in caplog.records
             if r.name == "specdemo.races"]
    assert ended == ["cancelled"]  # stopped by the cancel, not run to its end (480 slow tokens)
    # the device is free again: a new race runs at once
    assert client.predict(prompt=PROMPT, pair="tiny", max_new_tokens=8, api_name="/race")["spec"]["identical"] is True


def test_each_client_drafts_from_its_own_earlier_answers_only(url) -> None:
    """Through the served API: a client's second race drafts from its first one's answer (the suffix memory), a
    second client's session starts with none, and no parameter of the API names a memory."""
    pytest.importorskip("arctic_inference.suffix_decoding._C", reason="the suffix mode needs arctic-inference")
    first, second = gradio_client.Client(url, verbose=False), gradio_client.Client(url, verbose=False)
    race = dict(prompt="one two three four five one two three", pair="tiny", mode="suffix", max_new_tokens=24,
                api_name="/race")
    before = first.predict(**race)
    again = first.predict(**race)
    other = second.predict(**race)
    assert before["spec"]["text"] == again["spec"]["text"] == other["spec"]["text"] == before["plain"]["text"]
    assert before["methods"]["suffix"]["memory"]["answers"] == 0 and again["methods"]["suffix"]["memory"]["answers"] == 1
    assert any(token["source"] == "answer 1" for token in again["spec"]["tokens"])
    assert other["methods"]["suffix"]["memory"]["answers"] == 0
    assert not any((token["source"] or "").startswith("answer") for token in other["spec"]["tokens"])
    info = first.view_api(print_info=False, return_format="dict")
    assert "request" not in [p["parameter_name"] for p in info["named_endpoints"]["/race"]["parameters"]]
