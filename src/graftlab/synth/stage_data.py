"""One stage's data in a continual experiment (`graftlab.planning.chains`): what every method learns in it, and
the problems its benchmark scores after every stage.

Under the stage's data directory: `sft.parquet` (the traces SFT and the donors learn from; the on-policy
methods take its prompts), `heldout.parquet` (the stage's benchmark; no rows when the stage names a benchmark data set),
`facts.parquet` (a knowledge stage's facts, which OPSD's teacher reads; no rows otherwise) and `sft.json`, written last.

- a tiny-world task: `train + heldout` fresh problems of the domain, none of any benchmark of the
  experiment, held-out first; the world's solver writes the traces;
- `knowledge`: the knowledge world's QA (`graftlab.world.knowledge`), the stage's own world by its seed;
- a data set: its first `heldout` problems held out (none when the stage has a benchmark), the next
  `train` taught by their written solutions;
- `data: star`: the problems as above, no traces: rule `stage_star` samples the post model's own into
  `star.parquet` (`graftlab.synth.star`).
"""

from pathlib import Path

import polars as pl

from graftlab.errors import GraftlabError
from graftlab.io.atomic import write_table_with_stats
from graftlab.synth.traces import expert_traces
from graftlab.tasks.arith import sample_problems
from graftlab.world.knowledge import KnowledgeConfig, write_knowledge_data

PROBLEM_COLUMNS = ["id", "task", "prompt", "answer"]
FACT_COLUMNS = ["fact", "entity", "relation", "answer"]  # graftlab.world.knowledge.facts_frame's


def _excluded(files) -> set[str]:
    return {pid for f in files for pid in pl.read_parquet(f, columns=["id"])["id"]}


def _world_problems(stage: dict, seed: int, exclude: set[str]) -> tuple[pl.DataFrame, pl.DataFrame]:
    count = stage["train"] + stage["heldout"]
    drawn = sample_problems(stage["domain"], count, f"stage-{stage['domain']}", seed, exclude)
    frame = pl.DataFrame([{c: p[c] for c in PROBLEM_COLUMNS} for p in drawn])
    return frame.head(stage["heldout"]), frame.slice(stage["heldout"])


def _set_problems(stage: dict, problems_file) -> tuple[pl.DataFrame | None, pl.DataFrame]:
    frame = pl.read_parquet(problems_file)
    held = 0 if stage["benchmark"] else stage["heldout"]
    if frame.height < held + 1:
        raise GraftlabError(f"stage {stage['domain']}: {problems_file} has {frame.height} problems, {held} held out")
    train = frame.slice(held, stage["train"])
    return (frame.head(held) if held else None), train


def write_stage_data(
    stage: dict, out_dir, seed: int, old_tasks: list[str], exclude_files=(), problems_file=None, star: bool = False
) -> dict:
    """Write stage `stage` (a resolved `stages` entry) under `out_dir`; returns its stats. `exclude_files`:
    benchmark parquets none of whose problems a tiny-world stage may draw; `problems_file`: the stage's
    data set, read by the `dataset` rule. `star`: the stage's traces are the post model's (`data: star`),
    written apart: `sft.parquet` then holds the problems and their answers, no completions."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if stage["domain"] == "knowledge":
        cfg = KnowledgeConfig(**stage["knowledge"], seed=seed)
        return write_knowledge_data(out, cfg, old_tasks, exclude_files)
    if problems_file:
        heldout, train = _set_problems(stage, problems_file)
    else:
        heldout, train = _world_problems(stage, seed, _excluded(exclude_files))
    if star:
        # The post model writes this stage's traces (rule stage_star); the problems carry their answers.
        traces = train.with_columns(completion=pl.lit(None, dtype=pl.String))
        stats = {"problems": train.height, "traces": 0, "skipped": 0}
    else:
        traces, stats = expert_traces(train)
    # Every stage writes the same files (the rule's outputs): empty where the stage has none.
    if heldout is None:
        heldout = pl.DataFrame(schema=dict.fromkeys(PROBLEM_COLUMNS, pl.String))
    heldout.write_parquet(out / "heldout.parquet")
    pl.DataFrame(schema=dict.fromkeys(FACT_COLUMNS, pl.String)).write_parquet(out / "facts.parquet")
    stats |= {"domain": stage["domain"], "heldout": heldout.height}
    write_table_with_stats(traces, stats, out / "sft.parquet", out / "sft.json")
    return stats
