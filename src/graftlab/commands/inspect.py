"""`graftlab inspect RESULTS_DIR`: the table a researcher wants first from a workflow run: per experiment
and method its best frontier points (new, old, with intervals), what each cost, and which runs are
missing or stale against the config (`graftlab.commands.inspect_results` reads all of it; docs/cli.md).

`--json` prints one object:

    workdir, snakemake_args      the workdir inspected and the config arguments Snakemake was given
    experiments: [               one per experiment
      exp, continual, split      its name; whether it is a chain of stages; `test` (a validation share
                                 scored apart, left out of old/new) or `all` (every problem)
      points: [                  each method's frontier points (`--all`: every evaluated model)
        method, run, stage?,     stage: continual experiments only
        new, new_lo, new_hi, old, old_lo, old_hi,
        on_front, exp_front,     on its method's frontier; on the experiment's
        jobs, untimed, job_s, cpu_s, max_rss_mb,
        state]                   ok, stale, missing or orphan (below)
      counts: {state: runs}      over every run on disk or asked for by the config
      stale: [{run, reasons}]    reasons: `status: output` of each changed output upstream
      missing: [run], orphan: [run]]
"""

from __future__ import annotations

import argparse
import json

from graftlab.planning.config_args import add_config_args, snakemake_config_args  # standard library only

STATES = ("ok", "stale", "missing", "orphan")
SHOWN = 6  # runs a text line names; a config change can add hundreds
REASON_CHARS = 160


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register the `inspect` subcommand on the `graftlab` command's subparsers."""
    p = subparsers.add_parser(
        "inspect",
        help="per experiment and method: best frontier points, their cost, missing and stale runs",
        description="Read a workdir's results/: per experiment and method its Pareto frontier points (new- and "
        "old-task Acc@n with 95% intervals), the wall and CPU seconds and peak memory of the jobs that made "
        "each (benchmarks/jobs/), and which runs Snakemake would add or remake under the config "
        "(snakemake --detailed-summary with the workflow's rerun triggers). See docs/cli.md.",
    )
    p.add_argument("results_dir", metavar="RESULTS_DIR", help="a workdir's results/ (the workdir is its parent)")
    p.add_argument("--exp", nargs="+", help="only these experiments (default: every one)")
    p.add_argument("--json", action="store_true", help="machine-readable output (keys: docs/cli.md)")
    p.add_argument("--all", action="store_true", help="every evaluated model, not only the frontier points")
    p.add_argument(
        "--snakefile",
        help="the workflow's Snakefile (default: the workdir's own, else the checkout graftlab is installed from)",
    )
    add_config_args(
        p,
        "the config files the workdir was run with, as given to snakemake (default: the workflow's "
        "config.yaml, as snakemake without --configfile)",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    from graftlab.commands.inspect_results import inspect, workdir_of

    config = snakemake_config_args(args)
    if args.configfile or args.config:
        # Read as `graftlab plan` reads them, so a config Snakemake would refuse is one line naming it, not
        # Snakemake's own output.
        from graftlab.errors import GraftlabError
        from graftlab.planning.config import ConfigError
        from graftlab.planning.plan import load_config

        try:
            load_config(args.configfile, args.config)
        except ConfigError as err:
            raise GraftlabError(str(err)) from None
    report = inspect(args.results_dir, args.exp, config, every=args.all, snakefile=args.snakefile)
    workdir = workdir_of(args.results_dir)
    if args.json:
        print(
            json.dumps(
                {"workdir": str(workdir), "snakemake_args": config, "experiments": [as_json(e) for e in report]},
                indent=1,
            )
        )
        return
    given = " ".join(args.configfile) or "the workflow's config.yaml"
    print(f"graftlab inspect: {workdir} against {given}")
    for exp in report:
        print("\n" + render(exp, args.all))


def as_json(exp: dict) -> dict:
    runs = exp["runs"]
    return {
        "exp": exp["exp"],
        "continual": exp["continual"],
        "split": exp["split"],
        "points": exp["points"].to_dicts(),
        "counts": {s: runs.filter(state=s).height for s in STATES},
        "stale": runs.filter(state="stale").select("run", "reasons").to_dicts(),
        "missing": runs.filter(state="missing")["run"].to_list(),
        "orphan": runs.filter(state="orphan")["run"].to_list(),
    }


def _interval(row: dict, name: str) -> str:
    if row[name] is None:
        return "-"
    if row[f"{name}_lo"] is None:
        return f"{row[name]:.3f}"
    return f"{row[name]:.3f} [{row[f'{name}_lo']:.3f}, {row[f'{name}_hi']:.3f}]"


def _number(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(points) -> str:
    """The points as an aligned text table, numbers right-aligned."""
    head = ["method", "run", "new [95% CI]", "old [95% CI]", "exp front", "jobs", "job s", "cpu s", "peak MB", "state"]
    rows = [
        [
            r["method"],
            r["run"],
            _interval(r, "new"),
            _interval(r, "old"),
            "yes" if r["exp_front"] else "",
            f"{r['jobs']}" + (f" ({r['untimed']} untimed)" if r["untimed"] else "") if r["jobs"] is not None else "-",
            _number(r["job_s"], ".1f"),
            _number(r["cpu_s"], ".1f"),
            _number(r["max_rss_mb"], ".0f"),
            r["state"] or "-",
        ]
        for r in points.iter_rows(named=True)
    ]
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    right = {5, 6, 7, 8}
    lines = [
        "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths))).rstrip()
        for line in [head, *rows]
    ]
    return "\n".join(lines)


def _clip(reason: str) -> str:
    """A reason on one screen line: a params change carries both whole param sets (--json keeps them)."""
    return reason if len(reason) <= REASON_CHARS else reason[: REASON_CHARS - 3] + "..."


def render(exp: dict, every: bool = False) -> str:
    """One experiment: a title saying what the points are, the table, and the runs' states."""
    data = as_json(exp)
    if exp["continual"]:
        what = "frontier candidates: each chain after its last stage; old: the old tasks, new: every stage's domain"
    else:
        what = "test split (validation problems left out)" if exp["split"] == "test" else "all problems"
    shown = "every evaluated model" if every else "each method's frontier points"
    lines = [f"== {exp['exp']}: {shown}, Acc@n with 95% intervals; {what}"]
    lines.append(table(exp["points"]) if exp["points"].height else "(nothing evaluated yet)")
    lines.append("runs: " + ", ".join(f"{n} {s}" for s, n in data["counts"].items()))
    for item in data["stale"][:SHOWN]:
        reasons = item["reasons"]
        more = f"; and {len(reasons) - 3} more" if len(reasons) > 3 else ""
        lines.append(f"  stale {item['run']}: " + "; ".join(map(_clip, reasons[:3])) + more)
    if len(data["stale"]) > SHOWN:
        lines.append(f"  and {len(data['stale']) - SHOWN} more stale (--json lists them all)")
    for state in ("missing", "orphan"):
        runs = data[state]
        if runs:
            note = ", not asked for by the config" if state == "orphan" else ""
            more = f", and {len(runs) - SHOWN} more (--json lists them all)" if len(runs) > SHOWN else ""
            lines.append(f"  {state} ({len(runs)}{note}): " + ", ".join(runs[:SHOWN]) + more)
    return "\n".join(lines)
