import hashlib
import json
import logging

import datasets
import polars as pl
import pytest

from graftlab.errors import GraftlabError
from graftlab.tasks.math import MATH_INSTRUCTION
from graftlab.tasks.sources import ProblemSource, load_problems, read_table, write_problems

ROWS = [
    {"uid": "q1", "question": "What is 1/2 as a decimal?", "final": "0.5", "level": 1},
    {"uid": "q2", "question": "Compute 3*4.", "final": "12", "level": 1},
    {"uid": "q3", "question": "Simplify 6/8.", "final": r"\frac{3}{4}", "level": 2},
]
MAPPING = {"prompt": "question", "answer": "final", "id": "uid"}


@pytest.fixture(autouse=True)
def hf_cache_in_tmp(tmp_path, monkeypatch):
    # load_dataset caches what it reads; keep that out of the user's ~/.cache and off the network.
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)


def write(tmp_path, rows, kind):
    frame = pl.DataFrame(rows)
    if kind == "parquet":
        path = tmp_path / "problems.parquet"
        frame.write_parquet(path)
    elif kind == "jsonl":
        path = tmp_path / "problems.jsonl"
        frame.write_ndjson(path)
    elif kind == "json":
        path = tmp_path / "problems.json"
        frame.write_json(path)
    elif kind == "save_to_disk":
        path = tmp_path / "saved"
        datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)}).save_to_disk(str(path))
    else:  # a directory of raw data files, read by load_dataset as a hub id would be
        path = tmp_path / "repo"
        (path / "data").mkdir(parents=True)
        frame.write_ndjson(path / "data" / "test.jsonl")
    return str(path)


@pytest.mark.parametrize("kind", ["parquet", "jsonl", "json", "save_to_disk", "load_dataset"])
def test_loads_every_source_kind_with_a_column_mapping(tmp_path, kind):
    src = ProblemSource("toy", write(tmp_path, ROWS, kind), columns=MAPPING, split=None)
    problems, stats = load_problems(src)
    assert problems.columns == ["id", "task", "prompt", "answer"]
    assert problems["id"].to_list() == ["q1", "q2", "q3"]
    assert problems["task"].unique().to_list() == ["math"]
    assert problems["prompt"][1] == f"Compute 3*4.\n\n{MATH_INSTRUCTION}"
    assert problems["answer"].to_list() == ["0.5", "12", r"\frac{3}{4}"]
    assert stats["rows"] == stats["kept"] == 3 and sum(stats["skipped"].values()) == 0


def test_split_must_be_named_when_there_are_several(tmp_path):
    path = tmp_path / "two"
    part = datasets.Dataset.from_list(ROWS)
    datasets.DatasetDict({"train": part, "test": part.select([0])}).save_to_disk(str(path))
    with pytest.raises(GraftlabError, match=r"split None not found; splits: \['test', 'train'\]"):
        read_table(ProblemSource("two", str(path), columns=MAPPING))
    assert read_table(ProblemSource("two", str(path), columns=MAPPING, split="test")).height == 1


def test_integer_answers_and_hash_ids(tmp_path):
    rows = [
        {"problem": "Find n.", "answer": 204},
        {"problem": "Find m.", "answer": 7},
        {"problem": "Find n.", "answer": 204},
    ]
    problems, stats = load_problems(ProblemSource("aime", write(tmp_path, rows, "parquet")))
    assert problems["answer"].to_list() == ["204", "7"]
    assert problems["id"][0] == hashlib.sha256(b"Find n.").hexdigest()[:16]
    # The repeated problem is the same problem: dropped once, and counted.
    assert stats["skipped"]["duplicate"] == 1 and stats["kept"] == 2
    # The same text gets the same id from another file type.
    again, _ = load_problems(ProblemSource("aime", write(tmp_path, rows, "jsonl")))
    assert again["id"].to_list() == problems["id"].to_list()


def test_solution_column_and_knowledge_task(tmp_path):
    rows = [{"q": "Where was Ada Brel born?", "a": "Varnholm", "s": "Ada Brel was born in Varnholm."}]
    src = ProblemSource(
        "kn", write(tmp_path, rows, "jsonl"), task="knowledge", columns={"prompt": "q", "answer": "a", "solution": "s"}
    )
    problems, _ = load_problems(src)
    assert problems.row(0, named=True) == {
        "id": hashlib.sha256(b"Where was Ada Brel born?").hexdigest()[:16],
        "task": "knowledge",
        "prompt": "Where was Ada Brel born?",
        "answer": "Varnholm",
        "solution": "Ada Brel was born in Varnholm.",
    }


def test_missing_column_names_dataset_column_and_columns_present(tmp_path):
    src = ProblemSource("toy", write(tmp_path, ROWS, "parquet"), columns={"prompt": "question", "answer": "solution"})
    with pytest.raises(GraftlabError) as err:
        load_problems(src)
    message = str(err.value)
    assert "dataset toy" in message and "'solution'" in message and "mapped as answer" in message
    assert "['uid', 'question', 'final', 'level']" in message


def test_unparsable_answers_are_skipped_counted_and_logged(tmp_path, caplog):
    rows = ROWS + [
        {"uid": "bad1", "question": "Q?", "final": "???", "level": 3},
        {"uid": "bad2", "question": "R?", "final": "", "level": 3},
        {"uid": "bad3", "question": "S?", "final": r"\frac{1}{", "level": 3},
    ]
    with caplog.at_level(logging.WARNING, logger="graftlab.tasks.sources"):
        problems, stats = load_problems(ProblemSource("toy", write(tmp_path, rows, "jsonl"), columns=MAPPING))
    assert problems["id"].to_list() == ["q1", "q2", "q3"]
    assert stats["skipped"] == {"empty": 1, "unparsable": 2, "duplicate": 0}
    assert stats["skipped_ids"] == {"empty": ["bad2"], "unparsable": ["bad1", "bad3"]}
    assert "skipped 2 unparsable row(s)" in caplog.text and "bad1" in caplog.text


