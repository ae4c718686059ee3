"""`graftlab inspect`: frontier points against a brute-force dominance check, costs against the benchmark
files they sum, run states from Snakemake's summary, refusals; and on the smoke run, the whole command,
then a config edit that makes exactly its runs stale."""

import json
from itertools import product
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import yaml
from conftest import REPO, SMOKE

from graftlab.commands.cli import main
from graftlab.commands.inspect_results import (
    PROPAGATED,
    Lineage,
    benchmark_file,
    continual_models,
    dry_run_reasons,
    frontier,
    models,
    points,
    read_benchmark,
    run_costs,
    run_states,
)
from graftlab.errors import GraftlabError

HEADER = (
    "s\th:m:s\tmax_rss\tmax_vms\tmax_uss\tmax_pss\tio_in\tio_out\tmean_load\tcpu_time\t"
    "jobid\trule_name\twildcards\tparams\tthreads\tcpu_usage\tresources\tinput_size_mb"
)


def bench(workdir: Path, log: str, *repeats: tuple[float, float, float]) -> None:
    """The benchmark file of the job logging to `log`, one row per (s, cpu_time, max_rss) repeat; a tab
    inside its params column, as a param value may hold."""
    path = workdir / "benchmarks/jobs" / (log.removeprefix("logs/").removesuffix(".log") + ".tsv")
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [
        f"{s}\t0:00:01\t{rss}\t1\t1\t1\t0\t0\t50\t{cpu}\t3\trule\t{{}}\t{{'a': 'x\ty'}}\t1\t90\t{{}}\t0"
        for s, cpu, rss in repeats
    ]
    path.write_text("\n".join([HEADER, *rows]) + "\n")


def dag(*jobs: tuple) -> pl.DataFrame:
    """A `dag_summary` frame: (outputs, rule, log, inputs, status, pending, reason) per job."""
    names = ("rule", "log", "inputs", "status", "pending", "reason")
    rows = [{"output": o} | dict(zip(names, job[1:])) for job in jobs for o in job[0]]
    schema = dict.fromkeys(["output", "rule", "log", "status", "reason"], pl.String)
    return pl.DataFrame(rows, schema=schema | {"inputs": pl.List(pl.String), "pending": pl.Boolean})


def metrics(root: Path, run: str, new: float = 0.5, old: float = 0.5) -> None:
    path = root / "eval" / run / "metrics.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    bounds = {"new_lo": new - 0.1, "new_hi": new + 0.1, "old_lo": old - 0.1, "old_hi": old + 0.1}
    path.write_text(json.dumps({"run": run, "new": new, "old": old, **bounds, "benchmarks": {}}))


def dominated(p: dict, others: list[dict]) -> bool:
    return any(
        q["new"] >= p["new"] and q["old"] >= p["old"] and (q["new"] > p["new"] or q["old"] > p["old"]) for q in others
    )


def test_frontier_points_are_each_methods_non_dominated_runs(tmp_path):
    """Random points on a coarse grid (ties and duplicates), four methods and the ingredients: a method's
    points are exactly its runs no other of its runs dominates; exp_front likewise over every candidate
    but donor and donor_sft."""
    rng = np.random.default_rng(0)
    methods = ["sft", "graft", "merge", "opsd", "donor_sft"]
    rows = [
        {"run": f"{m}/{i}", "method": m, "new": float(rng.integers(0, 6)) / 5, "old": float(rng.integers(0, 6)) / 5}
        for m, i in product(methods, range(12))
    ]
    rows.append({"run": "post", "method": "post", "new": 0.0, "old": 1.0})
    root = tmp_path / "results/x"
    root.mkdir(parents=True)
    pl.DataFrame(rows).write_parquet(root / "summary.parquet")
    table, split = models(root)
    marked = {r["run"]: r for r in frontier(table).iter_rows(named=True)}
    candidates = [r for r in rows if r["method"] != "donor_sft"]
    for r in rows:
        own = [q for q in rows if q["method"] == r["method"]]
        assert marked[r["run"]]["on_front"] == (not dominated(r, own)), r
        assert marked[r["run"]]["exp_front"] == (r in candidates and not dominated(r, candidates)), r
    assert split == "all" and sum(m["on_front"] for m in marked.values()) >= len(methods) + 1


