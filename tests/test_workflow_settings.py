"""The paper's settings as experiments of configs/smoke.yaml: teacher traces, STaR, Pedagogical RL and
knowledge injection each run SFT, grafting and merging (masked too) and land in a summary and a Pareto
plot of their own; what each data stage stores is what the method promises."""

import json
from collections import Counter

import polars as pl
import pytest
import yaml
from conftest import new_data, snakemake

from graftlab.planning.config import resolve
from graftlab.planning.layout import Experiment
from graftlab.tasks import is_correct

pytestmark = pytest.mark.workflow
SETTINGS = {
    "expert": "expert",
    "teacher": "teacher",
    "star": "star",
    "pedagogical": "pedagogical",
    "knowledge": "knowledge",
}


@pytest.mark.parametrize("exp", SETTINGS)
def test_every_setting_has_its_summary_and_pareto_plot(smoke, exp):
    summary = pl.read_parquet(smoke / f"results/{exp}/summary.parquet")
    assert summary["data"].unique().to_list() == [SETTINGS[exp]]
    methods = Counter(summary["method"])
    assert methods["post"] == 1 and methods["sft"] == 2 and methods["graft"] >= 2 and methods["merge"] >= 2
    assert methods["opsd"] >= 1
    assert set(summary["mask"].drop_nulls()) == {"none", "diag"}
    assert (summary["data_traces"] >= 1).all() and (summary["data_traces"] <= summary["data_problems"]).all()
    assert (smoke / f"results/{exp}/pareto.png").stat().st_size > 0


def traces_and_stats(smoke, exp):
    data = smoke / f"results/{exp}/data"
    return pl.read_parquet(data / "sft.parquet"), json.loads((data / "sft.json").read_text()), data


@pytest.mark.parametrize("exp", ["teacher", "star", "pedagogical"])
def test_sampled_traces_are_verified_one_per_problem_and_carry_the_bare_prompt(smoke, exp):
    traces, stats, _ = traces_and_stats(smoke, exp)
    problems = pl.read_parquet(smoke / new_data(exp, "train"))
    assert traces["id"].n_unique() == traces.height == stats["traces"]
    assert stats["problems"] == problems.height and stats["skipped"] == problems.height - traces.height
    answers = dict(zip(problems["id"], problems["answer"]))
    prompts = dict(zip(problems["id"], problems["prompt"]))
    for row in traces.iter_rows(named=True):
        assert is_correct(row["completion"], answers[row["id"]])
        assert row["prompt"] == prompts[row["id"]]  # never the hinted or the teacher's prompt
        assert "hint" not in row["completion"].lower() and "reference" not in row["completion"].lower()
    heldout = pl.read_parquet(smoke / new_data(exp, "heldout"))
    assert not set(heldout["id"]) & set(traces["id"])


def test_star_reports_its_solve_rate_and_attempts(smoke):
    _, stats, _ = traces_and_stats(smoke, "star")
    assert stats["solve_rate"] == pytest.approx(stats["solved"] / stats["problems"])
    assert sum(stats["attempts_histogram"].values()) == stats["solved_by_sampling"]
    assert all(1 <= int(k) <= 8 for k in stats["attempts_histogram"])


def test_pedagogical_teacher_logs_every_reward_component_per_step(smoke):
    from transformers import AutoModelForCausalLM

    steps = [json.loads(line) for line in (smoke / "results/pedagogical/pedagogical/steps.jsonl").open()]
    assert len(steps) == 4
    for key in ("correct", "well_formed", "learnability", "soft_gap", "reward"):
        assert all(f"pedagogical/{key}" in step for step in steps)
    AutoModelForCausalLM.from_pretrained(smoke / "results/pedagogical/pedagogical/teacher")


def test_knowledge_trains_on_training_phrasings_and_is_scored_greedily_on_held_out_ones(smoke):
    traces, stats, data = traces_and_stats(smoke, "knowledge")
    heldout = pl.read_parquet(data / "heldout.parquet")
    assert not set(heldout["prompt"]) & set(traces["prompt"])
    assert stats["replay"] == 12 and stats["qa"] == traces.filter(pl.col("task") == "knowledge").height
    post = json.loads((smoke / "results/knowledge/eval/post/metrics.json").read_text())
    assert post["benchmarks"]["knowledge"]["decoding"]["mode"] == "greedy"
    assert post["benchmarks"]["knowledge"]["problems"] == heldout.height
    assert post["new"] <= 0.1  # the closed-book accuracy before training: the facts are invented


def test_opsd_logs_sampling_and_update_seconds_of_every_step_and_keeps_the_last(smoke):
    run = smoke / "results/knowledge/opsd/post/alpha~0.5/lr~1e-4"
    steps = [json.loads(line) for line in (run / "steps.jsonl").open()]
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    assert all(s["sample_s"] > 0 and s["update_s"] > 0 for s in steps)
    assert {p.name for p in run.iterdir() if not p.name.startswith(".")} == {"step~4", "steps.jsonl", "training.png"}


def test_a_data_set_missing_its_answer_column_fails_clearly_and_writes_nothing(tmp_path):
    pl.DataFrame({"problem": ["1+1?"], "solution": ["2"]}).write_parquet(tmp_path / "bad.parquet")
    bad = {"problems": {"source": str(tmp_path / "bad.parquet")}}
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump({"experiments": {"bad": bad}}))
    target = Experiment.of(resolve({"experiments": {"bad": bad}}), "bad").candidates()  # as resolved: the read
    proc = snakemake(tmp_path, "--cores", "1", target, configs=(tmp_path / "bad.yaml",))
    assert proc.returncode != 0
    log = (tmp_path / target.replace("results/", "logs/")).with_suffix(".log").read_text()
    assert "dataset experiments.bad.problems (" in log and "no column 'answer' (mapped as answer)" in log
    assert not (tmp_path / target).exists() and not (tmp_path / "results/world").exists()
