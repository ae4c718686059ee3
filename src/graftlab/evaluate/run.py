"""Evaluation of one model on its benchmarks, each drawn and graded as its task has it (docs/methods.md).

A benchmark names a task of `graftlab.tasks`, which says how its answers are drawn (knowledge: once,
greedily, after a pre-filled empty think block; every other task: `cfg.n` samples) and graded (exact
match for the tiny world, math-verify for boxed math answers). Every task gives the same per-sample
records, so metrics and readers treat them alike.

Writes one parquet of per-sample records per benchmark and, last, `metrics.json`, so a directory with
`metrics.json` is a finished evaluation. Every Acc@n in it, and `old` and `new`, carries a 95% bootstrap
interval over problems (`*_lo`, `*_hi`; settings under `interval`).

With a validation share v > 0, each benchmark's problems are split once and for all (by a hash of
benchmark and problem id, the same for every model and run) into a validation part, about v of them,
and the rest: `old_val` / `new_val` and each benchmark's `validation` entry score the former, and every
other number the latter only, so choices made on validation scores (which world, which setting) are
reported on problems they never saw.
"""

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import polars as pl

from graftlab.errors import GraftlabError
from graftlab.evaluate.metrics import INTERVAL, acc_interval, benchmark_metrics, correct_counts
from graftlab.io.atomic import atomic_file
from graftlab.io.tables import read_table
from graftlab.sampling import SamplingConfig, load_sampler, sampling_record
from graftlab.tasks import Task, find_task, get_task

ROLES = ("old", "new")
VALIDATION = "_val"  # suffix of a role's scores on the validation problems
RECORD_COLUMNS = ("problem_id", "sample", "completion", "answer", "correct", "tokens")


@dataclass(frozen=True)
class Benchmark:
    name: str
    path: Path  # parquet of problems: id, prompt, answer
    role: str  # "old" (retention) or "new" (the task being learned)
    task: str = "arith"  # registry name: picks the grader and, for knowledge, greedy decoding

    @classmethod
    def all_of(cls, rows) -> list["Benchmark"]:
        """The benchmarks of a job's `benchmarks` param: rows of (name, path, role, task), as
        `graftlab.planning.layout.Experiment.eval_benchmarks` lists them."""
        return [cls(name, Path(path), role, task) for name, path, role, task in rows]

    def __post_init__(self) -> None:
        # Refused here rather than mid-evaluation: a typo would otherwise surface only after the
        # earlier benchmarks had been sampled, or (a bad role) silently drop out of the role means.
        try:
            get_task(self.task)
        except GraftlabError as err:
            raise GraftlabError(f"benchmark {self.name}: {err}") from None
        if self.role not in ROLES:
            raise GraftlabError(f"benchmark {self.name}: role must be one of {list(ROLES)}, got {self.role!r}")


def read_problems(bench: Benchmark) -> pl.DataFrame:
    """The benchmark's problems, refused (naming benchmark and file) when they cannot be graded."""
    problems = read_table(bench.path, ("id", "prompt", "answer"), f"benchmark {bench.name}", text=("prompt",))
    where = f"benchmark {bench.name} ({bench.path})"
    # Problem files written from the registry say their task; grading them as another task is a wiring
    # mistake (e.g. knowledge questions sampled and exact-matched as arithmetic). Tiny-world files name
    # their arithmetic operation ("add"), a name of the arith task; labels no task knows are not compared.
    if "task" in problems.columns:
        named = {task.name for t in problems["task"].unique().to_list() if (task := find_task(t))}
        if named - {bench.task}:
            raise GraftlabError(f"{where} holds {sorted(named)} problems but is graded as task {bench.task!r}")
    return problems


def decoding(task: Task, cfg: SamplingConfig) -> dict:
    """How a benchmark's answers were drawn, recorded beside its scores."""
    drawn = task.decoding(cfg)
    mode = "greedy" if drawn.temperature == 0 else "sampled"
    return {"mode": mode, "n": drawn.n, "temperature": drawn.temperature, "top_p": drawn.top_p}