def test_a_validation_share_is_reported_as_the_test_split(tmp_path):
    root = tmp_path / "results/x"
    root.mkdir(parents=True)
    row = {"run": "post", "method": "post", "new": 0.1, "old": 0.9, "old_val": 0.8, "new_val": 0.2}
    pl.DataFrame([row]).write_parquet(root / "summary.parquet")
    table, split = models(root)
    assert split == "test" and table["old"].to_list() == [0.9]


def test_a_continual_experiment_competes_with_each_chains_last_stage(tmp_path):
    root = tmp_path / "results/c"
    metrics(root, "post", 0.1, 0.9)
    for chain, (k, new) in product(["sft/post/lr~1e-3", "sdpo/post/teacher~ema:0.05/lr~1e-3"], [(1, 0.9), (2, 0.3)]):
        metrics(root, f"chain/{chain}/stage~{k}", new, 0.5)
    metrics(root, "chain/sdpo/post/teacher~ema:0.05/lr~1e-3/stage~2/step~1", 0.95, 0.95)
    table = frontier(continual_models(root))
    front = table.filter("on_front").sort("run")
    # Stage 1's models and the earlier checkpoint score higher, yet only each chain's end competes.
    assert front["run"].to_list() == [
        "chain/sdpo/post/teacher~ema:0.05/lr~1e-3/stage~2",
        "chain/sft/post/lr~1e-3/stage~2",
        "post",
    ]
    assert set(front["method"]) == {"sdpo:ema:0.05", "sft", "post"}


def lineage_workdir(tmp_path: Path) -> tuple[Path, pl.DataFrame, dict]:
    """A workdir with an SFT, a masked graft of it, the Fisher it used, their evaluations and data: the DAG
    and each job's (s, cpu_time, max_rss), two repeats for the SFT."""
    g = "graft/step~1/lr~1/epoch~1/lam~0.5/mask~diag/rho~0.1"
    jobs = {
        "traces": (["results/x/data/sft.parquet", "results/x/data/heldout.parquet"], ["results/world/post"]),
        "sft": (["results/x/sft/step~1/lr~1"], ["results/x/data/sft.parquet", "results/world/ladder"]),
        "rollouts": (["results/x/fisher/post/rollouts.parquet"], ["results/world/post"]),
        "fisher": (["results/x/fisher/post/diag"], ["results/x/fisher/post/rollouts.parquet", "results/world/post"]),
        "graft": (
            [f"results/x/{g}/model", f"results/x/{g}/seconds.json"],
            ["results/x/sft/step~1/lr~1", "results/world/post", "results/x/fisher/post/diag"],
        ),
        "eval_graft": (
            [f"results/x/eval/{g}/metrics.json"],
            [f"results/x/{g}/model", "results/x/data/heldout.parquet"],
        ),
        "eval_sft": (["results/x/eval/sft/step~1/lr~1/epoch~1/metrics.json"], ["results/x/sft/step~1/lr~1"]),
        "posttrain": (["results/world/post"], ["results/world/ladder"]),
    }
    seconds = {name: [(10.0 * (i + 1), 7.0 * (i + 1), 100.0 * (i + 1))] for i, name in enumerate(jobs)}
    seconds["sft"] = [(30.0, 20.0, 250.0), (34.0, 22.0, 260.0)]
    frame = dag(*((out, name, f"logs/x/{name}.log", inp, "ok", False, None) for name, (out, inp) in jobs.items()))
    for name, reps in seconds.items():
        bench(tmp_path, f"logs/x/{name}.log", *reps)
    mean = {name: tuple(np.mean(reps, axis=0)) for name, reps in seconds.items()}
    return tmp_path, frame, {"graft": g, "mean": mean}


def test_a_runs_cost_sums_the_benchmark_files_of_the_jobs_that_made_it(tmp_path):
    workdir, frame, ctx = lineage_workdir(tmp_path)
    costs = run_costs(workdir, "x", [ctx["graft"], "sft/step~1/lr~1/epoch~1"], Lineage(frame))
    got = {r["run"]: r for r in costs.iter_rows(named=True)}
    mean = ctx["mean"]
    # The graft's: its evaluation, the graft, the donor's SFT, the Fisher and its rollouts; never the
    # data (traces) nor the world (posttrain), which every run shares.
    behind = ["eval_graft", "graft", "sft", "fisher", "rollouts"]
    graft = got[ctx["graft"]]
    assert graft["jobs"] == 5 and graft["untimed"] == 0
    assert graft["job_s"] == pytest.approx(sum(mean[j][0] for j in behind))
    assert graft["cpu_s"] == pytest.approx(sum(mean[j][1] for j in behind))
    assert graft["max_rss_mb"] == pytest.approx(max(mean[j][2] for j in behind))
    sft = got["sft/step~1/lr~1/epoch~1"]
    assert sft["jobs"] == 2 and sft["job_s"] == pytest.approx(mean["eval_sft"][0] + 32.0)
    (workdir / "benchmarks/jobs/x/fisher.tsv").unlink()
    again = run_costs(workdir, "x", [ctx["graft"]], Lineage(frame)).row(0, named=True)
    assert again["untimed"] == 1 and again["job_s"] == pytest.approx(graft["job_s"] - mean["fisher"][0])


