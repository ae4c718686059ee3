"""Accuracy metrics over n sampled answers per problem.

pass@k is the unbiased estimator of Chen et al. (2021): with c of n samples correct, the probability
that at least one of k samples drawn without replacement is correct, `1 - C(n-c, k) / C(n, k)`,
computed as the product `1 - prod_{i=n-c+1}^{n} (1 - k/i)`, so no binomial coefficient is formed.
"""

import math
from collections.abc import Iterable, Sequence
from numbers import Integral

import polars as pl

DEFAULT_KS = (1, 4, 8)


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


def _correct_counts(records: pl.DataFrame) -> tuple[int, list[int]]:
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
    per_problem = records.group_by("problem_id").agg(
        pl.len().alias("n"), pl.col("correct").sum().alias("c")
    )
    sample_counts = per_problem["n"].unique().sort().to_list()
    if len(sample_counts) != 1:
        raise ValueError(f"problems have differing sample counts {sample_counts}, expected one n")
    return sample_counts[0], per_problem["c"].to_list()


def benchmark_metrics(
    records: pl.DataFrame, ks: Sequence[int] = DEFAULT_KS
) -> dict[str, int | float]:
    """Metrics of one benchmark from per-sample records (columns `problem_id`, `correct`: bool).

    Returns `n`, `problems`, `acc@n` and `pass@k` for every k in `ks` with k <= n, each a mean over
    problems. Larger k are left out rather than failing, so one `ks` serves both sampled (n = 16)
    and greedy (n = 1) benchmarks.
    """
    for k in ks:
        _check_count("k", k, 1)
    n, counts = _correct_counts(records)
    out: dict[str, int | float] = {"n": n, "problems": len(counts), "acc@n": acc_at_n(counts, n)}
    for k in sorted(set(ks)):
        if k <= n:
            out[f"pass@{k}"] = math.fsum(pass_at_k(n, c, k) for c in counts) / len(counts)
    return out
