"""Retention rollouts: the post model's own samples on old-domain prompts, the data of the retention
Fisher (DESIGN §3: `y ~ pi_post(.|x)`, so the Fisher is the true one by Monte Carlo).

The prompts are problems of the tiny world's old tasks, spread evenly over them and disjoint from the
old-task benchmarks, so the Fisher never looks at what evaluation scores. They may coincide with
post-training problems (the space of 2-digit problems is small): retention is about the old domain, and
the post model's training data is part of it. One sample per prompt, kept
as the exact token ids the model read and wrote (`prompt_ids`, `completion_ids`); the readable columns
beside them are for people, not for the Fisher.
"""

from dataclasses import dataclass

from graftlab.atomic import atomic_file
from graftlab.sampling import SamplingConfig
from graftlab.tasks import chat_prompt, is_correct
from graftlab.world import arith

# polars and graftlab.models (torch) are imported where used: the workflow's config check imports this
# module for `per_task_counts` on every Snakemake start.

# Benchmarks draw their problems with `seed` and post-training with `seed + 1` (world.build): a stream of
# its own keeps the retention prompts from being a prefix of either (overlap by chance remains possible).
SEED_OFFSET = 2


def _schema() -> dict:
    import polars as pl

    ids = pl.List(pl.Int64)
    text = {c: pl.String for c in ("problem_id", "task", "prompt", "completion")}
    return text | {"correct": pl.Boolean, "prompt_ids": ids, "completion_ids": ids}


@dataclass(frozen=True)
class RolloutConfig:
    rollouts: int
    temperature: float = 1.0
    max_new_tokens: int = 48
    seed: int = 0

    def sampling(self) -> SamplingConfig:
        return SamplingConfig(1, self.temperature, 1.0, self.max_new_tokens, self.seed)


def per_task_counts(tasks: list[str], count: int) -> list[int]:
    """`count` split as evenly as possible over `tasks`, the first tasks taking the remainder."""
    return [count // len(tasks) + (i < count % len(tasks)) for i in range(len(tasks))]


def retention_problems(tasks: list[str], count: int, seed: int, benchmark_files) -> list[dict]:
    """`count` distinct old-task problems, none of them in any of `benchmark_files`."""
    import polars as pl

    from graftlab.models import GraftlabError

    held_out = {pid for f in benchmark_files for pid in pl.read_parquet(f)["id"]}
    problems = []
    for task, k in zip(tasks, per_task_counts(tasks, count)):
        try:
            problems += arith.sample_problems(task, k, seed + SEED_OFFSET, exclude=held_out) if k else []
        except ValueError as err:
            raise GraftlabError(f"retention rollouts: {err}") from None
    return problems


def sample_rollouts(sampler, tokenizer, problems: list[dict], cfg: SamplingConfig):
    """One rollout per problem (a polars frame): its ids, the decoded completion and whether it is correct."""
    import polars as pl

    samples = sampler.sample_ids([chat_prompt(tokenizer, p["prompt"]) for p in problems], cfg)
    rows = []
    for problem, ((prompt_ids, completion_ids), *_) in zip(problems, samples, strict=True):
        completion = tokenizer.decode(completion_ids, skip_special_tokens=False)
        rows.append({
            "problem_id": problem["id"],
            "task": problem["task"],
            "prompt": problem["prompt"],
            "completion": completion,
            "correct": is_correct(completion, problem["answer"]),
            "prompt_ids": prompt_ids,
            "completion_ids": completion_ids,
        })  # fmt: skip
    return pl.DataFrame(rows, schema=_schema())


def write_rollouts(model_dir, benchmark_files, tasks: list[str], cfg: RolloutConfig, out, backend="auto"):
    """Sample the model at `model_dir` on fresh old-task prompts and write the rollouts parquet atomically."""
    from transformers import AutoTokenizer

    from graftlab.sampling import load_sampler

    problems = retention_problems(tasks, cfg.rollouts, cfg.seed, benchmark_files)
    frame = sample_rollouts(load_sampler(model_dir, backend), AutoTokenizer.from_pretrained(model_dir), problems, cfg.sampling())
    length = frame["completion_ids"].list.len().mean()
    print(f"{frame.height} rollouts over {tasks}: mean completion {length:.1f} tokens, "
          f"{frame['correct'].mean():.3f} correct")  # fmt: skip
    with atomic_file(out) as tmp:
        frame.write_parquet(tmp)
    return frame