def test_run_states_follow_snakemakes_plan(tmp_path):
    """ok: there and kept; stale: there and remade, with the changed output upstream; missing: asked for,
    not there; orphan: there, not asked for."""
    root = tmp_path / "results/x"
    for run in ("post", "sft/post/lr~1/epoch~1", "sft/post/lr~9/epoch~1"):
        metrics(root, run)
    params = "Params have changed since last execution"
    eval_sft = "results/x/eval/sft/post/lr~1/epoch~1/metrics.json"
    frame = dag(
        (
            ["results/x/eval/post/metrics.json"],
            "evaluate",
            "logs/x/post.log",
            ["results/world/post"],
            "ok",
            False,
            None,
        ),
        (["results/x/sft/post/lr~1"], "sft", "logs/x/sft.log", ["results/x/data/sft.parquet"], "ok", True, params),
        (["results/x/data/sft.parquet"], "traces", "logs/x/traces.log", [], "ok", False, None),
        ([eval_sft], "evaluate", "logs/x/e1.log", ["results/x/sft/post/lr~1"], "ok", True, f"{PROPAGATED}: x"),
        (["results/x/eval/sft/post/lr~1/epoch~2/metrics.json"], "evaluate", "-", None, "missing", True, "Missing"),
    )
    asked = ["post", "sft/post/lr~1/epoch~1", "sft/post/lr~1/epoch~2"]
    states = run_states(tmp_path, "x", asked, Lineage(frame))
    assert states.rows() == [
        ("post", "ok", []),
        ("sft/post/lr~1/epoch~1", "stale", [f"results/x/sft/post/lr~1: {params}"]),
        ("sft/post/lr~1/epoch~2", "missing", []),
        ("sft/post/lr~9/epoch~1", "orphan", []),
    ]
    shown, _ = points(tmp_path, "x", Lineage(frame), states, every=True)
    assert dict(zip(shown["run"], shown["state"]))["sft/post/lr~9/epoch~1"] == "orphan"


DRY_RUN = """
[Wed Dec  2 05:48:29 2026]
rule opsd:
    input: results/world/post, results/knowledge/data/sft.parquet
    output: results/knowledge/opsd/post/alpha~0.5/lr~1e-4
    log: logs/knowledge/opsd/post/alpha~0.5/lr~1e-4.log
    jobid: 1
    reason: Code has changed since last execution
[Wed Dec  2 05:48:29 2026]
localrule all:
    input: results/knowledge/latency.png
    jobid: 0
    reason: Input files updated by another job: results/knowledge/latency.png
[Wed Dec  2 05:48:29 2026]
rule latency:
    output: results/knowledge/latency.parquet, results/knowledge/latency.png
    reason: Missing output files: results/knowledge/latency.png; Code has changed since last execution
"""


def test_a_dry_runs_reasons_are_read_per_output():
    latency = "Missing output files: results/knowledge/latency.png; Code has changed since last execution"
    assert dry_run_reasons(DRY_RUN) == {
        "results/knowledge/opsd/post/alpha~0.5/lr~1e-4": "Code has changed since last execution",
        "results/knowledge/latency.parquet": latency,
        "results/knowledge/latency.png": latency,
    }


def test_a_benchmark_file_is_read_past_tabs_in_its_params(tmp_path):
    bench(tmp_path, "logs/a.log", (1.0, 2.0, 30.0), (3.0, 4.0, 50.0))
    means = {"s": 2.0, "cpu_time": 3.0, "max_rss": 40.0, "rule": "rule"}
    assert read_benchmark(tmp_path / "benchmarks/jobs/a.tsv") == means
    (tmp_path / "b.tsv").write_text("s\th:m:s\n1\t0:00:01\n")
    with pytest.raises(GraftlabError, match="b.tsv: not a Snakemake benchmark file"):
        read_benchmark(tmp_path / "b.tsv")


