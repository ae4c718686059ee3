"""A continual stage's data (graftlab.synth.stage_data): fresh tiny-world problems with the solver's verified
traces, none from a benchmark; the knowledge world; a data set's held-out and training rows; a star stage's
problems without traces."""

import json
import os

import polars as pl
import pytest

from graftlab.planning.config import resolve
from graftlab.synth.stage_data import write_stage_data
from graftlab.tasks import get_task
from graftlab.tasks.arith import sample_problems


def stage(**keys) -> dict:
    return resolve({"experiments": {"c": {"stages": [keys]}}})["experiments"]["c"]["stages"][0]


def test_a_tiny_world_stage_draws_fresh_problems_with_verified_traces(tmp_path):
    bench = tmp_path / "order_bench.parquet"
    taken = sample_problems("order", 40, "stage-order", 0)[:5]  # the stage's own stream: excluded below
    pl.DataFrame([{k: p[k] for k in ("id", "task", "prompt", "answer")} for p in taken]).write_parquet(bench)
    stats = write_stage_data(stage(domain="order", train=20, heldout=8), tmp_path / "d", 0, ["add"], [bench])
    sft, held = pl.read_parquet(tmp_path / "d/sft.parquet"), pl.read_parquet(tmp_path / "d/heldout.parquet")
    assert (sft.height, held.height, stats["domain"]) == (20, 8, "order")
    assert not set(sft["id"]) & set(held["id"]) and not (set(sft["id"]) | set(held["id"])) & {p["id"] for p in taken}
    # Each trace's final answer is the comparison its prompt asks for, worked out here from the prompt.
    grade = get_task("order").grade
    assert all(grade(c, _answer(p)) for c, p in zip(sft["completion"], sft["prompt"]))
    assert held["answer"].to_list() == [_answer(p) for p in held["prompt"]]
    assert pl.read_parquet(tmp_path / "d/facts.parquet").is_empty()
    assert json.loads((tmp_path / "d/sft.json").read_text())["traces"] == 20


def _answer(prompt: str) -> str:
    a, b = (int(x) for x in prompt.split()[1:])
    return "<" if a < b else ">" if a > b else "="


def test_a_star_stage_leaves_its_traces_to_the_post_model(tmp_path):
    write_stage_data(stage(domain="muln", data="star", train=6, heldout=2), tmp_path, 0, ["add"], star=True)
    sft = pl.read_parquet(tmp_path / "sft.parquet")
    assert sft.height == 6 and sft["completion"].null_count() == 6 and sft["answer"][0].startswith("n=")


def test_a_knowledge_stage_is_the_knowledge_world(tmp_path):
    knowledge = {"entities": 4, "facts": 8, "train_phrasings": 2, "heldout_phrasings": 1, "replay": 0}
    write_stage_data(stage(domain="knowledge", knowledge=knowledge), tmp_path, 0, ["add"])
    assert pl.read_parquet(tmp_path / "facts.parquet").height == 8
    assert pl.read_parquet(tmp_path / "heldout.parquet").height == 8 * 1


def test_a_data_set_stage_holds_out_its_first_problems(tmp_path):
    rows = [
        {"id": f"p{i}", "task": "math", "prompt": f"{i}+1?", "answer": str(i + 1), "solution": f"{i}+1"}
        for i in range(10)
    ]
    pl.DataFrame(rows).write_parquet(tmp_path / "set.parquet")
    source = {"source": "set.parquet", "columns": {"prompt": "q", "answer": "a", "solution": "s"}}
    write_stage_data(
        stage(domain="sums", problems=source, train=4, heldout=3),
        tmp_path / "d",
        0,
        [],
        problems_file=tmp_path / "set.parquet",
    )
    assert pl.read_parquet(tmp_path / "d/heldout.parquet")["id"].to_list() == ["p0", "p1", "p2"]
    assert pl.read_parquet(tmp_path / "d/sft.parquet")["id"].to_list() == ["p3", "p4", "p5", "p6"]


def test_too_few_data_set_problems_are_refused_by_name(tmp_path):
    pl.DataFrame([{"id": "p", "task": "math", "prompt": "1?", "answer": "1", "solution": "1"}]).write_parquet(
        tmp_path / "s.parquet"
    )
    source = {"source": "s.parquet", "columns": {"prompt": "q", "answer": "a", "solution": "s"}}
    with pytest.raises(Exception, match="stage sums"):
        write_stage_data(
            stage(domain="sums", problems=source, heldout=3),
            tmp_path / "d",
            0,
            [],
            problems_file=tmp_path / "s.parquet",
        )
    assert not (tmp_path / "d" / "sft.parquet").exists()


@pytest.fixture
def stats_first(monkeypatch):
    """Watches the moments a file can appear under its final name (a rename, a parquet write): `watch(table,
    stats)` registers a pair, and every such moment at which a table exists without its stats file is
    recorded in the returned list. A table under its final name must always have its stats."""
    pairs, late = [], []

    def check():
        late.extend(str(t) for t, s in pairs if t.exists() and not s.exists())

    def after(real):
        def call(*args, **kwargs):
            out = real(*args, **kwargs)
            check()
            return out

        return call

    monkeypatch.setattr(os, "replace", after(os.replace))
    monkeypatch.setattr(os, "rename", after(os.rename))
    monkeypatch.setattr(pl.DataFrame, "write_parquet", after(pl.DataFrame.write_parquet))
    return lambda table, stats: pairs.append((table, stats)), late


@pytest.mark.parametrize(
    ("keys", "star"),
    [
        ({"domain": "order", "train": 6, "heldout": 2}, False),
        ({"domain": "muln", "data": "star", "train": 4, "heldout": 2}, True),
        (
            {
                "domain": "knowledge",
                "knowledge": {"entities": 4, "facts": 8, "train_phrasings": 2, "heldout_phrasings": 1, "replay": 0},
            },
            False,
        ),
    ],
    ids=["world", "star", "knowledge"],
)
def test_a_stages_table_appears_only_after_its_stats(tmp_path, stats_first, keys, star):
    watch, late = stats_first
    watch(tmp_path / "d" / "sft.parquet", tmp_path / "d" / "sft.json")
    stats = write_stage_data(stage(**keys), tmp_path / "d", 0, ["add"], star=star)
    assert late == []
    assert (tmp_path / "d" / "sft.parquet").exists() and json.loads((tmp_path / "d" / "sft.json").read_text()) == stats
