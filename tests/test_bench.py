"""The benchmark CLI on tiny local models: JSON keys, identity with plain, clear errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tiny import save_tiny_heads, save_tiny_pair

from specdemo import bench
from specdemo.backends.loading import clear_model_cache
from specdemo.bench_run import BenchRun
from specdemo.session.results import RunResult, divergence

pytestmark = pytest.mark.usefixtures("own_cache")

TIME_PROMPT = BenchRun.time_prompt  # the bench's own, which the resume tests wrap


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[str, str]:
    return save_tiny_pair(tmp_path_factory.mktemp("pair"))


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    rows = [
        {"question_id": 1, "category": "coding", "turns": ["def add(a, b):\n    return a + b\n", "again"]},
        {"id": "s1", "category": "summary", "prompt": "The quick brown fox jumps over the lazy dog."},
        {"id": "s2", "category": "summary", "prompt": "Café naïve 日本語 😀 def add(a, b): return a + b"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def _run(pair, prompt_file, tmp_path, *extra: str) -> dict:
    clear_model_cache()
    out = tmp_path / "out.json"
    code = bench.main(
        [
            "--target", pair[0], "--draft", pair[1], "--prompts", str(prompt_file), "--dtype", "float32",
            "--device", "cpu", "--max-new-tokens", "12", "--warmup", "1", "--json", str(out), "--quiet", *extra,
        ]
    )
    assert code == 0
    return json.loads(out.read_text())


def test_bench_json_and_identity(pair, prompt_file, tmp_path, capsys):
    report = _run(pair, prompt_file, tmp_path, "--modes", "plain,draft,ngram,hf-plain,hf-assisted,hf-lookup",
                  "--plot", str(tmp_path / "chart.png"), "--num-draft-tokens", "3")
    table = capsys.readouterr().out
    assert "ALL" in table and "speedup" in table
    assert (tmp_path / "chart.png").stat().st_size > 1000
    results = report["results"]
    assert len(results) == 3 * 6
    schema = set(RunResult.__dataclass_fields__)  # the one results schema, the bench's fields around it
    assert schema == {"new_tokens", "seconds", "prefill_seconds", "target_passes", "drafted", "accepted",
                      "acceptance_rate", "mean_accepted_length", "identical", "divergence", "speedup"}
    required = schema | {"id", "category", "mode", "new_token_ids", "text", "tokens_per_s", "decode_speedup"}
    for row in results:
        assert required <= set(row)
        assert not {"identical_to_plain", "first_divergence", "divergence_margin"} & set(row)  # the old names
        assert row["identical"] is True, row  # float32 greedy: every mode writes what plain writes
        assert row["divergence"] is None and row["new_tokens"] == len(row["new_token_ids"])
    assert report["config"]["num_draft_tokens"] == 3 and report["config"]["max_num_draft_tokens"] == 12
    assert report["config"]["num_draft_tokens_schedule"] == "fixed"  # --num-draft-tokens alone: k every round
    assert not {"num_draft_tokens", "num_draft_tokens_schedule"} & set(report["config"]["draft_settings"])
    assert report["summary"]["draft"]["identical"] == 3  # prompts whose output is plain's
    assert {r["id"] for r in results} == {"1", "s1", "s2"}
    for mode in ("plain", "draft", "ngram"):
        for key in ("tokens_per_s", "speedup", "acceptance_rate", "mean_accepted_length"):
            assert key in report["summary"][mode]
    assert report["summary"]["plain"]["speedup"] == pytest.approx(1.0)
    # after the target's prompt pass: measured for the engine's modes, None for generate()'s (no pass timings)
    assert "decode" in table
    assert report["summary"]["plain"]["decode_speedup"] == pytest.approx(1.0)
    assert 0 < report["summary"]["plain"]["prefill_share"] < 1
    for row in results:
        if row["mode"].startswith("hf-"):
            assert row["decode_speedup"] is None and row["prefill_seconds"] is None
        else:
            assert row["prefill_seconds"] > 0 and row["decode_speedup"] > 0
    assert report["summary"]["draft"]["decode_speedup"] > 0 and report["summary"]["hf-plain"]["decode_speedup"] is None
    assert set(report["by_category"]) == {"coding", "summary"}
    assert report["summary"]["draft"]["acceptance_rate"] is not None
    # what a verify pass over n tokens cost this run, in plain steps, with how many passes of each size
    draft_entry = report["summary"]["draft"]
    by_size, passes = draft_entry["verify_cost_by_size"], draft_entry["verify_passes_by_size"]
    assert by_size and set(by_size) == set(passes) and all(int(size) >= 1 for size in by_size)
    assert all(cost > 0 for cost in by_size.values()) and all(count > 0 for count in passes.values())
    assert "verify pass cost in plain steps" in table and "calibrated" in table
    assert "verify_cost_by_size" not in report["summary"]["plain"]
    assert report["environment"]["dtype"] == "float32"
    calibration = report["calibration"]  # the machine's cost curve, printed first and kept in the JSON
    assert calibration["lengths"] == [1, 2, 4, 8, 16] and calibration["relative"][0] == 1.0
    assert calibration["hardware"]["device"] == "cpu" and calibration["draft_seconds_per_token"] > 0
    assert "a pass over k tokens costs" in table and "machine:" in table


def test_bench_medusa_modes(pair, prompt_file, tmp_path, capsys):
    heads = save_tiny_heads(tmp_path / "heads")
    report = _run(pair, prompt_file, tmp_path, "--modes", "plain,medusa,medusa-chain", "--medusa-heads", heads)
    assert all(row["identical"] for row in report["results"])
    for mode in ("medusa", "medusa-chain"):
        entry = report["summary"][mode]
        assert entry["tokens_per_target_pass"] >= 1.0 and entry["mean_draft_length"] is not None
        assert len(entry["per_head_acceptance"]) <= 3  # one figure per head (drafting depth)
    assert report["summary"]["medusa-chain"]["mean_draft_length"] <= 3
    assert "medusa-chain" in capsys.readouterr().out
    clear_model_cache()
    code = bench.main(["--target", pair[0], "--prompts", str(prompt_file), "--modes", "medusa", "--quiet",
                       "--dtype", "float32", "--calibration", "off"])
    assert code == 2
    assert "no Medusa heads ship for" in capsys.readouterr().err


def test_bench_calibration_can_be_switched_off(pair, prompt_file, tmp_path, capsys):
    report = _run(pair, prompt_file, tmp_path, "--modes", "plain,ngram", "--limit", "1", "--calibration", "off")
    assert report["calibration"] is None and "machine:" not in capsys.readouterr().out


def test_bench_sampling_runs(pair, prompt_file, tmp_path):
    report = _run(pair, prompt_file, tmp_path, "--modes", "draft", "--temperature", "0.8", "--top-p", "0.9",
                  "--limit", "1", "--repeats", "2")
    assert [r["mode"] for r in report["results"]] == ["plain", "draft"]
    assert len(report["results"][0]["seconds_all_repeats"]) == 2
    assert len(report["results"][1]["new_tokens_all_repeats"]) == 2
    by_repeat = report["summary"]["draft"]["speedup_by_repeat"]
    assert len(by_repeat) == 2 and all(value > 0 for value in by_repeat)


def test_speedup_by_repeat_pairs_each_repeat_with_plains():
    """Repeat i of a mode is set against repeat i of plain (they ran side by side), over all prompts together,
    so the table can show how far the repeats spread around the median's speedup."""

    def row(prompt: str, mode: str, seconds: list[float]) -> dict:
        return {"id": prompt, "mode": mode, "new_token_ids": [1] * 10, "new_tokens_all_repeats": [10] * len(seconds),
                "seconds": sorted(seconds)[len(seconds) // 2], "seconds_all_repeats": seconds,
                "prefill_seconds": None, "identical": True, "speedup": None}

    rows = [row("a", "plain", [10.0, 12.0]), row("b", "plain", [10.0, 12.0]),
            row("a", "draft", [5.0, 8.0]), row("b", "draft", [5.0, 8.0])]
    summary = bench.aggregate(rows, ["plain", "draft"], {})
    assert summary["draft"]["speedup_by_repeat"] == pytest.approx([2.0, 1.5])
    assert summary["plain"]["speedup_by_repeat"] is None  # plain against itself says nothing
    table = bench.format_table(summary, {})
    assert "1.50-2.00x" in table and "repeats" in table
    single = bench.aggregate([row("a", "plain", [10.0]), row("a", "draft", [5.0])], ["plain", "draft"], {})
    assert single["draft"]["speedup_by_repeat"] == pytest.approx([2.0])
    assert "-" in bench.format_table(single, {}).splitlines()[-1]


@pytest.mark.parametrize(
    "args,message",
    [
        (["--modes", "plain,warp"], "unknown mode"),
        (["--max-new-tokens", "0"], "max-new-tokens"),
        (["--target", "offline:nope"], "offline"),
        (["--num-draft-tokens", "often"], "--num-draft-tokens: num_draft_tokens must be a whole number"),
        (["--num-draft-tokens", "65"], "from 1 to 64"),
        (["--num-draft-tokens", "adaptive"], "'adaptive' is a schedule: give it as num_draft_tokens_schedule"),
        (["--num-draft-tokens-schedule", "often"], "--num-draft-tokens-schedule: num_draft_tokens_schedule must be one "
         "of fixed, adaptive, heuristic, got 'often'"),
        (["--num-draft-tokens-schedule", "fixed"], "--num-draft-tokens: num_draft_tokens_schedule 'fixed' needs"),
        (["--num-draft-tokens-schedule", "adaptive", "--num-draft-tokens", "13"], "at most max_num_draft_tokens (12)"),
        (["--max-new-tokens", "lots"], "--max-new-tokens: max new tokens must be a number"),
    ],
)
def test_bench_bad_input_is_one_clear_line(pair, prompt_file, tmp_path, capsys, args, message):
    out = tmp_path / "never.json"
    code = bench.main(["--target", pair[0], "--draft", pair[1], "--prompts", str(prompt_file), "--dtype", "float32",
                       "--quiet", "--json", str(out), *args])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert message in err and len(err.splitlines()) == 1
    assert not out.exists()


@pytest.mark.parametrize(
    "args, schedule, num_draft_tokens",
    [
        ([], "adaptive", None),  # the default: adaptive from its own start
        (["--num-draft-tokens", "5"], "fixed", 5),  # a number alone: that many every round
        (["--num-draft-tokens-schedule", "heuristic"], "heuristic", None),  # a schedule alone: from its own start
        (["--num-draft-tokens-schedule", "Adaptive", "--num-draft-tokens", "3"], "adaptive", 3),  # the first round's
        (["--num-draft-tokens-schedule", "fixed", "--num-draft-tokens", "20"], "fixed", 20),  # fixed: not capped
    ],
)
def test_bench_draft_length_flags(prompt_file, args, schedule, num_draft_tokens):
    parsed = bench.build_parser().parse_args(["--target", "t", "--prompts", str(prompt_file), *args])
    spec = bench._read_request(parsed).spec
    assert (spec.num_draft_tokens_schedule, spec.num_draft_tokens, spec.max_num_draft_tokens) == (
        schedule, num_draft_tokens, 12)


def test_bench_empty_prompt_file(pair, tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert bench.main(["--target", pair[0], "--prompts", str(empty), "--quiet"]) == 2
    assert "no prompts" in capsys.readouterr().err.lower()


def test_divergence_helper():
    assert divergence([1, 2, 3], [1, 2, 3]) is None
    assert divergence([1, 2, 3], [1, 5, 3]) == 1
    assert divergence([1, 2, 3], [1, 2]) == 2


def test_the_command_line_front_ends_import_no_gradio():
    """The bench and the recorder race through the session: importing them must not pull in the Gradio app."""
    root = Path(__file__).resolve().parents[1]
    script = "import sys, specdemo.record, specdemo.bench; print('gradio' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=root, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(root)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "False"


@pytest.fixture(scope="module")
def other_tokenizer_draft(tmp_path_factory) -> str:
    from test_detok import build_sentencepiece_byte_fallback
    from tiny import llama

    tokenizer = build_sentencepiece_byte_fallback()
    model = llama(13, layers=1, vocab=len(tokenizer))
    folder = tmp_path_factory.mktemp("other") / "draft"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def test_bench_uag_modes(pair, prompt_file, tmp_path, other_tokenizer_draft):
    report = _run(pair, prompt_file, tmp_path, "--modes", "draft,uag,hf-uag", "--uag-draft", other_tokenizer_draft)
    rows = [r for r in report["results"] if r["mode"] in ("uag", "hf-uag")]
    assert len(rows) == 6
    assert all(r["identical"] for r in rows)
    assert report["config"]["uag_draft"] == other_tokenizer_draft


def test_bench_refuses_a_different_tokenizer_in_draft_mode(pair, prompt_file, tmp_path, capsys, other_tokenizer_draft):
    code = bench.main(["--target", pair[0], "--draft", other_tokenizer_draft, "--prompts", str(prompt_file),
                       "--dtype", "float32", "--quiet", "--modes", "draft", "--warmup", "0"])
    err = capsys.readouterr().err
    assert code == 2 and "different tokenizer" in err and "uag" in err


def test_bench_races_twice_with_a_memory_of_earlier_answers(pair, prompt_file, tmp_path, capsys):
    """--passes 2 with the suffix memory on: every prompt twice in file order, the second pass drafting from the
    first pass's answers (never a prompt's own answer within its pass), every output plain's; off: no memory."""
    pytest.importorskip("arctic_inference.suffix_decoding._C", reason="the suffix mode needs arctic-inference")
    # A fixed draft length: the adaptive budget sizes trees from measured verify costs, which a busy machine skews.
    report = _run(pair, prompt_file, tmp_path, "--modes", "plain,suffix", "--passes", "2", "--num-draft-tokens", "4")
    assert "pass 2" in capsys.readouterr().out
    assert report["config"]["passes"] == 2 and report["config"]["suffix_memory"] is True
    assert [r["pass"] for r in report["results"] if r["mode"] == "suffix"] == [1, 1, 1, 2, 2, 2]
    assert all(r["identical"] for r in report["results"])
    assert report["suffix_memory"]["answers"] == 6 and set(report["by_pass"]) == {"pass 1", "pass 2"}
    first, second = (report["by_pass"][name]["suffix"] for name in ("pass 1", "pass 2"))
    assert second["accepted_by_source"]["earlier answer"] > 0 and second["acceptance_rate"] > first["acceptance_rate"]
    off = _run(pair, prompt_file, tmp_path, "--modes", "plain,suffix", "--suffix-memory", "off")
    assert off["suffix_memory"] is None and off["config"]["suffix_memory"] is False and "by_pass" not in off
    assert bench.main(["--target", pair[0], "--prompts", str(prompt_file), "--passes", "9", "--quiet"]) == 2


def _bench_until(pair, prompt_file, out: Path, monkeypatch, stop_at: int | None, *extra: str) -> tuple[int, list[int]]:
    """Run the bench into ``out``, stopped (as by Ctrl-C) when it comes to time prompt ``stop_at``: its exit code
    and the prompts it timed."""
    clear_model_cache()
    timed: list[int] = []

    def timing(self, index, prompt_ids, bar):
        if index == stop_at:
            raise KeyboardInterrupt
        timed.append(index)
        return TIME_PROMPT(self, index, prompt_ids, bar)

    monkeypatch.setattr(BenchRun, "time_prompt", timing)
    code = bench.main(["--target", pair[0], "--draft", pair[1], "--prompts", str(prompt_file), "--dtype", "float32",
                       "--device", "cpu", "--max-new-tokens", "12", "--warmup", "1", "--calibration", "off",
                       "--json", str(out), "--quiet", *extra])
    return code, timed


def test_bench_resumes_a_stopped_run(pair, prompt_file, tmp_path, capsys, monkeypatch):
    """A run stopped after its first prompt keeps that prompt beside the JSON; the same command times only the rest,
    writes the whole report with the kept prompt's entries as they were, and removes the checkpoint."""
    out, partial = tmp_path / "out.json", tmp_path / "out.json.partial"
    modes = ("--modes", "plain,draft,ngram", "--num-draft-tokens", "3")
    assert _bench_until(pair, prompt_file, out, monkeypatch, 1, *modes) == (130, [0])
    assert "the same command resumes" in capsys.readouterr().err and not out.exists()
    kept = json.loads(partial.read_text())
    assert len(kept["done"]) == 1 and [row["mode"] for row in kept["done"][0]["rows"]] == ["plain", "draft", "ngram"]

    assert _bench_until(pair, prompt_file, out, monkeypatch, None, *modes) == (0, [1, 2])
    assert "resuming: 1 prompts already timed" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert not partial.exists() and len(report["results"]) == 9 and all(r["identical"] for r in report["results"])
    assert report["results"][:3] == kept["done"][0]["rows"]  # read back, not timed again
    assert [p["first_prompt"] for p in report["processes"]] == [0, 1]
    drafts = [r for r in report["results"] if r["mode"] == "draft"]  # the kept prompt's counters count too
    expected = sum(r["new_tokens"] for r in drafts) / sum(r["target_passes"] for r in drafts)
    assert report["summary"]["draft"]["tokens_per_target_pass"] == pytest.approx(expected)


def test_bench_starts_over_when_the_kept_run_is_another(pair, prompt_file, tmp_path, capsys, monkeypatch):
    """A checkpoint of other settings, of another machine, or unreadable, is not resumed: one line says why and
    every prompt is timed."""
    from specdemo.core.economics import Hardware

    out, partial = tmp_path / "out.json", tmp_path / "out.json.partial"
    assert _bench_until(pair, prompt_file, out, monkeypatch, 1)[0] == 130
    assert _bench_until(pair, prompt_file, out, monkeypatch, None, "--max-new-tokens", "10") == (0, [0, 1, 2])
    assert "not resumed (other settings: max_new_tokens)" in capsys.readouterr().out
    assert len(json.loads(out.read_text())["processes"]) == 1

    assert _bench_until(pair, prompt_file, out, monkeypatch, 1)[0] == 130
    monkeypatch.setattr(bench, "detect_hardware", lambda device: Hardware("cpu", "another CPU"))
    assert _bench_until(pair, prompt_file, out, monkeypatch, None) == (0, [0, 1, 2])
    assert "not resumed (measured on another machine)" in capsys.readouterr().out

    partial.write_text('{"key": ')
    assert _bench_until(pair, prompt_file, out, monkeypatch, None) == (0, [0, 1, 2])
    assert "not resumed (unreadable: JSONDecodeError)" in capsys.readouterr().out and not partial.exists()
    assert bench.main(["--target", pair[0], "--prompts", str(prompt_file), "--json", str(tmp_path / "no" / "o.json"),
                       "--quiet", "--calibration", "off"]) == 2
    assert "--json: no folder" in capsys.readouterr().err


def test_bench_resume_refills_the_suffix_memory(pair, prompt_file, tmp_path, monkeypatch):
    """A resumed run's suffix memory holds the kept prompts' answers, in order, as an uninterrupted run's would."""
    pytest.importorskip("arctic_inference.suffix_decoding._C", reason="the suffix mode needs arctic-inference")
    out = tmp_path / "out.json"
    modes = ("--modes", "plain,suffix", "--num-draft-tokens", "4", "--passes", "2")
    assert _bench_until(pair, prompt_file, out, monkeypatch, 4, *modes) == (130, [0, 1, 2, 3])
    assert _bench_until(pair, prompt_file, out, monkeypatch, None, *modes) == (0, [4, 5])
    report = json.loads(out.read_text())
    assert report["suffix_memory"]["answers"] == 6 and all(r["identical"] for r in report["results"])
    assert report["by_pass"]["pass 2"]["suffix"]["accepted_by_source"]["earlier answer"] > 0
