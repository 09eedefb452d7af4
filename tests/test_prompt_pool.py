"""The training pool at scale: shards built up run by run, near-identical prompts dropped, passages from local
text, requests written by the target, answers resumed answer by answer, and no benchmark prompt in the pool."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from tiny import byte_tokenizer, save_tiny_pair, spy_on_open

from specdemo.backends.loading import LoadSettings, load_model
from specdemo.training import magpie, pool, prompt_pool
from specdemo.training.local_texts import Passage, roff_text
from specdemo.training.near_duplicates import NEAR_IDENTICAL, ShingleIndex, distinct, jaccard, shingles
from specdemo.training.row_shards import RowShards

ROOT = Path(__file__).resolve().parents[1]
BENCHMARK_FILES = {"prompts.jsonl", "question.jsonl"}
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def benchmark_prompts() -> list[str]:
    prompts = [json.loads(line)["prompt"] for line in (ROOT / "specdemo" / "data" / "prompts.jsonl").open()]
    questions = ROOT.parent / "shared" / "specbench" / "question.jsonl"
    if questions.is_file():
        prompts += [turn for line in questions.open() for turn in json.loads(line)["turns"]]
    return prompts


# ----------------------------------------------------------------------------------------------------------------
# the parts


def test_row_shards_seal_whole_shards_and_resume_after_a_torn_line(tmp_path: Path):
    shards = RowShards(tmp_path, "answers", rows_per_shard=3)
    shards.append({"index": i, "x": i} for i in range(4))
    assert [p.name for p in shards.sealed_paths()] == ["answers-0000.jsonl.gz"]
    assert sorted(shards.rows()) == [0, 1, 2, 3]
    with shards.open_path.open("a") as handle:
        handle.write('{"index": 4, "x"')  # a run killed mid-write
    assert sorted(shards.rows()) == [0, 1, 2, 3]  # the torn row is written again by the next run
    shards.append([{"index": 4, "x": 4}])  # the next run writes it again, on a line of its own
    assert sorted(shards.rows()) == [0, 1, 2, 3, 4] and shards.rows()[4]["x"] == 4
    shards.append([{"index": 5, "x": 5}])
    assert [p.name for p in shards.sealed_paths()] == ["answers-0000.jsonl.gz", "answers-0001.jsonl.gz"]
    assert not shards.open_path.exists() and sorted(shards.rows()) == list(range(6))
    first = shards.sealed_paths()[0].read_bytes()
    again = RowShards(tmp_path / "again", "answers", rows_per_shard=3)
    again.append({"index": i, "x": i} for i in range(3))
    assert again.sealed_paths()[0].read_bytes() == first  # the same rows give the same bytes on any machine
    shards.append([{"index": 6, "x": 6}])
    assert shards.seal(only_full=False) == 1 and not shards.open_path.exists() and len(shards.rows()) == 7
    broken = tmp_path / "answers-0003.jsonl.gz"
    broken.write_bytes(gzip.compress(b'{"index": 9}\nnot json\n'))
    with pytest.raises(ValueError, match="not JSON"):
        shards.rows()


def test_near_identical_texts_are_found_without_comparing_every_pair():
    base = "Explain how a hash table resolves collisions, with an example in Python and a note on resizing."
    assert jaccard(shingles(base), shingles(base.replace("Python", "Python 3"))) >= NEAR_IDENTICAL - 0.1
    texts = [base, base + " Thanks!", "Write a haiku about the ocean at dawn.", "Explain recursion to a beginner.",
             "Explain hash tables to a beginner."]
    assert distinct(texts) == [0, 2, 3, 4]  # only the copy with a word added goes
    assert distinct(["Explain recursion to a beginner."], against=texts) == []
    index = ShingleIndex()
    for number in range(3000):  # a template shared by thousands: its common words find no pairs, exact ones do
        index.add(f"Write a short poem about the number {number} and what it means to you.")
    assert index.closest("Write a short poem about the number 17 and what it means to you.")[0] == 17
    assert index.closest("Describe the water cycle for a child.") is None


def test_a_manual_page_gives_its_description_as_plain_paragraphs():
    page = "\n".join([
        '.TH "LS" "1"', ".SH NAME", "ls \\- list directory contents", ".SH DESCRIPTION",
        "List information about the \\fBFILEs\\fR (the current directory by default).",
        "Sort entries alphabetically if none of", ".B \\-cftuvSUX", "is specified.", ".PP",
        "Mandatory arguments to long options are mandatory for short options too.", ".SH SEE ALSO", "dir(1)",
    ])
    sections = roff_text(page)
    assert sections["DESCRIPTION"] == [
        "List information about the FILEs (the current directory by default). Sort entries alphabetically if none "
        "of -cftuvSUX is specified.",
        "Mandatory arguments to long options are mandatory for short options too.",
    ]
    assert sections["NAME"] == ["ls - list directory contents"]


def small_material(monkeypatch) -> None:
    """A pool built from a few functions and passages instead of the whole machine's (seconds, not a minute)."""
    functions = [("m", f"def f{i}(x):\n    '''Return x plus {i}.'''\n    y = x\n    z = y\n    return z + {i}\n",
                  f"Return the value plus {i} after copying it twice") for i in range(40)]
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()
    passages = [Passage(f"man:tool{i}.1", " ".join(words[(i + j) % len(words)] + str(i * 7 + j) for j in range(70)))
                for i in range(80)]
    monkeypatch.setattr(prompt_pool, "stdlib_functions", lambda seed: list(functions))
    monkeypatch.setattr(prompt_pool, "local_passages", lambda seed: list(passages))