def test_unparsable_answers_can_be_an_error_listing_ids(tmp_path):
    rows = ROWS + [{"uid": "bad1", "question": "Q?", "final": "???", "level": 3}]
    src = ProblemSource("toy", write(tmp_path, rows, "jsonl"), columns=MAPPING, on_unparsable="error")
    with pytest.raises(GraftlabError, match=r"dataset toy .*1 of 4 rows .*\['bad1'\]"):
        load_problems(src)


def test_nothing_usable_is_an_error(tmp_path):
    rows = [{"uid": "bad1", "question": "Q?", "final": "???", "level": 3}]
    with pytest.raises(GraftlabError, match=r"no usable problems in 1 rows .*'unparsable': 1"):
        load_problems(ProblemSource("toy", write(tmp_path, rows, "jsonl"), columns=MAPPING))
    empty = tmp_path / "empty.parquet"
    pl.DataFrame(schema={"problem": pl.String, "answer": pl.String}).write_parquet(empty)
    with pytest.raises(GraftlabError, match="no usable problems in 0 rows"):
        load_problems(ProblemSource("empty", str(empty)))


def test_repeated_ids_are_an_error(tmp_path):
    src = ProblemSource("toy", write(tmp_path, ROWS, "parquet"), columns={**MAPPING, "id": "level"})
    with pytest.raises(GraftlabError, match=r"id column 'level' has 1 empty or repeated"):
        load_problems(src)


def test_limit_keeps_the_first_usable_problems(tmp_path):
    problems, stats = load_problems(ProblemSource("toy", write(tmp_path, ROWS, "parquet"), columns=MAPPING, limit=2))
    assert problems["id"].to_list() == ["q1", "q2"] and stats["usable"] == 3 and stats["kept"] == 2


def test_missing_local_paths_never_go_to_the_hub(tmp_path):
    with pytest.raises(GraftlabError, match="no such file"):
        read_table(ProblemSource("gone", str(tmp_path / "gone.parquet")))
    with pytest.raises(GraftlabError, match="revision 'abc' pins hub ids only"):
        read_table(ProblemSource("toy", write(tmp_path, ROWS, "parquet"), columns=MAPPING, revision="abc"))


def test_unreachable_hub_id_is_a_graftlab_error():
    # Offline (see the fixture), a hub id cannot resolve: the failure names the data set.
    with pytest.raises(GraftlabError, match="dataset aime24: cannot load 'graftlab-test/no-such-dataset'"):
        read_table(ProblemSource("aime24", "graftlab-test/no-such-dataset", split="train", revision="main"))


def test_from_config_checks_keys_and_mapping(tmp_path):
    src = ProblemSource.from_config("toy", {"source": "x.parquet", "columns": MAPPING, "split": "test"})
    assert src.columns == MAPPING and src.task == "math"
    with pytest.raises(GraftlabError, match=r"unknown keys \['prompt_col'\]"):
        ProblemSource.from_config("toy", {"source": "x.parquet", "prompt_col": "q"})
    with pytest.raises(GraftlabError, match="columns must map prompt and answer"):
        ProblemSource.from_config("toy", {"source": "x.parquet", "columns": {"prompt": "q"}})
    with pytest.raises(GraftlabError, match="unknown task"):
        ProblemSource.from_config("toy", {"source": "x.parquet", "task": "physics"})


def test_write_problems_writes_parquet_and_stats(tmp_path):
    out, stats_out = tmp_path / "out" / "bench.parquet", tmp_path / "out" / "bench.stats.json"
    stats = write_problems(ProblemSource("toy", write(tmp_path, ROWS, "jsonl"), columns=MAPPING), out, stats_out)
    assert pl.read_parquet(out)["id"].to_list() == ["q1", "q2", "q3"]
    assert json.loads(stats_out.read_text()) == stats and stats["dataset"] == "toy"
    assert sorted(p.name for p in out.parent.iterdir()) == ["bench.parquet", "bench.stats.json"]


def test_a_leak_is_found_by_id_or_by_prompt_and_refused_or_reported(tmp_path, capsys):
    from graftlab.tasks.sources import find_leaks, refuse_leaks

    bench = tmp_path / "bench.parquet"
    pl.DataFrame({"id": ["b1", "b2"], "prompt": ["What is 2+2?", "Name  a\tprime."]}).write_parquet(bench)
    problems = pl.DataFrame(
        {"id": ["p0", "b1", "p2", "p3"], "prompt": ["What is 3+3?", "other", "Name a prime.", "Name a prime!"]}
    )
    # Row 1 shares an id, row 2 a prompt up to white space; row 3's punctuation differs: no leak.
    assert find_leaks(problems, [bench]) == [(str(bench), 1, "b1", 2)]
    with pytest.raises(
        GraftlabError, match=r"row 1 \(id 'b1'\) is also a problem of the benchmark .*bench.parquet \(2"
    ):
        refuse_leaks(problems, [bench], "candidates")
    refuse_leaks(problems, [bench], "candidates", report=True)
    assert "WARNING: candidates: row 1 (id 'b1')" in capsys.readouterr().err
    refuse_leaks(problems.slice(3), [bench], "candidates")  # nothing leaks: nothing said
    assert capsys.readouterr().err == ""
