"""Tests for specdemo.session.prompts: the bundled set, both file formats, and error messages."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from specdemo.session.prompts import (
    Prompt,
    PromptFileError,
    bundled_prompts_path,
    categories_of,
    load_prompts,
)

EXPECTED_CATEGORIES = ["chat", "code-writing", "code-editing", "summarization", "translation", "math"]
SPECBENCH = Path(__file__).resolve().parents[1].parent / "shared" / "specbench" / "question.jsonl"


def write_lines(tmp_path: Path, lines: list[str], name: str = "p.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def simple(pid: str, category: str = "chat", prompt: str = "Hello there") -> str:
    return json.dumps({"id": pid, "category": category, "prompt": prompt})


# --- bundled set -------------------------------------------------------------------


def test_bundled_path_exists() -> None:
    path = bundled_prompts_path()
    assert path.is_file()
    assert path.name == "prompts.jsonl"


def test_bundled_set_shape() -> None:
    prompts = load_prompts()
    assert len(prompts) == 18
    assert categories_of(prompts) == EXPECTED_CATEGORIES
    for category in EXPECTED_CATEGORIES:
        assert sum(p.category == category for p in prompts) == 3
    assert len({p.id for p in prompts}) == 18
    assert all(isinstance(p, Prompt) and p.text.strip() for p in prompts)


def test_bundled_file_uses_simple_form() -> None:
    for line in bundled_prompts_path().read_text(encoding="utf-8").splitlines():
        assert set(json.loads(line)) == {"id", "category", "prompt"}


def test_bundled_code_editing_prompts_carry_the_code() -> None:
    for prompt in load_prompts(categories=["code-editing"]):
        code = prompt.text.split("```python\n", 1)[1].split("```", 1)[0]
        ast.parse(code)
        assert 25 <= len(code.strip().splitlines()) <= 45


def test_bundled_summarization_passages_have_reasonable_length() -> None:
    for prompt in load_prompts(categories=["summarization"]):
        passage = prompt.text.split("\n\n", 1)[1]
        assert 150 <= len(passage.split()) <= 250


def test_prompt_is_frozen() -> None:
    prompt = load_prompts(limit=1)[0]
    with pytest.raises(AttributeError):
        prompt.text = "changed"  # type: ignore[misc]


# --- filtering -----------------------------------------------------------------


def test_category_filter_and_limit() -> None:
    math = load_prompts(categories=["math"])
    assert [p.category for p in math] == ["math"] * 3
    both = load_prompts(categories=["translation", "chat"], limit=4)
    assert len(both) == 4
    assert [p.category for p in both] == ["chat", "chat", "chat", "translation"]  # file order kept
    assert load_prompts(limit=2) == load_prompts()[:2]
    assert len(load_prompts(limit=100)) == 18


def test_unknown_category_names_available_ones() -> None:
    with pytest.raises(PromptFileError, match="available: chat, code-writing"):
        load_prompts(categories=["poetry"])


@pytest.mark.parametrize("limit", [0, -3])
def test_bad_limit(limit: int) -> None:
    with pytest.raises(PromptFileError, match="limit"):
        load_prompts(limit=limit)


def test_categories_of_keeps_first_seen_order() -> None:
    prompts = [Prompt("1", "b", "x"), Prompt("2", "a", "y"), Prompt("3", "b", "z")]
    assert categories_of(prompts) == ["b", "a"]
    assert categories_of([]) == []


# --- formats ---------------------------------------------------------------------


def test_specbench_format_uses_first_turn(tmp_path: Path) -> None:
    line = json.dumps({"question_id": 81, "category": "writing", "turns": ["First turn", "Second"]})
    path = write_lines(tmp_path, ["", line, "   "])
    assert load_prompts(path) == [Prompt(id="81", category="writing", text="First turn")]


def test_mixed_formats_and_blank_lines(tmp_path: Path) -> None:
    lines = [
        simple("a", "chat", "Hi"),
        "",
        json.dumps({"question_id": 2, "category": "math", "turns": ["What is 2+2?"]}),
        "\t",
        simple("c", "math", "Add 3 and 4"),
    ]
    prompts = load_prompts(str(write_lines(tmp_path, lines)))
    assert [p.id for p in prompts] == ["a", "2", "c"]
    assert categories_of(prompts) == ["chat", "math"]


@pytest.mark.skipif(not SPECBENCH.is_file(), reason=f"Spec-Bench questions not present at {SPECBENCH}")
def test_real_specbench_file() -> None:
    prompts = load_prompts(SPECBENCH)
    assert len(prompts) == 480
    assert len({p.id for p in prompts}) == 480
    cats = categories_of(prompts)
    for name in ("translation", "summarization", "qa", "math_reasoning", "rag", "coding"):
        assert name in cats
    assert len(load_prompts(SPECBENCH, categories=["translation"])) == 80
    assert len(load_prompts(SPECBENCH, categories=["coding"], limit=3)) == 3


# --- errors ----------------------------------------------------------------------


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(PromptFileError, match="not found"):
        load_prompts(tmp_path / "nope.jsonl")


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("\n  \n\n", encoding="utf-8")
    with pytest.raises(PromptFileError, match="no prompts"):
        load_prompts(path)


def test_invalid_json_reports_line(tmp_path: Path) -> None:
    path = write_lines(tmp_path, [simple("a"), "", '{"id": "b", "category": '])
    with pytest.raises(PromptFileError, match=r":3: invalid JSON"):
        load_prompts(path)


def test_line_in_neither_format(tmp_path: Path) -> None:
    path = write_lines(tmp_path, [simple("a"), json.dumps({"question": "x", "category": "c"})])
    with pytest.raises(PromptFileError, match=r":2: not a prompt record.*id, prompt.*question_id, turns"):
        load_prompts(path)


def test_partial_simple_record_names_missing_key(tmp_path: Path) -> None:
    path = write_lines(tmp_path, [json.dumps({"id": "a", "prompt": "Hi"})])
    with pytest.raises(PromptFileError, match=r":1: .*missing key\(s\) category"):
        load_prompts(path)


def test_partial_specbench_record_names_missing_key(tmp_path: Path) -> None:
    path = write_lines(tmp_path, [json.dumps({"question_id": 1, "turns": ["Hi"]})])
    with pytest.raises(PromptFileError, match=r":1: Spec-Bench record is missing key\(s\) category"):
        load_prompts(path)


def test_non_object_line(tmp_path: Path) -> None:
    path = write_lines(tmp_path, ['["a", "b"]'])
    with pytest.raises(PromptFileError, match=":1: expected a JSON object"):
        load_prompts(path)


@pytest.mark.parametrize(
    "record",
    [
        {"id": "a", "category": "chat", "prompt": "   "},
        {"question_id": 5, "category": "qa", "turns": [""]},
    ],
)
def test_empty_prompt_text(tmp_path: Path, record: dict) -> None:
    with pytest.raises(PromptFileError, match="empty text"):
        load_prompts(write_lines(tmp_path, [json.dumps(record)]))


def test_empty_turns(tmp_path: Path) -> None:
    path = write_lines(tmp_path, [json.dumps({"question_id": 5, "category": "qa", "turns": []})])
    with pytest.raises(PromptFileError, match="turns"):
        load_prompts(path)


def test_duplicate_ids(tmp_path: Path) -> None:
    lines = [simple("x"), simple("y"), json.dumps({"question_id": "x", "category": "c", "turns": ["t"]})]
    with pytest.raises(PromptFileError, match=r":3: duplicate prompt id 'x' \(first seen on line 1\)"):
        load_prompts(write_lines(tmp_path, lines))


def test_errors_are_value_errors_with_one_line(tmp_path: Path) -> None:
    path = write_lines(tmp_path, ["{bad json"])
    with pytest.raises(ValueError) as info:
        load_prompts(path)
    assert "\n" not in str(info.value)


def test_per_category_keeps_a_balanced_sample(tmp_path):
    path = tmp_path / "p.jsonl"
    rows = [{"id": f"{c}{i}", "category": c, "prompt": "x"} for c in ("a", "b") for i in range(4)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    picked = load_prompts(path, per_category=2)
    assert [p.id for p in picked] == ["a0", "a1", "b0", "b1"]
    with pytest.raises(PromptFileError):
        load_prompts(path, per_category=0)
