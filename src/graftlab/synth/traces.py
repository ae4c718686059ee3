"""Training traces for the new task. `expert`: the tiny world's programmatic solver is the teacher; it
solves each problem from its prompt alone, and its trace is kept only when its answer matches the
problem's reference answer (the teacher-trace setting with a perfect teacher)."""

import polars as pl

from graftlab.models import GraftlabError
from graftlab.tasks import chat_completion, is_correct
from graftlab.world import arith


def expert_traces(problems: pl.DataFrame) -> pl.DataFrame:
    rows = []
    for p in problems.iter_rows(named=True):
        completion = chat_completion(*arith.solve(p["task"], p["prompt"]))
        if not is_correct(completion, p["answer"]):
            raise GraftlabError(f"expert trace for problem {p['id']} does not verify against its answer {p['answer']!r}")
        rows.append({"id": p["id"], "task": p["task"], "prompt": p["prompt"], "completion": completion})
    if not rows:
        raise GraftlabError("no training problems to write traces for")
    return pl.DataFrame(rows)


SOURCES = {"expert": expert_traces}


def write_traces(source: str, problems, out) -> None:
    if source not in SOURCES:
        raise GraftlabError(f"unknown trace source {source!r}; known: {sorted(SOURCES)}")
    SOURCES[source](pl.read_parquet(problems)).write_parquet(out)
