"""The page in a real browser: Playwright (Python) driving Debian's Chromium against the app on tiny models."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

pytestmark = [pytest.mark.browser, pytest.mark.usefixtures("one_torch_thread")]

CHROMIUM = os.environ.get("SPECDEMO_CHROMIUM", "/usr/bin/chromium")
ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]

from conftest import need_browser  # noqa: E402

sync_api = need_browser(CHROMIUM, allow_module_level=True)

import tiny_app  # noqa: E402

from specdemo.app import ui  # noqa: E402

PROMPT = "hello world the cat sat on the mat"




@pytest.fixture(scope="module")
def url():
    demo = ui.build_app(tiny_app.config(max_new_tokens=48, update_interval=0.1, draft_tokens="4"))
    port = tiny_app.free_port()
    try:
        ui.launch(demo, server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
        yield f"http://127.0.0.1:{port}/"
    finally:
        demo.close()


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        yield browser
        browser.close()


@pytest.fixture()
def page(browser, url):
    context = browser.new_context(viewport={"width": 1440, "height": 1000})
    page = context.new_page()
    page.goto(url)
    page.wait_for_selector("#prompt textarea", timeout=30_000)
    yield page
    context.close()


def screenshot_path(tmp_path: Path, name: str) -> Path:
    folder = Path(os.environ.get("SPECDEMO_SCREENSHOT_DIR", tmp_path))
    folder.mkdir(parents=True, exist_ok=True)
    return folder / name


def test_a_race_in_the_browser(page, tmp_path: Path) -> None:
    page.fill("#prompt textarea", PROMPT)
    page.click("#run")
    page.wait_for_selector("#identical .badge-same", timeout=60_000)  # the race ended with identical outputs
    spec = page.locator("#spec-output")
    assert spec.locator(".tok-accepted").count() > 0
    assert spec.locator(".tok-corrected").count() > 0
    assert page.locator("#plain-output .tok-plain").count() > 0
    assert re.search(r"\d+\.\d\d×", page.inner_text("#speedup"))
    assert "done" in page.inner_text("#spec-stats") and "tok/s" in page.inner_text("#plain-stats")
    # hover text, whitespace kept, rejected drafts hidden until the toggle
    assert "round" in (spec.locator(".tok-accepted").first.get_attribute("title") or "")
    assert spec.locator(".tok-box").evaluate("e => getComputedStyle(e).whiteSpace") == "pre-wrap"
    rejected = spec.locator(".tok-rejected")
    assert rejected.count() > 0 and not rejected.first.is_visible()
    page.click("#show-rejected input")
    page.wait_for_function("document.body.classList.contains('show-rejected')")
    assert rejected.first.is_visible()
    assert rejected.first.evaluate("e => getComputedStyle(e).textDecorationLine") == "line-through"
    path = screenshot_path(tmp_path, "race.png")
    page.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 10_000
    print(f"screenshot: {path}")


def test_an_empty_prompt_shows_an_error_and_the_page_keeps_working(page) -> None:
    page.click("#run")
    toast = page.get_by_text("prompt is empty", exact=False).first
    toast.wait_for(timeout=30_000)
    page.fill("#prompt textarea", PROMPT)
    page.click("#run")
    page.wait_for_selector("#identical .badge-same", timeout=60_000)


def test_examples_fill_the_prompt(page) -> None:
    page.get_by_text("Code editing:", exact=False).first.click()
    page.wait_for_function("document.querySelector('#prompt textarea').value.startsWith('for x in y')")


def test_stop_ends_a_running_race(page) -> None:
    page.get_by_text("More settings").first.click()
    page.locator("#custom-target textarea, #custom-target input").first.fill("tiny:slow")  # 20 ms per target pass
    tokens = page.locator("#max-new-tokens input[type=number]")
    tokens.fill("480")
    tokens.press("Enter")
    page.fill("#prompt textarea", PROMPT)
    page.click("#run")
    page.wait_for_function("document.querySelectorAll('#plain-output .tok').length >= 5", timeout=60_000)
    page.click("#stop")
    page.get_by_text("Stopped: the race was cancelled", exact=False).first.wait_for(timeout=10_000)
    page.wait_for_timeout(500)
    count = page.locator("#plain-output .tok").count()
    page.wait_for_timeout(1500)
    assert page.locator("#plain-output .tok").count() == count < 480  # nothing more arrives
    assert "running" not in page.inner_text("#plain-stats")
    assert "pending" in (page.locator("#identical .badge").get_attribute("class") or "")
    # a stream update already on its way when Stop was pressed may land after the cancel: it is marked stopped too
    page.evaluate("document.querySelector('#plain-stats').insertAdjacentHTML('beforeend', "
                  "'<span class=\"chip chip-running\">running…</span>')")
    page.wait_for_function("!document.querySelector('#plain-stats').innerText.includes('running')", timeout=2_000)


def test_the_race_can_be_downloaded_and_previewed(page) -> None:
    page.fill("#prompt textarea", PROMPT)
    page.click("#run")
    page.wait_for_selector("#identical .badge-same", timeout=60_000)
    for kind in ("json", "html", "mp4", "gif"):  # the files come after the race, the videos last
        page.wait_for_selector(f"#download-{kind}:not([disabled])", timeout=60_000)
        assert "MB)" in page.inner_text(f"#download-{kind}")
    page.wait_for_selector("#video-preview video[src]", timeout=30_000)
    with page.expect_download() as download:
        page.click("#download-html")
    assert download.value.suggested_filename.endswith(".html")