def role_scores(per_bench: dict[str, dict], counts: dict[str, tuple[int, list[int]]], suffix: str = "") -> dict:
    """`old` and `new` (with `suffix`), each the mean Acc@n over its role's benchmarks, with
    `{role}_lo`, `{role}_hi`; all None for a role without benchmarks. `per_bench[b]["acc@n"]` and
    `counts[b]` are the scores and correct counts of the problems being scored."""
    scores = {}
    for role in ROLES:
        names = [b for b, m in per_bench.items() if m["role"] == role]
        accs = [per_bench[b]["acc@n"] for b in names]
        scores[role + suffix] = sum(accs) / len(accs) if accs else None
        # The interval of the mean is bootstrapped as a whole: averaging the benchmarks' own bounds
        # would ignore that their errors partly cancel, and overstate the width.
        lo, hi = acc_interval([counts[b] for b in names]) if names else (None, None)
        scores[f"{role}{suffix}_lo"], scores[f"{role}{suffix}_hi"] = lo, hi
    return scores


def in_validation(bench: str, problem_ids: list[str], share: float) -> list[bool]:
    """Which problems of `bench` belong to the validation part: a hash of benchmark and id below `share`,
    so the split is the same for every model, run and process (Python's own `hash` is salted)."""
    if not 0 <= share < 1:
        raise GraftlabError(f"validation share must lie in [0, 1), got {share}")

    def unit(pid: str) -> float:
        digest = hashlib.blake2b(f"{bench}\0{pid}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big") / 2**64

    return [unit(str(pid)) < share for pid in problem_ids]


