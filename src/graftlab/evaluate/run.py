"""Sampling-based evaluation of one model on its benchmarks.

Writes one parquet of per-sample records per benchmark and, last, `metrics.json`, so a directory with
`metrics.json` is a finished evaluation.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import polars as pl

from graftlab.atomic import atomic_file
from graftlab.evaluate.metrics import benchmark_metrics
from graftlab.sampling import SamplingConfig, load_sampler
from graftlab.tasks import sample_and_grade


@dataclass(frozen=True)
class Benchmark:
    name: str
    path: Path  # parquet of problems: id, prompt, answer
    role: str  # "old" (retention) or "new" (the task being learned)


def score_benchmark(sampler, tokenizer, bench: Benchmark, cfg: SamplingConfig) -> pl.DataFrame:
    problems = pl.read_parquet(bench.path)
    missing = {"id", "prompt", "answer"} - set(problems.columns)
    if missing:
        raise ValueError(f"benchmark {bench.name} ({bench.path}) lacks columns {sorted(missing)}")
    return sample_and_grade(sampler, tokenizer, problems, cfg)


def evaluate(model_dir, benchmarks: list[Benchmark], cfg: SamplingConfig, out_dir: Path, run: str, backend="auto"):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    sampler = load_sampler(model_dir, backend)
    out_dir.mkdir(parents=True, exist_ok=True)
    per_bench = {}
    for bench in benchmarks:
        records = score_benchmark(sampler, tokenizer, bench, cfg)
        records.write_parquet(out_dir / f"{bench.name}.parquet")
        per_bench[bench.name] = {"role": bench.role, **benchmark_metrics(records)}
    metrics = {"run": run, "model": str(model_dir), "benchmarks": per_bench}
    for role in ("old", "new"):
        accs = [m["acc@n"] for m in per_bench.values() if m["role"] == role]
        metrics[role] = sum(accs) / len(accs) if accs else None
    with atomic_file(out_dir / "metrics.json") as tmp:
        tmp.write_text(json.dumps(metrics, indent=2))
    return metrics