@pytest.mark.parametrize(
    "make, args, message",
    [
        (lambda d: None, [], "no such directory"),
        (lambda d: (d / "x").mkdir(parents=True), [], "not a results directory"),
        (lambda d: (d / "x/eval").mkdir(parents=True), ["--exp", "nope", "--configfile", str(SMOKE)], "--exp nope"),
    ],
)
def test_bad_input_is_one_line_naming_it(tmp_path, capsys, make, args, message):
    results = tmp_path / "wd/results"
    make(results)
    assert main(["inspect", str(results), *args]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err and (str(results) in err or "--exp" in message), err


def inspect_json(smoke: Path, *configs: Path) -> dict:
    import subprocess
    import sys

    cmd = [
        sys.executable,
        "-m",
        "graftlab",
        "inspect",
        str(smoke / "results"),
        "--json",
        "--configfile",
        *map(str, configs),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.workflow
def test_inspect_on_the_smoke_run(smoke, tmp_path, capsys):
    """Every experiment of the smoke config, each point a frontier run of its summary with the same
    scores, every cost above zero, nothing stale; then one param of one experiment changed: exactly
    that experiment's runs that used it are stale."""
    expected = set(yaml.safe_load(SMOKE.read_text())["experiments"])
    assert main(["inspect", str(smoke / "results"), "--configfile", str(SMOKE)]) == 0
    text = capsys.readouterr().out
    assert all(f"== {exp}:" in text for exp in expected)
    report = inspect_json(smoke, SMOKE)
    assert {e["exp"] for e in report["experiments"]} == expected
    for exp in report["experiments"]:
        assert exp["counts"]["stale"] == exp["counts"]["missing"] == exp["counts"]["orphan"] == 0, exp["exp"]
        assert exp["points"], exp["exp"]
        scores = {}
        if not exp["continual"]:
            summary = pl.read_parquet(smoke / "results" / exp["exp"] / "summary.parquet")
            scores = {r["run"]: (r["new"], r["old"]) for r in summary.iter_rows(named=True)}
        for p in exp["points"]:
            assert p["on_front"] and p["state"] == "ok" and p["untimed"] == 0, p
            assert p["job_s"] > 0 and p["cpu_s"] > 0 and p["max_rss_mb"] > 0, p
            if scores:
                assert scores[p["run"]] == (p["new"], p["old"]), p
    # A param of knowledge's OPSD that its path does not name: only its run re-runs.
    overlay = tmp_path / "opsd.yaml"
    overlay.write_text(yaml.safe_dump({"experiments": {"knowledge": {"opsd": {"batch_size": 2}}}}))
    changed = inspect_json(smoke, SMOKE, overlay)
    stale = {(e["exp"], s["run"]): s["reasons"] for e in changed["experiments"] for s in e["stale"]}
    assert list(stale) == [("knowledge", "opsd/post/alpha~0.5/lr~1e-4/step~4")]
    (reason,) = stale["knowledge", "opsd/post/alpha~0.5/lr~1e-4/step~4"]
    job = "results/knowledge/opsd/post/alpha~0.5/lr~1e-4"
    assert reason.startswith(f"{job}: Params have changed since last execution") and "'batch_size': 2" in reason


def test_every_rules_benchmark_file_is_its_log_under_benchmarks_jobs():
    """inspect finds a job's benchmark file from the log Snakemake records: the rules must keep naming
    both from one pattern, or a run's cost would silently drop that job."""
    import re

    checked = 0
    for smk in sorted((REPO / "rules").glob("*.smk")):
        for block in re.split(r"\n(?=(?:local)?rule |checkpoint )", smk.read_text()):
            log = re.search(r"\n    log:\n\s+(?:\w+=)?\"([^\"]+)\"", block)
            bench = re.search(r"\n    benchmark:\n\s+\"([^\"]+)\"", block)
            assert bool(log) == bool(bench), f"{smk.name}: {block.splitlines()[0]} has a log or a benchmark alone"
            if log:
                path = benchmark_file(Path("/w"), log.group(1))
                assert path == Path("/w") / bench.group(1), f"{smk.name}: {block.splitlines()[0]}"
                checked += 1
    assert checked > 30
