"""What a workflow run holds, for `graftlab inspect`: per experiment and method, its best frontier points,
what each run cost, and which runs are missing or stale against a config.

All of it is read from a workdir (the parent of its `results/`), never recomputed:

- the points: `results/{exp}/summary.parquet`, one row per evaluated model; a continual experiment's
  models are its chains' evaluations (`results/{exp}/eval/chain/.../stage~k/metrics.json`), of which
  each chain's model after the last stage is a candidate (every domain learnt). A method's best points
  are its own Pareto frontier of (new, old) (`graftlab.analysis.summary.pareto_front`); `exp_front`
  says whether a point is also on the experiment's frontier, over every candidate but the ingredients
  of grafts, as pareto.png draws it. An experiment scored with a validation share shows its test split
  (`old`, `new`; the validation problems left out), as the summary and the study report it.
- the cost of a run: the `benchmark:` files of the jobs that made its model and scored it, summed
  (wall `s`, `cpu_time`) and maxed (`max_rss`). The jobs are found by walking Snakemake's own record of
  each output's input files (`snakemake --detailed-summary`) up from the run's metrics.json, stopping at
  what every run of a world or experiment shares (the world, fetched models, an experiment's data): its
  training (the whole job, even where it also made other checkpoints, since reaching this point needs
  it all), a graft and the Fisher a masked one used, each stage of a chain, and the evaluation.
- the state of a run: from the same summary, which applies the workflow's rerun triggers (profile
  `rerun-triggers`: mtime, params, input, code) to the config given: `ok`, `stale` (its metrics.json
  exists and would be remade, with Snakemake's dry-run reason for each job upstream that is a cause:
  changed code, params or inputs, a missing output), `missing` (the config asks for it, nothing is
  there), or `orphan` (in results/, not asked for by the config).

Every job's benchmark file is its log's path under benchmarks/jobs/ instead of logs/, `.tsv` for `.log`
(`graftlab.io.joblog.benchmark_of`): the workflow names both from the same pattern in every rule.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
from collections import deque
from pathlib import Path

import polars as pl

from graftlab.errors import GraftlabError
from graftlab.io.joblog import benchmark_of
from graftlab.io.warm import usage_file

# The checkout an editable install runs from (src/graftlab/commands/ -> the repository root).
CHECKOUT_SNAKEFILE = Path(__file__).resolve().parents[3] / "Snakefile"
# Directories under results/ that hold no experiment.
NOT_EXPERIMENTS = {"world", "worlds", "moe", "study"}
SCORES = ("new", "new_lo", "new_hi", "old", "old_lo", "old_hi")
COSTS = {"jobs": pl.Int64, "untimed": pl.Int64, "job_s": pl.Float64, "cpu_s": pl.Float64, "max_rss_mb": pl.Float64}
# Snakemake's reason for a job re-run only because a job upstream is.
PROPAGATED = "Input files updated by another job"


def workdir_of(results: str | Path) -> Path:
    """The workdir of a `results/` directory, refusing anything that is not one."""
    results = Path(results)
    if not results.is_dir():
        raise GraftlabError(f"{results}: no such directory (give a workdir's results/)")
    if not experiments(results):
        raise GraftlabError(f"{results}: not a results directory (no results/<exp>/eval/ in it)")
    return results.resolve().parent


def experiments(results: Path) -> list[str]:
    """The experiments evaluated under `results`, sorted."""
    return sorted(p.name for p in results.iterdir() if p.name not in NOT_EXPERIMENTS and (p / "eval").is_dir())


def is_continual(root: Path) -> bool:
    return (root / "eval" / "chain").is_dir()


def _metrics(root: Path, run: str) -> dict:
    path = root / "eval" / run / "metrics.json"
    try:
        record = json.loads(path.read_text())
        return {c: record.get(c) for c in SCORES}
    except (OSError, ValueError, AttributeError) as err:
        raise GraftlabError(f"{path}: not a readable metrics.json ({err})") from None


def continual_models(root: Path) -> pl.DataFrame:
    """One row per evaluated model of a continual experiment: run, method (the chain's name in its
    tables), stage, step (an earlier kept checkpoint; null for the stage's model), scores, and
    `last_stage` (the chain's model after its last stage, a frontier candidate)."""
    from graftlab.analysis.continual_results import method_names
    from graftlab.planning.chains import parse_eval_key

    evals = root / "eval"
    keys = sorted(str(p.parent.relative_to(evals)) for p in (evals / "chain").rglob("metrics.json"))
    parsed = [parse_eval_key(k) for k in keys]
    chains = list({c.key: c for c, _, _ in parsed}.values())
    names = dict(zip((c.key for c in chains), method_names([{"label": c.label, "chain": c.key} for c in chains])))
    last = max((k for _, k, _ in parsed), default=0)
    rows = [
        {"run": key, "method": names[c.key], "stage": k, "step": s, "last_stage": k == last and s is None}
        | _metrics(root, key)
        for key, (c, k, s) in zip(keys, parsed)
    ]
    if (evals / "post" / "metrics.json").is_file():
        rows.insert(0, {"run": "post", "method": "post", "stage": 0, "step": None, "last_stage": True})
        rows[0] |= _metrics(root, "post")
    schema = {"run": pl.String, "method": pl.String, "stage": pl.Int64, "step": pl.Int64, "last_stage": pl.Boolean}
    return pl.DataFrame(rows, schema=schema | dict.fromkeys(SCORES, pl.Float64))


def _summarize(root: Path) -> pl.DataFrame:
    """The summary of the metrics.json files there are, as the summary job writes it: a run still under
    way has none yet."""
    from graftlab.analysis.summary import summarize

    files = sorted((root / "eval").rglob("metrics.json"))
    if not files:
        return pl.DataFrame(schema={"run": pl.String, "method": pl.String} | dict.fromkeys(SCORES, pl.Float64))
    try:
        return summarize(files, root.name)
    except ValueError as err:
        raise GraftlabError(str(err)) from None


def models(root: Path) -> tuple[pl.DataFrame, str]:
    """The evaluated models of the experiment at `root` (results/{exp}/) and the split they are scored
    on: `test` where a validation share was scored apart, else `all` (every problem)."""
    if is_continual(root):
        return continual_models(root), "all"
    path = root / "summary.parquet"
    try:
        summary = pl.read_parquet(path) if path.is_file() else _summarize(root)
    except (OSError, pl.exceptions.PolarsError) as err:
        raise GraftlabError(f"{path}: not a readable parquet ({err})") from None
    absent = [c for c in ("run", "method", "old", "new") if c not in summary.columns]
    if absent:
        raise GraftlabError(f"{path}: no column(s) {absent}; not an experiment summary")
    split = "test" if "old_val" in summary.columns else "all"
    return summary.with_columns(pl.lit(True).alias("last_stage")), split


def frontier(cands: pl.DataFrame) -> pl.DataFrame:
    """`cands` (models' rows) with `on_front` (on its method's own frontier) and `exp_front` (on the
    experiment's, over every candidate but the ingredients of grafts); only `last_stage` rows compete."""
    from graftlab.analysis.summary import INGREDIENTS, pareto_front

    cands = cands.with_columns(pl.lit(None, pl.Float64).alias(c) for c in SCORES if c not in cands.columns)
    live = cands.filter("last_stage").with_row_index("_row")
    if live.is_empty():
        return cands.with_columns(on_front=pl.lit(False), exp_front=pl.lit(False))
    own = pl.concat([pareto_front(part) for _, part in live.group_by("method", maintain_order=True)])
    overall = pareto_front(live.filter(~pl.col("method").is_in(INGREDIENTS))).select("_row", exp_front="on_front")
    marked = own.join(overall, on="_row", how="left").with_columns(pl.col("exp_front").fill_null(False))
    rest = cands.filter(~pl.col("last_stage")).with_columns(on_front=pl.lit(False), exp_front=pl.lit(False))
    return pl.concat([marked.drop("_row"), rest], how="diagonal_relaxed").sort("run")


def find_snakefile(workdir: Path, given: str | Path | None = None) -> Path:
    """The workflow whose DAG `graftlab inspect` reads: `given` (--snakefile), else the workdir's own (a run
    made in the workflow's checkout), else the checkout this package runs from (an editable install)."""
    if given is not None:
        if not Path(given).is_file():
            raise GraftlabError(f"--snakefile {given}: no such file")
        return Path(given)
    for found in (workdir / "Snakefile", CHECKOUT_SNAKEFILE):
        if found.is_file():
            return found
    raise GraftlabError(
        f"no Snakefile in {workdir} nor beside the installed package: give the workflow checkout's as --snakefile"
    )


def _snakemake(workdir: Path, snakefile: Path, snakemake_args: list[str], *flags: str) -> str:
    """Snakemake's stdout for the workflow in `workdir` under `flags` and the config: no lock taken."""
    cmd = [sys.executable, "-m", "snakemake", "-s", str(snakefile), "--directory", str(workdir)]
    cmd += [*flags, "--nolock", "--cores", "1", *snakemake_args]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=workdir)
    if done.returncode:
        tail = " ".join((done.stdout + done.stderr).split()[-40:])
        raise GraftlabError(f"snakemake {' '.join(flags)} in {workdir} failed: {tail}")
    return done.stdout


def dry_run_reasons(text: str) -> dict[str, str]:
    """Each output of a job a dry-run (`snakemake -n`) would run, with Snakemake's reason for the job."""
    reasons, outputs = {}, []
    for line in text.splitlines():
        key, _, value = line.strip().partition(": ")
        if line.startswith(("rule ", "localrule ")):
            outputs = []
        elif key == "output":
            outputs = value.split(", ")
        elif key == "reason":
            reasons |= dict.fromkeys(outputs, value)
    return reasons


def dag_summary(workdir: Path, snakemake_args: list[str], snakefile: Path) -> pl.DataFrame:
    """Snakemake's `--detailed-summary` of the workflow in `workdir` under `snakemake_args` (the config):
    a row per output of every job of the default target, with its rule, log, the input files its last
    run recorded (a list), its `status`, whether it would be remade (`pending`) and the dry-run's
    `reason` for that (null where it would not). Nothing runs."""
    from concurrent.futures import ThreadPoolExecutor

    # Two processes, each building the DAG: side by side they take the time of one.
    with ThreadPoolExecutor(2) as pool:
        runs = [
            pool.submit(_snakemake, workdir, snakefile, snakemake_args, f) for f in ("--detailed-summary", "--dry-run")
        ]
        text, dry_run = (r.result() for r in runs)
    header = "output_file\t"
    if header not in text:
        raise GraftlabError(f"snakemake --detailed-summary in {workdir} printed no summary")
    frame = pl.read_csv(io.StringIO(text[text.index(header) :]), separator="\t", quote_char=None, infer_schema=False)
    reasons = dry_run_reasons(dry_run)
    return frame.select(
        output=pl.col("output_file"),
        rule="rule",
        log="log-file(s)",
        inputs=pl.when(pl.col("input-file(s)") == "-").then(pl.lit("")).otherwise("input-file(s)").str.split(","),
        status="status",
        pending=pl.col("plan") == "update pending",
        reason=pl.col("output_file").replace_strict(reasons, default=None, return_dtype=pl.String),
    )


def shared(path: str) -> bool:
    """Whether an input is shared by every run of a world or an experiment (the world, a fetched model,
    an experiment's or a stage's data): a run's cost stops there."""
    return path.startswith(("results/world/", "results/worlds/", "resources/")) or "/data/" in path


def _job(row: dict) -> str:
    """A job's name: its log, unique per job; an output never made has none recorded, and is its own."""
    return row["log"] if row["log"] != "-" else row["output"]


class Lineage:
    """The jobs behind each output, from a `dag_summary`: a job is named by its log (unique per job)."""

    def __init__(self, dag: pl.DataFrame):
        rows = dag.iter_rows(named=True)
        self.by_output = {r["output"]: r for r in rows}

    def jobs(self, output: str, stop=shared) -> dict[str, dict]:
        """Every job upstream of `output` (itself included), not walking past inputs `stop` accepts."""
        seen, queue, jobs = {output}, deque([output]), {}
        while queue:
            row = self.by_output.get(queue.popleft())
            if row is None:  # a source file: no job made it
                continue
            jobs.setdefault(_job(row), row)
            for path in row["inputs"] or []:
                if path and path not in seen and not stop(path):
                    seen.add(path)
                    queue.append(path)
        return jobs

    def reasons(self, output: str) -> list[str]:
        """Why `output` would be remade: Snakemake's reason for each job upstream that is itself a cause
        (changed code, params or inputs, missing outputs), not one only re-run after another; `output`'s
        own reason when no upstream job is."""
        jobs = self.jobs(output, stop=lambda _: False)
        causes = set()
        for row in jobs.values():
            parts = (row.get("reason") or "").split("; ")
            where = row["output"]
            causes |= {p if where in p else f"{where}: {p}" for p in parts if p and not p.startswith(PROPAGATED)}
        own = self.by_output[output].get("reason")
        return sorted(causes) or ([own] if own else [])


def read_benchmark(path: Path) -> dict:
    """Wall seconds `s`, `cpu_time` and `max_rss` (MB) of one Snakemake benchmark file, each the mean
    over its rows (one per repeat), and `rule`: its `rule_name` (written with --benchmark-extended) or
    None. The columns after `rule_name` may hold tabs: split no further."""
    header, *rows = path.read_text().splitlines()
    columns = header.split("\t")
    wanted = ("s", "cpu_time", "max_rss")
    if not set(wanted) <= set(columns):
        raise GraftlabError(f"{path}: not a Snakemake benchmark file (no {wanted} columns)")
    named = "rule_name" in columns
    width = max(columns.index(c) for c in wanted + (("rule_name",) if named else ())) + 1
    cells = [row.split("\t", width)[:width] for row in rows if row.strip()]
    if not cells:
        raise GraftlabError(f"{path}: a benchmark file without a row")
    try:
        means = {c: sum(float(r[columns.index(c)]) for r in cells) / len(cells) for c in wanted}
    except (ValueError, IndexError) as err:
        raise GraftlabError(f"{path}: unreadable benchmark row ({err})") from None
    return means | {"rule": cells[0][columns.index("rule_name")] if named else None}


def benchmark_file(workdir: Path, log: str) -> Path | None:
    """A job's benchmark file (`graftlab.io.joblog.benchmark_of`); None for a job without a recorded log."""
    path = benchmark_of(log.split(",")[0])
    return None if path is None else workdir / path


def job_usage(path: Path) -> dict:
    """A job's benchmark, with the CPU seconds and peak RSS of the warm worker that ran it where one did
    (`graftlab.io.warm.usage_file`): Snakemake's own are those of the process that waited for it. The
    worker's file counts only if written while the benchmark's job ran (a colder rerun leaves an older one)."""
    timed = read_benchmark(path)
    usage = usage_file(path)
    if usage.is_file() and path.stat().st_mtime - timed["s"] - 1 <= usage.stat().st_mtime <= path.stat().st_mtime:
        worker = json.loads(usage.read_text())
        timed |= {"cpu_time": worker["cpu_s"], "max_rss": worker["max_rss_mb"]}
    return timed


def cost(workdir: Path, jobs: dict[str, dict]) -> dict:
    """Jobs, those without a benchmark file (`untimed`), summed wall and CPU seconds, peak RSS (MB)."""
    timed = []
    for log in jobs:
        path = benchmark_file(workdir, log)
        if path is not None and path.is_file():
            timed.append(job_usage(path))
    return {
        "jobs": len(jobs),
        "untimed": len(jobs) - len(timed),
        "job_s": sum(t["s"] for t in timed) if timed else None,
        "cpu_s": sum(t["cpu_time"] for t in timed) if timed else None,
        "max_rss_mb": max(t["max_rss"] for t in timed) if timed else None,
    }


def _eval_run(output: str) -> tuple[str, str] | None:
    """(exp, run) of an evaluation's metrics.json path `results/{exp}/eval/{run}/metrics.json`."""
    parts = output.split("/")
    if len(parts) < 5 or parts[0] != "results" or parts[2] != "eval" or parts[-1] != "metrics.json":
        return None
    return parts[1], "/".join(parts[3:-1])


def config_runs(dag: pl.DataFrame) -> dict[str, list[str]]:
    """The runs the config asks for, per experiment: every evaluation in the DAG."""
    runs: dict[str, list[str]] = {}
    for output in dag["output"]:
        found = _eval_run(output)
        if found:
            runs.setdefault(found[0], []).append(found[1])
    return runs


def run_states(workdir: Path, exp: str, dag_runs: list[str], lineage: Lineage) -> pl.DataFrame:
    """Every run of `exp` on disk or asked for: `state` (ok, stale, missing, orphan) and, for a stale
    one, the changed outputs upstream that make Snakemake remake it (`reasons`)."""
    evals = workdir / "results" / exp / "eval"
    on_disk = {str(p.parent.relative_to(evals)) for p in evals.rglob("metrics.json")} if evals.is_dir() else set()
    rows = []
    for run in sorted(on_disk | set(dag_runs)):
        output = f"results/{exp}/eval/{run}/metrics.json"
        row = lineage.by_output.get(output)
        if row is None:
            state, reasons = "orphan", []
        elif run not in on_disk:
            state, reasons = "missing", []
        elif row["pending"]:
            state, reasons = "stale", lineage.reasons(output)
        else:
            state, reasons = "ok", []
        rows.append({"run": run, "state": state, "reasons": reasons})
    schema = {"run": pl.String, "state": pl.String, "reasons": pl.List(pl.String)}
    return pl.DataFrame(rows, schema=schema)


def run_costs(workdir: Path, exp: str, runs: list[str], lineage: Lineage) -> pl.DataFrame:
    """Each run's `COSTS`, from the jobs behind its metrics.json (module docstring)."""
    rows = [
        {"run": run} | cost(workdir, lineage.jobs(f"results/{exp}/eval/{run}/metrics.json", shared)) for run in runs
    ]
    return pl.DataFrame(rows, schema={"run": pl.String} | COSTS)


def points(
    workdir: Path, exp: str, lineage: Lineage, states: pl.DataFrame, every: bool = False
) -> tuple[pl.DataFrame, str]:
    """Each method's frontier points of `exp` (`every`: every evaluated model), best new-task first, with
    their scores, `on_front`/`exp_front`, costs and state; and the split they are scored on."""
    root = workdir / "results" / exp
    if not (root / "eval").is_dir():
        return pl.DataFrame(), "all"
    table, split = models(root)
    table = frontier(table)
    shown = table if every else table.filter("on_front")
    shown = shown.join(run_costs(workdir, exp, shown["run"].to_list(), lineage), on="run", how="left")
    shown = shown.join(states.select("run", "state"), on="run", how="left")
    keep = ["method", "run", *(["stage"] if "stage" in shown.columns else []), *SCORES, "on_front"]
    keep += ["exp_front", *COSTS, "state"]
    return shown.select(keep).sort("method", "new", "old", descending=[False, True, True], nulls_last=True), split


def inspect(
    results: str | Path, exps: list[str] | None = None, snakemake_args=(), every=False, snakefile=None
) -> list[dict]:
    """Per experiment (`exps`, default: every one on disk or in the config): `exp`, `continual`, `split`,
    `points` (frame: `points`) and `runs` (frame: `run_states`). `snakemake_args`: the config as given to
    snakemake (`--configfile ...`, `--config ...`); `snakefile`: the workflow's (`find_snakefile`)."""
    workdir = workdir_of(results)
    dag = dag_summary(workdir, list(snakemake_args), find_snakefile(workdir, snakefile))
    lineage, asked = Lineage(dag), config_runs(dag)
    known = sorted(set(experiments(workdir / "results")) | set(asked))
    unknown = [e for e in exps or [] if e not in known]
    if unknown:
        raise GraftlabError(f"--exp {unknown[0]}: no such experiment in {results} nor in the config (have: {known})")
    report = []
    for exp in exps or known:
        states = run_states(workdir, exp, asked.get(exp, []), lineage)
        shown, split = points(workdir, exp, lineage, states, every)
        continual = is_continual(workdir / "results" / exp)
        report.append({"exp": exp, "continual": continual, "split": split, "points": shown, "runs": states})
    return report
