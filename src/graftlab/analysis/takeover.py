"""Implicit task inference, observed in the tiny world: how often a model answers an old-task problem with
the new task's procedure.

The grafting paper (§3) explains forgetting by routing: fine-tuning writes the new task into whatever
machinery the model runs the new inputs through. In the two-expert model (`graftlab.analysis.moe`) a
model that routes a share eps of task-B inputs through expert A moves expert A by eps times its update,
so expert A then answers task-A inputs partly with task B. The tiny world's tasks each think in their
own written procedure (`graftlab.tasks.arith.thinking_form`), so that is directly visible: an addition
problem answered with `*` steps was handled as multiplication.

Per evaluated run and old-task benchmark, over all its sampled completions (validation and test problems
alike: this is a diagnostic, nothing is chosen by it): `takeover_{bench}`, the share whose thinking
follows the new task's procedure, and `own_form_{bench}`, the share that follows the benchmark's own;
`takeover` and `own_form` are their means over the old benchmarks (as `old` is of the accuracies).

And the routing itself, before any fine-tuning: `misrouted`, the share of the run's new-task answers
whose thinking follows an old task's procedure. For the post model and for a donor as it is
(`donor/step~N`) this is the paper's eps_P and eps_D, the share of new inputs a model sends through the
old tasks' machinery; §3 needs eps_D < eps_P for a graft to forget less than SFT.

Beside the procedure, the facts it is carried out with: `facts_{bench}` and `facts_new`, the share of the
single-digit equalities written in the thinking of a benchmark's completions that hold
(`graftlab.tasks.arith.step_facts`), and `facts_old`, their mean over the old benchmarks. A model can
route a task to its own procedure and still fail it because its table facts are wrong ("4*3=10"): the
two are what a graft must carry, and they can be carried apart (docs/fidelity.md, issue 19's study).
"""

from pathlib import Path

import polars as pl

from graftlab.analysis.screen import is_screened_out
from graftlab.errors import GraftlabError
from graftlab.io.atomic import atomic_file
from graftlab.planning.layout import parse_run
from graftlab.tasks import extract_thinking
from graftlab.tasks.arith import NEW_TASKS, OLD_TASKS, THINKING_FORM, step_facts, thinking_form


def _forms(completions: list[str]) -> list[str | None]:
    if not completions:
        raise GraftlabError("takeover: no completions to classify")
    return [thinking_form(t) if (t := extract_thinking(c)) is not None else None for c in completions]


def form_shares(completions: list[str], own: str, new: str) -> tuple[float, float]:
    """(share of completions thinking in form `new`, share thinking in form `own`); a completion
    without thinking counts in neither."""
    forms = _forms(completions)
    return sum(f == new for f in forms) / len(forms), sum(f == own for f in forms) / len(forms)


def misrouted_share(completions: list[str], old: list[str]) -> float:
    """Share of new-task completions thinking in the procedure of one of the `old` tasks."""
    forms = _forms(completions)
    return sum(f in old for f in forms) / len(forms)


def facts_share(completions: list[str]) -> float | None:
    """Share of the equalities written in the completions' thinking that hold (None: none written)."""
    held = written = 0
    for c in completions:
        if (thinking := extract_thinking(c)) is not None:
            h, w = step_facts(thinking)
            held, written = held + h, written + w
    return held / written if written else None


def _check_tasks(old: list[str], new_task: str) -> None:
    unknown = [t for t in old if t not in OLD_TASKS]
    if unknown or not old:
        raise GraftlabError(f"takeover: old benchmarks {unknown or old} are not tiny-world tasks {list(OLD_TASKS)}")
    if new_task not in NEW_TASKS:
        raise GraftlabError(f"takeover: new task {new_task!r} is not a tiny-world task {list(NEW_TASKS)}")


def _completions(eval_dir: str | Path, run: str, bench: str) -> list[str]:
    path = Path(eval_dir) / run / f"{bench}.parquet"
    if not path.is_file():
        raise GraftlabError(f"takeover: run {run!r} has no completions for {bench}: {path} is missing")
    return pl.read_parquet(path, columns=["completion"])["completion"].to_list()


def takeover_table(eval_dir: str | Path, runs: list[str], old: list[str], new_task: str) -> pl.DataFrame:
    """One row per run (its ids parsed from the key, as in the summary) with the shares of the module
    docstring, read from `{eval_dir}/{run}/{bench}.parquet`."""
    _check_tasks(old, new_task)
    new = THINKING_FORM.get(new_task, new_task)
    rows = []
    # An adaptive sweep's screened-out grafts have no records of their own (graftlab.analysis.screen).
    for run in (r for r in runs if not is_screened_out(Path(eval_dir) / r / "metrics.json")):
        row = {"run": run} | parse_run(run)
        for bench in old:
            completions = _completions(eval_dir, run, bench)
            shares = form_shares(completions, bench, new)
            row[f"takeover_{bench}"], row[f"own_form_{bench}"] = shares
            row[f"facts_{bench}"] = facts_share(completions)
        row["takeover"] = sum(row[f"takeover_{b}"] for b in old) / len(old)
        row["own_form"] = sum(row[f"own_form_{b}"] for b in old) / len(old)
        facts = [row[f"facts_{b}"] for b in old if row[f"facts_{b}"] is not None]
        row["facts_old"] = sum(facts) / len(facts) if facts else None
        completions = _completions(eval_dir, run, new_task)
        row["misrouted"] = misrouted_share(completions, old)
        row["facts_new"] = facts_share(completions)
        rows.append(row)
    return pl.DataFrame(rows, infer_schema_length=None)


def write_takeover(eval_dir, runs, old, new_task, out) -> pl.DataFrame:
    table = takeover_table(eval_dir, runs, old, new_task)
    with atomic_file(out) as tmp:
        table.write_parquet(tmp)
    return table
