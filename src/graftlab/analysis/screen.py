"""Adaptive sweeps: which grafts and merges of an experiment are scored fully (`eval.adaptive`), and with
`eval.adaptive_checkpoints` which checkpoints of its training runs (SFT of the post model, on-policy runs).

Every graft of the sweep is first scored on the validation problems alone (`rules/graft.smk`: `graft_screen`),
as is every screened checkpoint (`rules/evaluate.smk`). A graft or merge is screened out by a graft or merge, a
checkpoint by a checkpoint of its own method (`rivals`): each such group's choice on validation stays scored.
A graft is screened out when another's interval lies wholly beyond its own on both axes: the other's lower
bounds of new- and old-task accuracy at least its upper bounds, and above one of them. An interval that
collapsed at 0 or 1 is widened to the exact binomial bound first (`bounds`). Its mean is then
dominated too, so it cannot be on the sweep's frontier of validation means, whatever the full scores; every
other graft is scored fully. A screened-out graft's `metrics.json` keeps its validation scores, no test
scores, and the evidence (`screened_out`): the run whose interval dominated it, and both intervals; the
summary leaves it out, and `results/{exp}/screened.parquet` lists it.

    python -m graftlab.analysis.screen OUT.json OUT.parquet results/EXP/screen/graft/.../metrics.json ...
"""

import json
import sys
from pathlib import Path

import polars as pl

from graftlab.evaluate.metrics import INTERVAL
from graftlab.io.atomic import atomic_file, write_json
from graftlab.methods import METHODS
from graftlab.planning.layout import parse_run

# The validation scores a screening compares: the four bounds, and the means that pick a frontier.
BOUNDS = ("new_val_lo", "new_val_hi", "old_val_lo", "old_val_hi")


def dominates(a: dict, b: dict) -> bool:
    """Whether `a`'s interval lies wholly beyond `b`'s: lower bounds at least `b`'s upper, one above it."""
    new, old = a["new_val_lo"] - b["new_val_hi"], a["old_val_lo"] - b["old_val_hi"]
    return new >= 0 and old >= 0 and (new > 0 or old > 0)


def rivals(run: str) -> str:
    """The runs a screened run may be screened out by (`screen`'s groups): grafts and merges by each other, one
    choice on validation spanning both (benchmarks/adaptive_bench.py), a training run's checkpoint by its own
    method's, so each method's own best run (SFT of post's, the verdict's yardstick) is still scored fully."""
    method = parse_run(run)["method"]
    return "graft" if METHODS[method].grafts else method


def screen(points: dict[str, dict], groups: dict[str, str] | None = None) -> dict[str, dict]:
    """{run: {"kept": bool, "by": run or None, "interval": its bounds, "by_interval": the other's}} for every
    screened run's validation bounds (`BOUNDS`); `by` is the first dominating run in run order, of the run's
    own group in `groups` (by run; None: one group). Domination is transitive, so a run screened out lies
    wholly below a kept run of its group."""
    for run, p in points.items():
        missing = [k for k in BOUNDS if not isinstance(p.get(k), int | float)]
        if missing:
            raise ValueError(f"screening {run}: no {', '.join(missing)} (a validation share must be set)")
    group = (groups or {}).get
    decisions = {}
    for run in sorted(points):
        rivalled = (o for o in sorted(points) if o != run and group(o) == group(run))
        by = next((other for other in rivalled if dominates(points[other], points[run])), None)
        interval = {k: points[run][k] for k in BOUNDS}
        decisions[run] = {"kept": by is None, "by": by, "interval": interval}
        if by is not None:
            decisions[run]["by_interval"] = {k: points[by][k] for k in BOUNDS}
    return decisions


def is_screened_out(metrics) -> bool:
    """Whether a `metrics.json` is a screened-out graft's: screening scores only, and no records of its own,
    so takeover reads none of it (the summary, which reads each record anyway, leaves it out there). An
    unreadable file is not (its reader names it)."""
    try:
        return "screened_out" in json.loads(Path(metrics).read_text())
    except (OSError, ValueError):
        return False


def screened_out(decisions, run: str) -> dict | None:
    """The decision on `run` in a `decisions.json` where it was screened out; None where it is kept."""
    decided = json.loads(Path(decisions).read_text())
    if run not in decided:
        raise ValueError(f"{decisions}: no decision on {run}")
    return None if decided[run]["kept"] else decided[run]


def write_screened(screen_metrics, out, decision: dict) -> None:
    """A screened-out graft's `metrics.json`: its screening's (validation scores only) with the evidence. Any
    records beside it are an earlier full scoring's, of a sweep that kept it: removed, as a screened-out
    graft has none."""
    record = json.loads(Path(screen_metrics).read_text()) | {"screened_out": decision}
    for stale in Path(out).parent.glob("*.parquet"):
        stale.unlink()
    write_json(out, record)


def screened_table(decisions: dict[str, dict]) -> pl.DataFrame:
    """A row per screened-out run: the run, the run whose interval lay beyond its own, and both intervals."""
    rows = [
        {"run": run, "by": d["by"]} | d["interval"] | {f"by_{k}": v for k, v in d["by_interval"].items()}
        for run, d in decisions.items()
        if not d["kept"]
    ]
    schema = {"run": pl.Utf8, "by": pl.Utf8} | dict.fromkeys([*BOUNDS, *(f"by_{k}" for k in BOUNDS)], pl.Float64)
    return pl.DataFrame(rows, schema=schema)


def bounds(record: dict) -> dict:
    """A screening `metrics.json`'s validation bounds, each role's widened where its bootstrap interval
    collapsed at 0 or 1: every answer wrong (or right) resamples to [0, 0] (or [1, 1]), though a few
    problems say little. There the bound is the exact binomial one of no success (or no failure) in a
    benchmark's problems, `1 - tail^(1/P)` at the interval's tail, averaged over the role's benchmarks:
    a graft that got nothing right on a small screening can still reach the frontier."""
    out = {k: record.get(k) for k in BOUNDS}
    tail = (1 - INTERVAL["level"]) / 2
    for role in ("new", "old"):
        problems = [b["validation"]["problems"] for b in record.get("benchmarks", {}).values() if b["role"] == role]
        if not problems:
            continue
        if out[f"{role}_val_hi"] == 0:
            out[f"{role}_val_hi"] = sum(1 - tail ** (1 / p) for p in problems) / len(problems)
        if out[f"{role}_val_lo"] == 1:
            out[f"{role}_val_lo"] = sum(tail ** (1 / p) for p in problems) / len(problems)
    return out


def read_points(paths) -> dict[str, dict]:
    """The validation bounds (`bounds`) of each screening `metrics.json`, by its run."""
    records = [json.loads(Path(path).read_text()) for path in paths]
    return {record["run"]: bounds(record) for record in records}


def write_decisions(screen_metrics, out_json, out_table) -> dict[str, dict]:
    """Screen the grafts whose screening `metrics.json` files are given: the decisions as JSON, the runs
    screened out as a table (`screened_table`)."""
    points = read_points(screen_metrics)
    decisions = screen(points, {run: rivals(run) for run in points})
    write_json(out_json, decisions)
    with atomic_file(out_table) as tmp:
        screened_table(decisions).write_parquet(tmp)
    kept = sum(d["kept"] for d in decisions.values())
    print(f"screen: {kept} of {len(decisions)} runs kept for full scoring")
    return decisions


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    write_decisions(args[2:], args[0], args[1])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