def test_templated_prompts_cover_every_kind_in_their_shares_and_are_distinct(monkeypatch):
    small_material(monkeypatch)
    prompts = prompt_pool.templated_prompts(200, seed=0)
    assert len(prompts) == 200 and len({p.text for p in prompts}) == 200
    kinds = {p.kind for p in prompts}
    assert {"code writing", "code editing", "summary", "translation", "passage question", "passage extraction",
            "retrieval"} <= kinds and len(kinds) >= 14  # the chat kinds too
    assert 15 <= sum(p.kind == "retrieval" for p in prompts) <= 25
    retrieval = next(p for p in prompts if p.kind == "retrieval")
    assert "[1]" in retrieval.text and "[3]" in retrieval.text and "tool" in retrieval.text
    assert distinct([p.text for p in prompts]) == list(range(200))
    assert prompt_pool.templated_prompts(200, seed=0) == prompts  # one seed, one pool


def test_the_pre_query_template_ends_where_the_users_message_begins():
    before, after = magpie.pre_query(byte_tokenizer(), "cooking and recipes")
    assert before.startswith("<system>") and "cooking and recipes" in before and before.endswith("<user>")
    assert after.startswith("\n")
    assert magpie.usable("How do I make a sourdough starter from scratch at home?")
    assert not magpie.usable("hi") and not magpie.usable("<|im_start|>assistant hello there, how are you")


# ----------------------------------------------------------------------------------------------------------------
# a whole build, stopped and resumed


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    return save_tiny_pair(tmp_path_factory.mktemp("pair"))[0]


