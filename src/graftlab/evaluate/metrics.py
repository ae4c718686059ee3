"""Accuracy metrics over n sampled answers per problem.

pass@k is the unbiased estimator of Chen et al. (2021): with c of n samples correct, the probability
that at least one of k samples drawn without replacement is correct, `1 - C(n-c, k) / C(n, k)`,
computed as the product `1 - prod_{i=n-c+1}^{n} (1 - k/i)`, so no binomial coefficient is formed.

Acc@n carries a percentile bootstrap interval over *problems*: a problem's n samples are drawn from one
model on one prompt and are not independent of each other, so a replicate redraws whole problems
(with replacement), never single samples. The interval of a mean over several benchmarks (the `old`
score) redraws every benchmark's problems independently within each replicate and averages them.
"""

import math
from collections.abc import Iterable, Sequence
from numbers import Integral

import numpy as np
import polars as pl

DEFAULT_KS = (1, 4, 8)
# The interval's settings, recorded beside the scores in metrics.json. A fixed seed makes a re-run
# write the same interval; 2,000 replicates put the percentiles' Monte Carlo error under 0.1 standard
# errors, well under the interval's own width.
INTERVAL = {"method": "percentile bootstrap over problems", "level": 0.95, "resamples": 2000, "seed": 0}


def _check_count(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one problem with `c` of `n` samples correct."""
    n = _check_count("n", n, 1)
    c = _check_count("c", c, 0)
    k = _check_count("k", k, 1)
    if c > n:
        raise ValueError(f"c={c} correct exceeds n={n} samples")
    if k > n:
        raise ValueError(f"k={k} exceeds n={n} samples: pass@k is undefined")
    if n - c < k:
        # Every k-subset holds a correct sample; the product would also hit a zero factor at i = k.
        return 1.0
    if c == 0:
        return 0.0
    # Summing logs and taking expm1 keeps full relative precision when pass@k is tiny (c, k << n),
    # where `1 - prod` would cancel.
    log_miss = math.fsum(math.log1p(-k / i) for i in range(n - c + 1, n + 1))
    return -math.expm1(log_miss)


def acc_at_n(correct_counts: Iterable[int], n: int) -> float:
    """Acc@n: the mean over problems of the fraction of the `n` samples that are correct."""
    n = _check_count("n", n, 1)
    counts = [_check_count("correct count", c, 0) for c in correct_counts]
    if not counts:
        raise ValueError("acc@n of zero problems is undefined")
    too_many = [c for c in counts if c > n]
    if too_many:
        raise ValueError(f"correct counts {sorted(set(too_many))} exceed n={n} samples")
    return sum(counts) / (n * len(counts))


def _check_level(level: object) -> float:
    if isinstance(level, bool) or not isinstance(level, (int, float)) or not 0 < level < 1:
        raise ValueError(f"interval level must be a number in (0, 1), got {level!r}")
    return float(level)


def acc_interval(
    benchmarks: Sequence[tuple[int, Sequence[int]]],
    level: float = INTERVAL["level"],
    resamples: int = INTERVAL["resamples"],
    seed: int = INTERVAL["seed"],
) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean Acc@n over `benchmarks`, each `(n, correct counts)`.

    One benchmark gives the interval of its Acc@n. Several give the interval of their mean (an
    equal-weight mean, as `old` is), each benchmark's problems redrawn independently in every replicate.
    """
    level = _check_level(level)
    resamples = _check_count("resamples", resamples, 1)
    if not benchmarks:
        raise ValueError("acc@n interval of zero benchmarks is undefined")
    rng = np.random.default_rng(seed)
    replicates = np.zeros(resamples)
    for n, counts in benchmarks:
        acc_at_n(counts, n)  # validates n and the counts with the same messages as the point estimate
        values, freq = np.unique(np.asarray(counts, dtype=np.int64), return_counts=True)
        problems = int(freq.sum())
        # A replicate's mean depends only on how often each distinct count is drawn, and drawing
        # `problems` problems with replacement draws those frequencies from a multinomial: the same
        # distribution as redrawing problem indices, in O(resamples x (n + 1)) memory, not x problems.
        drawn = rng.multinomial(problems, freq / problems, size=resamples)
        replicates += drawn @ values / (n * problems)
    replicates /= len(benchmarks)
    tail = (1 - level) / 2
    lo, hi = np.quantile(replicates, [tail, 1 - tail])
    return float(lo), float(hi)


def correct_counts(records: pl.DataFrame) -> tuple[int, list[int]]:
    """Samples per problem (the same n for every problem) and each problem's correct count."""
    missing = {"problem_id", "correct"} - set(records.columns)
    if missing:
        raise ValueError(f"records lack column(s) {sorted(missing)}; have {records.columns}")
    if records.schema["correct"] != pl.Boolean:
        raise ValueError(f"column 'correct' must be Boolean, got {records.schema['correct']}")
    if records.height == 0:
        raise ValueError("no records: cannot score an empty benchmark")
    nulls = records.select(pl.col("problem_id", "correct").null_count()).row(0)
    if any(nulls):
        raise ValueError(f"records hold nulls in problem_id/correct: {nulls[0]}/{nulls[1]}")
    per_problem = records.group_by("problem_id").agg(pl.len().alias("n"), pl.col("correct").sum().alias("c"))
    sample_counts = per_problem["n"].unique().sort().to_list()
    if len(sample_counts) != 1:
        raise ValueError(f"problems have differing sample counts {sample_counts}, expected one n")
    return sample_counts[0], per_problem["c"].to_list()


def benchmark_metrics(records: pl.DataFrame, ks: Sequence[int] = DEFAULT_KS) -> dict[str, int | float]:
    """Metrics of one benchmark from per-sample records (columns `problem_id`, `correct`: bool).

    Returns `n`, `problems`, `acc@n` with its bootstrap interval `acc@n_lo`, `acc@n_hi` (`INTERVAL`),
    and `pass@k` for every k in `ks` with k <= n, each a mean over problems. Larger k are left out rather
    than failing, so one `ks` serves both sampled (n = 16) and greedy (n = 1) benchmarks. Where the records
    count each answer's `tokens`, their mean `response_tokens` (what `graftlab plan` charges an answer).
    """
    for k in ks:
        _check_count("k", k, 1)
    n, counts = correct_counts(records)
    lo, hi = acc_interval([(n, counts)])
    out: dict[str, int | float] = {
        "n": n,
        "problems": len(counts),
        "acc@n": acc_at_n(counts, n),
        "acc@n_lo": lo,
        "acc@n_hi": hi,
    }
    for k in sorted(set(ks)):
        if k <= n:
            out[f"pass@{k}"] = math.fsum(pass_at_k(n, c, k) for c in counts) / len(counts)
    if "tokens" in records.columns:
        out["response_tokens"] = float(records["tokens"].mean())
    return out
