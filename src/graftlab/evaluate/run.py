"""Evaluation of one model on its benchmarks, each graded by its own task (DESIGN §3 "Evaluation").

A benchmark names a task of `graftlab.tasks_registry`. Knowledge benchmarks are answered greedily, once,
after a pre-filled empty think block (as knowledge training wrote its examples); every other benchmark is
sampled `cfg.n` times and graded by its task's grader (exact match for the tiny world, math-verify for
boxed math answers). Both give the same per-sample records, so metrics and readers treat them alike.

Writes one parquet of per-sample records per benchmark and, last, `metrics.json`, so a directory with
`metrics.json` is a finished evaluation. Every Acc@n in it, and `old` and `new`, carries a 95% bootstrap
interval over problems (`*_lo`, `*_hi`; settings under `interval`).
"""

import json
from dataclasses import dataclass
from pathlib import Path

import polars as pl

from graftlab.atomic import atomic_file
from graftlab.evaluate.metrics import INTERVAL, acc_interval, benchmark_metrics, correct_counts
from graftlab.models import GraftlabError
from graftlab.sampling import SamplingConfig, load_sampler
from graftlab.tasks import sample_and_grade
from graftlab.tasks_registry import TASKS, get_task

ROLES = ("old", "new")
KNOWLEDGE = "knowledge"  # the registry task scored greedily by the knowledge world
RECORD_COLUMNS = ("problem_id", "sample", "completion", "answer", "correct")


@dataclass(frozen=True)
class Benchmark:
    name: str
    path: Path  # parquet of problems: id, prompt, answer
    role: str  # "old" (retention) or "new" (the task being learned)
    task: str = "arith"  # registry name: picks the grader and, for knowledge, greedy decoding

    def __post_init__(self) -> None:
        # Refused here rather than mid-evaluation: a typo would otherwise surface only after the
        # earlier benchmarks had been sampled, or (a bad role) silently drop out of the role means.
        if self.task not in TASKS:
            raise GraftlabError(f"benchmark {self.name}: unknown task {self.task!r}; known tasks: {sorted(TASKS)}")
        if self.role not in ROLES:
            raise GraftlabError(f"benchmark {self.name}: role must be one of {list(ROLES)}, got {self.role!r}")


def read_problems(bench: Benchmark) -> pl.DataFrame:
    """The benchmark's problems, refused (naming benchmark and file) when they cannot be graded."""
    where = f"benchmark {bench.name} ({bench.path})"
    try:
        problems = pl.read_parquet(bench.path)
    except (OSError, pl.exceptions.PolarsError) as err:
        raise GraftlabError(f"{where}: cannot read problems: {err}") from None
    missing = {"id", "prompt", "answer"} - set(problems.columns)
    if missing:
        raise GraftlabError(f"{where} lacks columns {sorted(missing)}")
    if problems.is_empty():
        raise GraftlabError(f"{where} holds no problems")
    # Problem files written from the registry say their task; grading them as another task is a wiring
    # mistake (e.g. knowledge questions sampled and exact-matched as arithmetic). Tiny-world files name
    # their arithmetic operation instead ("add"), which is no registry task and so is not compared.
    if "task" in problems.columns:
        named = {t for t in problems["task"].unique().to_list() if t in TASKS}
        if named - {bench.task}:
            raise GraftlabError(f"{where} holds {sorted(named)} problems but is graded as task {bench.task!r}")
    return problems


def decoding(bench: Benchmark, cfg: SamplingConfig) -> dict:
    """How the benchmark's answers were drawn, recorded beside its scores."""
    if bench.task == KNOWLEDGE:
        return {"mode": "greedy", "n": 1}
    mode = "greedy" if cfg.temperature == 0 else "sampled"
    return {"mode": mode, "n": cfg.n, "temperature": cfg.temperature, "top_p": cfg.top_p}


def score_benchmark(sampler, tokenizer, bench: Benchmark, problems: pl.DataFrame, cfg: SamplingConfig) -> pl.DataFrame:
    """Per-sample records (`RECORD_COLUMNS`) of one benchmark, graded by its task."""
    if bench.task != KNOWLEDGE:
        return sample_and_grade(sampler, tokenizer, problems, cfg, grade=get_task(bench.task).grade)
    from graftlab.world.knowledge import knowledge_records

    # Knowledge is greedy exact match by definition (DESIGN §3), so the sampling config contributes
    # only its token budget; `answer` holds the parsed prediction, as sample_and_grade's does.
    records = knowledge_records(sampler, tokenizer, problems, cfg.max_new_tokens)
    return records.select(
        pl.col("id").alias("problem_id"),
        pl.lit(0, dtype=pl.Int64).alias("sample"),
        "completion",
        pl.col("predicted").alias("answer"),
        "correct",
    )


def role_scores(per_bench: dict[str, dict], counts: dict[str, tuple[int, list[int]]]) -> dict:
    """`old` and `new`, each the mean Acc@n over its role's benchmarks, with `{role}_lo`, `{role}_hi`;
    all None for a role without benchmarks."""
    scores = {}
    for role in ROLES:
        names = [b for b, m in per_bench.items() if m["role"] == role]
        accs = [per_bench[b]["acc@n"] for b in names]
        scores[role] = sum(accs) / len(accs) if accs else None
        # The interval of the mean is bootstrapped as a whole: averaging the benchmarks' own bounds
        # would ignore that their errors partly cancel, and overstate the width.
        lo, hi = acc_interval([counts[b] for b in names]) if names else (None, None)
        scores[f"{role}_lo"], scores[f"{role}_hi"] = lo, hi
    return scores


def evaluate(
    model_dir, benchmarks: list[Benchmark], cfg: SamplingConfig, out_dir: Path, run: str, backend="auto", sampler=None
) -> dict:
    """Score `model_dir` on `benchmarks`; `sampler` (a callable `(prompts, cfg) -> completions`) replaces
    loading one from `model_dir` (the tokenizer still comes from `model_dir`)."""
    from transformers import AutoTokenizer

    names = [b.name for b in benchmarks]
    if not names or len(set(names)) != len(names):
        # Records are written under the benchmark's name: a repeated name would overwrite another's.
        raise GraftlabError(f"evaluation needs benchmarks with distinct names, got {names}")
    # Every file is checked before the model is loaded, so a bad one costs no sampling.
    problems = {b.name: read_problems(b) for b in benchmarks}
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    sampler = sampler or load_sampler(model_dir, backend)
    out_dir.mkdir(parents=True, exist_ok=True)
    per_bench, counts = {}, {}
    for bench in benchmarks:
        records = score_benchmark(sampler, tokenizer, bench, problems[bench.name], cfg)
        records.write_parquet(out_dir / f"{bench.name}.parquet")
        counts[bench.name] = correct_counts(records)
        per_bench[bench.name] = {
            "role": bench.role, "task": bench.task, "decoding": decoding(bench, cfg), **benchmark_metrics(records)
        }
    metrics = {"run": run, "model": str(model_dir), "benchmarks": per_bench} | role_scores(per_bench, counts)
    metrics["interval"] = dict(INTERVAL)
    with atomic_file(out_dir / "metrics.json") as tmp:
        tmp.write_text(json.dumps(metrics, indent=2))
    return metrics
