"""Load check of the served app on the offline pair (a report, not a test: ``python tests/load_check.py``).

Starts ``app.py`` in a child process on the offline pack, then:

1. memory: 20 races with 3 pair switches (offline-qwen-coder, offline-smollm-qwen-coder, and back, and again),
   reading the server's resident memory (VmRSS) after each race;
2. load: five concurrent ``/race`` API clients (two served races, an over-long prompt, an unknown mode, a race
   cancelled after a few seconds) and one browser session racing in the page at the same time; each is served or
   refused with a clear line, and the app must still answer afterwards.

It prints a table and writes everything to ``--json``. Needs the offline pack, gradio_client, and for the browser
session Playwright with Debian's Chromium.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from gradio_client import Client

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = os.environ.get("SPECDEMO_CHROMIUM", "/usr/bin/chromium")
PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Rename the variable x to count: def f(x): return x + 1",
    "Explain in two sentences why the sky is blue.",
    "Translate to French: The cat sleeps on the warm windowsill.",
]
PAIR_PLAN = [("offline-qwen-coder", "draft")] * 5 + [("offline-smollm-qwen-coder", "uag")] * 5
PAIR_PLAN = PAIR_PLAN * 2  # 20 races, 3 pair switches


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_gb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024**2
    raise RuntimeError("no VmRSS")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def start_server(port: int, log_path: Path) -> subprocess.Popen:
    log = log_path.open("w")
    server = subprocess.Popen(
        [sys.executable, str(ROOT / "app.py"), "--port", str(port), "--pair", "offline-qwen-coder"],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return server
        except OSError:
            if server.poll() is not None:
                raise SystemExit(f"the app exited early; see {log_path}") from None
            time.sleep(1)
    server.kill()
    raise SystemExit("the app did not start within 180 s")


def race(client: Client, **kwargs: Any) -> dict[str, Any]:
    started = time.perf_counter()
    try:
        result = client.predict(api_name="/race", **kwargs)
    except Exception as error:  # the client raises the server's one-line gr.Error as AppError
        message = " ".join(str(error).split())  # a validation error spans two lines: the input, then the message
        return {"outcome": "refused", "message": message, "seconds": time.perf_counter() - started}
    return {
        "outcome": "served",
        "seconds": time.perf_counter() - started,
        "speedup": result["spec"]["speedup"],
        "identical": result["spec"]["identical"],
        "stop_reason": result.get("stop_reason"),
        "tokens": result["spec"]["new_tokens"],
    }


def memory_phase(url: str, pid: int, max_new_tokens: int) -> list[dict[str, Any]]:
    client = Client(url, verbose=False)
    rows = []
    for index, (pair, mode) in enumerate(PAIR_PLAN, 1):
        outcome = race(
            client, prompt=PROMPTS[index % len(PROMPTS)], pair=pair, mode=mode, max_new_tokens=max_new_tokens
        )
        rows.append({"race": index, "pair": pair, "mode": mode, "rss_gb": rss_gb(pid), **outcome})
        print(f"race {index:2d} {pair:28s} {mode:6s} {outcome['outcome']:8s} RSS {rows[-1]['rss_gb']:.2f} GB "
              f"({outcome['seconds']:.1f} s)", flush=True)
    return rows


def browser_session(url: str, report: dict[str, Any]) -> None:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        report["browser"] = {"outcome": "skipped", "message": "Playwright is not installed"}
        return
    started = time.perf_counter()
    args = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run"]
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=args)
        try:
            page = browser.new_page(viewport={"width": 1440, "height": 1000})
            page.goto(url)
            page.wait_for_selector("#prompt textarea", timeout=60_000)
            page.fill("#prompt textarea", PROMPTS[0])
            page.click("#run")
            page.wait_for_selector("#identical .badge:not(.badge-pending)", timeout=900_000)
            report["browser"] = {
                "outcome": "served",
                "seconds": time.perf_counter() - started,
                "speedup": page.inner_text("#speedup").split("\n")[0],
                "badge": page.inner_text("#identical").strip(),
            }
        except Exception as error:  # a timeout or a page error: reported, not raised
            report["browser"] = {"outcome": "failed", "message": str(error).splitlines()[0]}
        finally:
            browser.close()


def load_phase(url: str, max_new_tokens: int) -> dict[str, Any]:
    report: dict[str, Any] = {}
    long_prompt = " ".join(["lorem ipsum dolor sit amet"] * 4000)  # 20,000 words

    def api(name: str, **kwargs: Any) -> None:
        report[name] = race(Client(url, verbose=False), **kwargs)

    def cancelled(name: str) -> None:
        client = Client(url, verbose=False)
        started = time.perf_counter()
        job = client.submit(prompt=PROMPTS[2], pair="offline-qwen-coder", max_new_tokens=256, api_name="/race")
        time.sleep(5)
        job.cancel()
        report[name] = {"outcome": "cancelled", "seconds": time.perf_counter() - started}

    threads = [
        threading.Thread(target=api, args=("api-1 draft",), kwargs=dict(
            prompt=PROMPTS[0], pair="offline-qwen-coder", max_new_tokens=max_new_tokens)),
        threading.Thread(target=api, args=("api-2 ngram",), kwargs=dict(
            prompt=PROMPTS[1], pair="offline-qwen-coder", mode="ngram", max_new_tokens=max_new_tokens)),
        threading.Thread(target=api, args=("api-3 20,000 words",), kwargs=dict(
            prompt=long_prompt, pair="offline-qwen-coder", max_new_tokens=max_new_tokens)),
        threading.Thread(target=api, args=("api-4 unknown mode",), kwargs=dict(
            prompt=PROMPTS[0], pair="offline-qwen-coder", mode="medusa-typo", max_new_tokens=max_new_tokens)),
        threading.Thread(target=cancelled, args=("api-5 cancelled",)),
        threading.Thread(target=browser_session, args=(url, report)),
    ]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    report["all six seconds"] = time.perf_counter() - started
    report["after"] = race(Client(url, verbose=False), prompt=PROMPTS[3], pair="offline-qwen-coder", max_new_tokens=8)
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--json", type=Path, default=ROOT / "out" / "load-check.json")
    parser.add_argument("--skip-memory", action="store_true")
    args = parser.parse_args()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    port = free_port()
    server = start_server(port, args.json.with_suffix(".server.log"))
    url = f"http://127.0.0.1:{port}/"
    try:
        result: dict[str, Any] = {"cpu": cpu_model(), "cores": os.cpu_count(), "rss_gb_idle": rss_gb(server.pid)}
        if not args.skip_memory:
            result["memory"] = memory_phase(url, server.pid, args.max_new_tokens)
        result["load"] = load_phase(url, args.max_new_tokens)
        result["rss_gb_end"] = rss_gb(server.pid)
    finally:
        server.terminate()
        server.wait(timeout=30)
    args.json.write_text(json.dumps(result, indent=2))
    for name, outcome in result["load"].items():
        print(f"{name:22s} {json.dumps(outcome)}")
    print(f"written: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
