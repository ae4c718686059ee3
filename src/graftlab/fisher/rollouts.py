"""Retention rollouts: the post model's own samples on old-domain prompts, the data of the retention
Fisher (docs/methods.md: `y ~ pi_post(.|x)`, so the Fisher is the true one by Monte Carlo).

The prompts are problems of the tiny world's old tasks, spread evenly over them and disjoint from the
old-task benchmarks, so the Fisher never looks at what evaluation scores. They may coincide with
post-training problems (the space of 2-digit problems is small): retention is about the old domain, and
the post model's training data is part of it. For a real model, whose old domain is not the world's
arithmetic, they come instead from a problems parquet (`graftlab.tasks.sources.write_problems`), drawn
by a seeded shuffle and disjoint from the benchmarks by id and by prompt text. Each rollout is graded by
its problem's task: the registry's grader (`math`: boxed answers), or the world's exact match.

One sample per prompt, kept as the exact token ids the model read and wrote (`prompt_ids`,
`completion_ids`); the readable columns beside them are for people, not for the Fisher.
"""

import time
from dataclasses import dataclass

import polars as pl

from graftlab.errors import GraftlabError
from graftlab.io.atomic import atomic_file, write_table_with_stats
from graftlab.io.tables import read_table
from graftlab.sampling import SamplingConfig
from graftlab.schema import schema_default
from graftlab.streams import stream, stream_seed
from graftlab.tasks import arith, get_task
from graftlab.tasks.sources import normalised

PROBLEM_COLUMNS = ("id", "task", "prompt", "answer")


def _schema() -> dict:
    ids = pl.List(pl.Int64)
    text = {c: pl.String for c in ("problem_id", "task", "prompt", "completion")}
    return text | {"correct": pl.Boolean, "prompt_ids": ids, "completion_ids": ids}


@dataclass(frozen=True)
class RolloutConfig:
    """Defaults are the schema's `fisher` section (`graftlab.schema`)."""

    rollouts: int
    temperature: float = schema_default("fisher", "temperature")
    max_new_tokens: int = schema_default("fisher", "max_new_tokens")
    seed: int = 0

    def sampling(self) -> SamplingConfig:
        return SamplingConfig(1, self.temperature, 1.0, self.max_new_tokens, stream_seed("rollouts", self.seed))


def retention_problems(tasks: list[str], count: int, seed: int, benchmark_files) -> list[dict]:
    """`count` distinct old-task problems, none of them in any of `benchmark_files`."""
    held_out = {pid for f in benchmark_files for pid in pl.read_parquet(f)["id"]}
    problems = []
    for task, k in zip(tasks, arith.per_task_counts(tasks, count)):
        try:
            problems += arith.sample_problems(task, k, "retention", seed, exclude=held_out) if k else []
        except ValueError as err:
            raise GraftlabError(f"retention rollouts: {err}") from None
    return problems


def problems_from_file(prompts_file, count: int, seed: int, benchmark_files) -> list[dict]:
    """`count` problems of the problems parquet `prompts_file` (id, task, prompt, answer), drawn by a
    seeded shuffle, none whose id or prompt text is in any of `benchmark_files`. Too few left is an
    error: a Fisher over fewer rollouts than configured would be silently noisier."""
    frame = read_table(prompts_file, PROBLEM_COLUMNS, "retention prompts", text=("prompt",))
    held_ids, held_prompts = set(), set()
    for f in benchmark_files:
        bench = pl.read_parquet(f)
        held_ids |= {str(i) for i in bench["id"]}
        held_prompts |= {normalised(p) for p in bench["prompt"]} if "prompt" in bench.columns else set()
    rows = [{c: str(r[c]) for c in PROBLEM_COLUMNS} for r in frame.iter_rows(named=True)]
    # Shuffle before excluding: a new benchmark then removes only its own problems from the draw.
    stream("retention", seed).shuffle(rows)
    fresh = [r for r in rows if r["id"] not in held_ids and normalised(r["prompt"]) not in held_prompts]
    if len(fresh) < count:
        raise GraftlabError(
            f"retention rollouts: {count} requested but only {len(fresh)} of the {frame.height} problems in "
            f"{prompts_file} are outside the benchmarks"
        )
    return fresh[:count]


def sample_rollouts(sampler, tokenizer, problems: list[dict], cfg: SamplingConfig):
    """One rollout per problem (a polars frame): its ids, the decoded completion and whether it is
    correct by its task's grader."""
    # Looked up before sampling, so an unknown task fails before any compute is spent.
    tasks = [get_task(p["task"]) for p in problems]
    prompts = [task.chat_prompt(tokenizer, p["prompt"]) for task, p in zip(tasks, problems)]
    samples = sampler.sample_ids(prompts, cfg)
    rows = []
    for problem, task, ((prompt_ids, completion_ids), *_) in zip(problems, tasks, samples, strict=True):
        completion = task.turn(tokenizer.decode(completion_ids, skip_special_tokens=False))
        rows.append(
            {
                "problem_id": problem["id"],
                "task": problem["task"],
                "prompt": problem["prompt"],
                "completion": completion,
                "correct": task.grade(completion, problem["answer"]),
                "prompt_ids": prompt_ids,
                "completion_ids": completion_ids,
            }
        )
    return pl.DataFrame(rows, schema=_schema())


def write_rollouts(
    model_dir,
    benchmark_files,
    tasks: list[str],
    cfg: RolloutConfig,
    out,
    backend="auto",
    prompts_file=None,
    stats_out=None,
):
    """Sample the model at `model_dir` on fresh old-domain prompts and write the rollouts parquet atomically,
    with `stats_out` (JSON: count, sampling seconds, mean length, share correct) when given.

    The prompts are the world's old `tasks` by default; with `prompts_file` (a problems parquet) they are
    drawn from it instead and `tasks` is unused: the file's `task` column says how each is graded."""
    from transformers import AutoTokenizer

    from graftlab.sampling import load_sampler, sampling_record

    if prompts_file is None:
        problems, source = retention_problems(tasks, cfg.rollouts, cfg.seed, benchmark_files), tasks
    else:
        problems = problems_from_file(prompts_file, cfg.rollouts, cfg.seed, benchmark_files)
        source = f"{prompts_file} ({sorted({p['task'] for p in problems})})"
    sampler, tok = load_sampler(model_dir, backend), AutoTokenizer.from_pretrained(model_dir)
    start = time.perf_counter()
    frame = sample_rollouts(sampler, tok, problems, cfg.sampling())
    stats = {
        "rollouts": frame.height,
        "sample_s": time.perf_counter() - start,
        "source": str(source),
        "mean_completion_tokens": frame["completion_ids"].list.len().mean(),
        "correct": frame["correct"].mean(),
        "sampling": sampling_record(sampler),
    }
    print(
        f"{frame.height} rollouts over {source}: mean completion {stats['mean_completion_tokens']:.1f} tokens, "
        f"{stats['correct']:.3f} correct, sampled in {stats['sample_s']:.1f} s"
    )
    if stats_out is not None:
        write_table_with_stats(frame, stats, out, stats_out)
    else:
        with atomic_file(out) as tmp:
            frame.write_parquet(tmp)
    return frame
