"""Peak memory of a pair switch (a report, not a test: ``python tests/switch_memory.py``).

Prepares and races one pair with ``--dtype auto``, then switches to a second pair, as the app's racer does, and
reports for each step the resident memory (VmRSS) and the anonymous part of it (RssAnon: what the process itself
holds; the rest is file pages of the weights being read, which the kernel can drop), sampled every 50 ms, and the
kernel's own high-water mark (VmHWM, reset before each step). ``--fresh`` measures the format candidates again (a
first start on a new machine: the worst case of a switch) in a temporary calibration folder. Needs the offline pack.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FIELDS = ("VmRSS", "RssAnon", "VmHWM")


def memory() -> dict[str, float]:
    """This process's VmRSS, RssAnon and VmHWM in GB."""
    values = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name = line.split(":", 1)[0]
        if name in FIELDS:
            values[name] = int(line.split()[1]) / 1024**2
    return values


class Sampler:
    """Samples VmRSS and RssAnon every 50 ms in a thread, keeping the largest of each step."""

    def __init__(self) -> None:
        self.peaks = {"VmRSS": 0.0, "RssAnon": 0.0}
        self._stop = False
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self._stop:
            now = memory()
            for name in self.peaks:
                self.peaks[name] = max(self.peaks[name], now[name])
            time.sleep(0.05)

    def reset(self) -> None:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current VmRSS
        self.peaks = {"VmRSS": 0.0, "RssAnon": 0.0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--first", default="offline-qwen-coder:draft", help="PAIR:MODE raced first")
    parser.add_argument("--second", default="offline-smollm-qwen-coder-0.5b:uag", help="PAIR:MODE switched to")
    parser.add_argument("--fresh", action="store_true", help="measure the format candidates again (a new machine)")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)

    from specdemo.app.config import AppConfig
    from specdemo.session import calibration
    from specdemo.session.racer import Racer
    from specdemo.session.request import RaceRequest

    if args.fresh:
        folder = Path(tempfile.mkdtemp(prefix="specdemo-calibration-"))
        calibration.cache_home = lambda: folder  # the conversions stay where they are; the choices start empty
    racer = Racer(AppConfig(dtype="auto"))
    sampler = Sampler()
    freed: list[dict[str, float]] = []
    free = racer._free_before_candidates

    def free_and_note(*parts: Any, **named: Any) -> None:
        free(*parts, **named)
        freed.append(memory())

    racer._free_before_candidates = free_and_note
    rows = []
    for step, spec in (("first pair", args.first), ("switch", args.second)):
        pair, mode = spec.split(":")
        sampler.reset()
        before = memory()
        started = time.perf_counter()
        request = RaceRequest("Write a Python function that reverses a list.", pair, mode=mode,
                              max_new_tokens=args.max_new_tokens)
        prepared = racer.prepare(request)
        for state in racer.run(prepared):
            pass
        seconds = time.perf_counter() - started
        format_name = prepared.target.format
        del prepared, state
        after = memory()
        rows.append({
            "step": step, "pair": pair, "mode": mode, "format": format_name, "seconds": round(seconds, 1),
            "rss_before_gb": round(before["VmRSS"], 2),
            "rss_after_free_gb": round(freed[-1]["VmRSS"], 2) if freed and step == "switch" else None,
            "peak_rss_gb": round(max(sampler.peaks["VmRSS"], after["VmHWM"]), 2),
            "peak_anon_gb": round(sampler.peaks["RssAnon"], 2),
            "rss_after_gb": round(after["VmRSS"], 2),
        })
        freed.clear()
    header = f"{'step':<11} {'pair:mode':<38} {'format':<8} {'s':>6} {'before':>7} {'freed':>7} {'peak':>6} " \
             f"{'anon':>6} {'after':>6}"
    print(header)
    for row in rows:
        freed_text = "-" if row["rss_after_free_gb"] is None else f"{row['rss_after_free_gb']:.2f}"
        print(f"{row['step']:<11} {row['pair'] + ':' + row['mode']:<38} {row['format']:<8} {row['seconds']:>6.1f} "
              f"{row['rss_before_gb']:>7.2f} {freed_text:>7} {row['peak_rss_gb']:>6.2f} {row['peak_anon_gb']:>6.2f} "
              f"{row['rss_after_gb']:>6.2f}")
    print("GB; before: resident when the step began; freed: after the old pair was freed (a switch measuring "
          "formats); peak: resident high-water mark; anon: its anonymous part; after: once the race ended")
    if args.json:
        args.json.write_text(json.dumps({"machine": platform.processor() or platform.machine(), "fresh": args.fresh,
                                         "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
