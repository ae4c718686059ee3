"""Expert traces for the new task, one per training problem (the teacher-trace setting with a perfect
teacher). On the tiny world the teacher is its programmatic solver, which solves each problem from its
prompt alone; its trace is kept only when its answer matches the problem's reference answer. On a real
data set the teacher is the set's written `solution` (mapped by `columns.solution`): the solution is the
thinking, its final boxed answer the reply.

A problem without a usable trace (an empty solution) is skipped, counted in the stats and logged; no
problem at all is an error.
"""

import polars as pl

from graftlab.errors import GraftlabError
from graftlab.io.atomic import write_table_with_stats
from graftlab.tasks import arith, chat_completion, is_correct


def solver_trace(problem: dict) -> str:
    """The tiny world solver's verified trace of a world problem."""
    completion = chat_completion(*arith.solve(problem["task"], problem["prompt"]))
    if not is_correct(completion, problem["answer"]):
        raise GraftlabError(
            f"expert trace for problem {problem['id']} does not verify against its answer {problem['answer']!r}"
        )
    return completion


def solution_trace(problem: dict) -> str | None:
    """A data set's written solution as the thinking, its boxed reference answer as the reply."""
    solution = (problem.get("solution") or "").strip()
    return chat_completion(solution, f"\\boxed{{{problem['answer']}}}") if solution else None


def expert_traces(problems: pl.DataFrame) -> tuple[pl.DataFrame, dict]:
    """(traces, stats) of the training problems: world problems by the solver, others by their solution."""
    if problems.is_empty():
        raise GraftlabError("expert traces: no training problems to write traces for")
    world = set(arith.SOLVERS)
    if not set(problems["task"]) <= world and "solution" not in problems.columns:
        raise GraftlabError(
            "expert traces of a data set need its written solutions: map one with columns.solution "
            "(or choose data: star, teacher or pedagogical)"
        )
    rows, skipped = [], []
    for p in problems.iter_rows(named=True):
        completion = solver_trace(p) if p["task"] in world else solution_trace(p)
        if completion is None:
            skipped.append(p["id"])
            continue
        rows.append({"id": p["id"], "task": p["task"], "prompt": p["prompt"], "completion": completion})
    if not rows:
        raise GraftlabError(f"expert traces: none of {problems.height} problems has a solution to learn from")
    if skipped:
        print(f"expert traces: skipped {len(skipped)} problem(s) with an empty solution, first ids {skipped[:20]}")
    stats = {"problems": problems.height, "traces": len(rows), "skipped": len(skipped), "skipped_ids": skipped[:20]}
    return pl.DataFrame(rows), stats


def write_traces(problems, out, stats_out) -> dict:
    """Expert traces of the problems parquet to `out`, stats JSON to `stats_out` (written first)."""
    traces, stats = expert_traces(pl.read_parquet(problems))
    write_table_with_stats(traces, stats, out, stats_out)
    return stats