def split_records(bench: Benchmark, records: pl.DataFrame, share: float) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(scored, validation) records of one benchmark; both parts must hold problems."""
    ids = records["problem_id"].unique(maintain_order=True).to_list()
    val_ids = {pid for pid, v in zip(ids, in_validation(bench.name, ids, share)) if v}
    validation = records.filter(pl.col("problem_id").is_in(list(val_ids)))
    scored = records.filter(~pl.col("problem_id").is_in(list(val_ids)))
    if validation.is_empty() or scored.is_empty():
        raise GraftlabError(
            f"benchmark {bench.name}: a validation share of {share} of its {len(ids)} problems leaves "
            f"{len(val_ids)} for validation and {len(ids) - len(val_ids)} to report; both need some"
        )
    return scored, validation


def read_benchmarks(benchmarks: list[Benchmark]) -> dict[str, pl.DataFrame]:
    """Every benchmark's problems by name, each file checked before a model is loaded, so a bad one costs
    no sampling."""
    names = [b.name for b in benchmarks]
    if not names or len(set(names)) != len(names):
        # Records are written under the benchmark's name: a repeated name would overwrite another's.
        raise GraftlabError(f"evaluation needs benchmarks with distinct names, got {names}")
    return {b.name: read_problems(b) for b in benchmarks}


def presample(model_dir, benchmarks: list[Benchmark], cfg: SamplingConfig, sampler) -> None:
    """Draw one part of `model_dir`'s answers to `benchmarks` with `sampler`, one keeping its chunks in a
    store (`load_sampler` of an `Engine` with `resume` and a `part` of several: `graftlab.sample_chunks.Part`),
    exactly the calls `evaluate` makes, so the evaluation that follows reads them back and samples nothing."""
    from graftlab.io.gates import chat_tokenizer

    problems = read_benchmarks(benchmarks)
    tokenizer = chat_tokenizer(model_dir, "model")
    for bench in benchmarks:
        get_task(bench.task).draw(sampler, tokenizer, problems[bench.name], cfg)


def evaluate(
    model_dir,
    benchmarks: list[Benchmark],
    cfg: SamplingConfig,
    out_dir: Path,
    run: str,
    backend="auto",
    sampler=None,
    validation: float = 0.0,
    model_name: str | None = None,
    screening: float = 0.0,
) -> dict:
    """Score `model_dir` on `benchmarks`; `sampler` (a callable `(prompts, cfg) -> completions`) replaces
    loading one from `model_dir` (the tokenizer still comes from `model_dir`). `validation`: the share of
    every benchmark's problems scored apart as the validation split (module docstring). `model_name`: the
    model as metrics.json names it, where `model_dir` is a scratch directory (a graft's) whose random name
    would make two runs' metrics differ; default `model_dir`. `screening`: a share s > 0 of the problems to
    sample and score alone, those the validation split's hash puts below s (an adaptive sweep's first pass,
    `graftlab.analysis.screen`; at most `validation`, so validation problems only): the metrics have their
    scores as `_val` scores, no test scores, and `screening: s`."""
    from graftlab.io.gates import chat_tokenizer

    problems = read_benchmarks(benchmarks)
    if screening:
        if not 0 < screening <= validation:
            raise GraftlabError(f"a screening share must lie in (0, validation {validation}], got {screening}")
        problems = {
            name: frame.filter(pl.Series(in_validation(name, frame["id"].to_list(), screening)))
            for name, frame in problems.items()
        }
    tokenizer = chat_tokenizer(model_dir, "model")  # every prompt is a chat: refused here, not inside transformers
    sampler = sampler or load_sampler(model_dir, backend)
    out_dir.mkdir(parents=True, exist_ok=True)
    # A rerun over a finished evaluation replaces its records one by one: a kill half-way must not leave
    # the old scores marking a directory of mixed records as finished.
    (out_dir / "metrics.json").unlink(missing_ok=True)
    per_bench, counts, val_bench, val_counts = {}, {}, {}, {}
    for bench in benchmarks:
        task = get_task(bench.task)
        records = task.sample_and_grade(sampler, tokenizer, problems[bench.name], cfg)
        with atomic_file(out_dir / f"{bench.name}.parquet") as tmp:
            records.write_parquet(tmp)
        # (scored, validation) records: a screening's are all validation problems.
        held = None
        if screening:
            records, held = None, records
        elif validation > 0:
            records, held = split_records(bench, records, validation)
        per_bench[bench.name] = {"role": bench.role, "task": bench.task, "decoding": decoding(task, cfg)}
        if records is not None:
            counts[bench.name] = correct_counts(records)
            per_bench[bench.name] |= benchmark_metrics(records)
        if held is not None:
            val_counts[bench.name] = correct_counts(held)
            val_bench[bench.name] = {"role": bench.role, **benchmark_metrics(held)}
            per_bench[bench.name]["validation"] = val_bench[bench.name]
    metrics = {"run": run, "model": model_name or str(model_dir), "benchmarks": per_bench}
    metrics |= {} if screening else role_scores(per_bench, counts)
    if validation > 0:
        metrics |= role_scores(val_bench, val_counts, VALIDATION) | {"validation_share": validation}
    if screening:
        metrics["screening"] = screening
    metrics["interval"] = dict(INTERVAL)
    metrics["sampling"] = sampling_record(sampler)
    with atomic_file(out_dir / "metrics.json") as tmp:
        tmp.write_text(json.dumps(metrics, indent=2))
    return metrics


def copy_evaluation(src: Path, dst: Path) -> None:
    """The finished evaluation in `src` written into `dst` too, for another experiment that asks for the same
    one (rules/evaluate.smk): its records, then its metrics.json, last, as `evaluate` writes them."""
    import shutil

    dst.mkdir(parents=True, exist_ok=True)
    (dst / "metrics.json").unlink(missing_ok=True)
    for name in [*(f.name for f in sorted(src.glob("*.parquet"))), "metrics.json"]:
        with atomic_file(dst / name) as tmp:
            shutil.copyfile(src / name, tmp)