def test_a_build_resumes_answer_by_answer_and_reads_no_benchmark_file(target, tmp_path, monkeypatch, capsys):
    small_material(monkeypatch)
    folder = tmp_path / "pool"
    monkeypatch.setattr(magpie, "usable", lambda text: bool(text.strip()))  # a random model writes noise
    monkeypatch.setattr(pool, "REQUEST_BATCH", 4)
    common = ["--target", target, "--dtype", "float32", "--templated", "10", "--requests", "3", "--answer-tokens",
              "6", "--folder", str(folder)]
    with monkeypatch.context() as spied:
        opened = spy_on_open(spied)
        assert pool.main(common + ["--phases", "templated,requests"]) == 0
    assert opened and not [name for name in opened if Path(name).name in BENCHMARK_FILES]
    prompts = prompt_pool.read_pool(folder)
    assert len(prompts) >= 13 and sum(p.kind == "request" for p in prompts) >= 3
    assert all(p.source.startswith("magpie:") for p in prompts[10:])

    settings = pool.PoolSettings(target, "float32", templated=10, answer_tokens=6, batch="2", folder=folder)
    loaded = load_model(target, LoadSettings(dtype="float32"))
    calls = {"n": 0}
    real_generate = pool.generate_batch

    def stop_after_two(*args, **kwargs):  # the time budget runs out after two batches
        calls["n"] += 1
        if calls["n"] == 2:
            monkeypatch.setattr(pool.Deadline, "passed", property(lambda self: True))
        return real_generate(*args, **kwargs)

    monkeypatch.setattr(pool, "generate_batch", stop_after_two)
    report = pool.answer_pool(loaded, settings, pool.Deadline(None))
    assert report["rows"] == 4 and len(pool.read_answers(settings, prompts)) == 4
    monkeypatch.undo()
    small_material(monkeypatch)
    assert pool.main(common + ["--phases", "answers", "--batch", "3"]) == 0
    answers = pool.read_answers(settings, prompts)
    assert sorted(answers) == list(range(len(prompts)))
    assert all(row["prompt"] == prompts[i].text and 1 <= len(row["answer_ids"]) <= 6 for i, row in answers.items())
    runs = [json.loads(line) for line in (folder / "runs.jsonl").read_text().splitlines()]
    assert [run["phase"] for run in runs] == ["templated", "requests", "answers"] and runs[-1]["batch"] == 3
    # --batch auto: the size an earlier run measured fastest on this machine, in this format, is used again
    with (folder / "runs.jsonl").open("a") as handle:
        handle.write(json.dumps({"phase": "answers", "machine": pool.machine(), "format": "float32",
                                 "batch_rates": {"32": 5.0, "64": 9.0, "128": 7.0}}) + "\n")
    auto = pool.PoolSettings(target, "float32", batch="auto", folder=folder)
    assert pool._batch_size(loaded, auto, [[1, 2, 3]]) == (64, {})
    assert pool.main(common + ["--phases", "answers,everything"]) == 2
    assert "unknown phases" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------------------------
# the stored pool


def test_no_stored_prompt_is_near_identical_to_a_benchmark_prompt():
    prompts = prompt_pool.read_pool()
    if not prompts:
        pytest.skip("no prompt pool is stored under assets/training/pool")
    index = ShingleIndex()
    for text in benchmark_prompts():
        index.add(text)
    close = [(p.text[:80], index.closest(p.text)) for p in prompts if index.closest(p.text) is not None]
    assert not close, close[:3]
    assert len(prompts) >= 10000 and len({p.text for p in prompts}) == len(prompts)


def test_answer_batches_are_sorted_by_length_and_bounded_in_padded_prompt_positions(monkeypatch):
    monkeypatch.setattr(pool, "MAX_PROMPT_POSITIONS", 100)
    lengths = {0: 30, 1: 10, 2: 12, 3: 40, 4: 11, 5: 150, 6: 20}
    headers = {index: [1] * length for index, length in lengths.items()}
    batches = pool.prompt_batches(list(lengths), headers, batch=3)
    assert [i for b in batches for i in b] == sorted(lengths, key=lengths.get)  # every prompt once, by length
    assert all(len(b) <= 3 for b in batches)
    assert all(len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 100 for b in batches)
    assert batches == [[1, 4, 2], [6, 0], [3], [5]]  # 150 alone: longer than the bound


def test_the_pool_cuts_into_parts_that_cover_it_once_and_mix_its_kinds():
    parts = [pool.part_indexes(12228, f"{k}/4") for k in range(1, 5)]
    assert sorted(i for part in parts for i in part) == list(range(12228))  # every prompt in exactly one part
    assert {len(part) for part in parts} == {3057} and parts[0] == sorted(parts[0])
    assert pool.part_indexes(12228, "1/4") == parts[0]  # the same cut every time, on every machine
    eighths = [pool.part_indexes(12228, f"{k}/8") for k in (3, 4)]
    assert sorted(eighths[0] + eighths[1]) == parts[1]  # parts nest: 3/8 and 4/8 are 2/4
    prompts = prompt_pool.read_pool(prompt_pool.POOL_FOLDER)
    share = {kind: sum(p.kind == kind for p in prompts) / len(prompts) for kind in {p.kind for p in prompts}}
    for part in (pool.part_indexes(len(prompts), f"{k}/4") for k in range(1, 5)):
        for kind, whole in share.items():  # each part mixes the kinds as the pool does
            assert abs(sum(prompts[i].kind == kind for i in part) / len(part) - whole) < 0.03
    for bad in ("0/4", "5/4", "x", "1/2/3"):
        with pytest.raises(ValueError, match="--pool-part"):
            pool.part_indexes(100, bad)
