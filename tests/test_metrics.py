"""pass@k, Acc@n, its bootstrap interval and per-benchmark metrics against independent computations."""

import random
from fractions import Fraction
from math import comb, sqrt

import numpy as np
import polars as pl
import pytest

from graftlab.evaluate.metrics import acc_at_n, acc_interval, benchmark_metrics, pass_at_k


def closed_form(n: int, c: int, k: int) -> float:
    # Exact rational arithmetic, so the reference carries no rounding of its own.
    return float(1 - Fraction(comb(n - c, k), comb(n, k)))


@pytest.mark.parametrize("k", [1, 4, 8, 16])
@pytest.mark.parametrize("c", range(17))
def test_pass_at_k_matches_closed_form(c: int, k: int) -> None:
    assert pass_at_k(16, c, k) == pytest.approx(closed_form(16, c, k), rel=1e-12, abs=1e-15)


def test_pass_at_k_edges() -> None:
    assert pass_at_k(16, 0, 8) == 0.0
    assert pass_at_k(16, 16, 1) == 1.0
    # n - c < k: every k-subset holds a correct sample, so exactly 1.
    assert pass_at_k(16, 9, 8) == 1.0
    assert pass_at_k(16, 8, 8) < 1.0
    assert pass_at_k(1, 1, 1) == 1.0 and pass_at_k(1, 0, 1) == 0.0
    # pass@1 is the fraction correct.
    assert pass_at_k(16, 5, 1) == pytest.approx(5 / 16, rel=1e-15)


def test_pass_at_k_keeps_precision_when_tiny() -> None:
    # One correct of 10,000 at k = 1: 1e-4 to full relative precision.
    assert pass_at_k(10_000, 1, 1) == pytest.approx(1e-4, rel=1e-13)
    assert pass_at_k(1000, 3, 2) == pytest.approx(closed_form(1000, 3, 2), rel=1e-13)


@pytest.mark.parametrize(
    ("n", "c", "k", "message"),
    [
        (4, 2, 5, "k=5 exceeds n=4"),
        (4, 5, 1, "c=5 correct exceeds n=4"),
        (4, -1, 1, "c must be >= 0"),
        (4, 1, -1, "k must be >= 1"),
        (4, 1, 0, "k must be >= 1"),
        (0, 0, 1, "n must be >= 1"),
        (-2, 0, 1, "n must be >= 1"),
        (4.0, 1, 1, "n must be an integer"),
    ],
)
def test_pass_at_k_rejects(n: int, c: int, k: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        pass_at_k(n, c, k)


def test_acc_at_n() -> None:
    assert acc_at_n([8, 4, 0], 8) == pytest.approx(0.5)
    assert acc_at_n([1], 1) == 1.0
    with pytest.raises(ValueError, match="exceed n=4"):
        acc_at_n([5, 1], 4)
    with pytest.raises(ValueError, match="zero problems"):
        acc_at_n([], 4)
    with pytest.raises(ValueError, match="must be >= 0"):
        acc_at_n([-1], 4)


def records(correct: dict[str, list[bool]]) -> pl.DataFrame:
    return pl.DataFrame(
        {
            "problem_id": [p for p, cs in correct.items() for _ in cs],
            "sample": [i for cs in correct.values() for i in range(len(cs))],
            "correct": [c for cs in correct.values() for c in cs],
        }
    )


def test_benchmark_metrics_on_hand_made_frame() -> None:
    # Four problems, n = 4: correct counts 4, 2, 1, 0.
    df = records(
        {
            "a": [True] * 4,
            "b": [True, False, True, False],
            "c": [False, False, False, True],
            "d": [False] * 4,
        }
    )
    got = benchmark_metrics(df.sample(fraction=1.0, shuffle=True, seed=3), ks=(1, 2, 4, 8))
    assert set(got) == {"n", "problems", "acc@n", "acc@n_lo", "acc@n_hi", "pass@1", "pass@2", "pass@4"}
    assert (got["acc@n_lo"], got["acc@n_hi"]) == acc_interval([(4, [4, 2, 1, 0])])
    assert (got["n"], got["problems"]) == (4, 4)
    assert got["acc@n"] == pytest.approx(7 / 16)
    assert got["pass@1"] == pytest.approx(7 / 16)
    # pass@2 per problem: 1, 1 - C(2,2)/C(4,2) = 5/6, 1 - C(3,2)/C(4,2) = 1/2, 0.
    assert got["pass@2"] == pytest.approx((1 + 5 / 6 + 1 / 2 + 0) / 4)
    assert got["pass@4"] == pytest.approx(3 / 4)


def test_benchmark_metrics_greedy_keeps_only_pass_at_1() -> None:
    got = benchmark_metrics(records({"a": [True], "b": [False]}))
    lo, hi = got.pop("acc@n_lo"), got.pop("acc@n_hi")
    assert got == {"n": 1, "problems": 2, "acc@n": 0.5, "pass@1": 0.5}
    # Two problems redrawn: both wrong, one of each, both right, so the 95% interval spans [0, 1].
    assert (lo, hi) == (0.0, 1.0)


def test_benchmark_metrics_rejects_bad_frames() -> None:
    with pytest.raises(ValueError, match="differing sample counts"):
        benchmark_metrics(records({"a": [True, False], "b": [True]}))
    with pytest.raises(ValueError, match="lack column"):
        benchmark_metrics(pl.DataFrame({"problem_id": [1], "ok": [True]}))
    with pytest.raises(ValueError, match="must be Boolean"):
        benchmark_metrics(pl.DataFrame({"problem_id": [1], "correct": [1]}))
    with pytest.raises(ValueError, match="empty benchmark"):
        benchmark_metrics(pl.DataFrame(schema={"problem_id": pl.String, "correct": pl.Boolean}))
    with pytest.raises(ValueError, match="nulls"):
        benchmark_metrics(pl.DataFrame({"problem_id": [1, 1], "correct": [True, None]}))
    with pytest.raises(ValueError, match="k must be >= 1"):
        benchmark_metrics(records({"a": [True]}), ks=(0,))


# Bootstrap intervals of Acc@n.

Z95 = 1.959963984540054


def loop_bootstrap(benchmarks, resamples, level=0.95, seed=1):
    """The textbook bootstrap, one replicate at a time: redraw each benchmark's problems by index, average
    their fractions correct, average the benchmarks; the percentile with numpy's default interpolation."""
    rng = random.Random(seed)
    replicates = []
    for _ in range(resamples):
        accs = []
        for n, counts in benchmarks:
            drawn = [counts[rng.randrange(len(counts))] for _ in counts]
            accs.append(sum(drawn) / (n * len(drawn)))
        replicates.append(sum(accs) / len(accs))
    replicates.sort()

    def percentile(q):
        pos = q * (resamples - 1)
        below = int(pos)
        above = min(below + 1, resamples - 1)
        return replicates[below] + (pos - below) * (replicates[above] - replicates[below])

    tail = (1 - level) / 2
    return percentile(tail), percentile(1 - tail)


def random_counts(rng, problems, n):
    # Problems of differing difficulty, as real benchmarks have: each its own success rate.
    return rng.binomial(n, rng.beta(0.7, 0.7, size=problems)).tolist()


def test_acc_interval_matches_a_plain_loop_bootstrap():
    rng = np.random.default_rng(0)
    sampled, greedy = (8, random_counts(rng, 150, 8)), (1, random_counts(rng, 90, 1))
    for benchmarks in ([sampled], [greedy], [sampled, greedy]):
        lo, hi = acc_interval(benchmarks)
        ref_lo, ref_hi = loop_bootstrap(benchmarks, resamples=4000)
        # Monte Carlo error of either bootstrap is ~0.003 here; resampling samples instead of problems
        # would move the bounds of the sampled benchmark by ~0.03.
        assert lo == pytest.approx(ref_lo, abs=0.01) and hi == pytest.approx(ref_hi, abs=0.01)


def normal_half_width(benchmarks):
    # Standard error of an equal-weight mean of independent benchmark means, each over its problems.
    var = sum(np.var(np.asarray(c) / n) / len(c) for n, c in benchmarks) / len(benchmarks) ** 2
    return Z95 * sqrt(var)


def test_acc_interval_agrees_with_the_normal_approximation_on_a_large_set():
    rng = np.random.default_rng(1)
    big = (16, random_counts(rng, 20_000, 16))
    acc = acc_at_n(big[1], 16)
    lo, hi = acc_interval([big])
    assert lo == pytest.approx(acc - normal_half_width([big]), abs=0.05 * normal_half_width([big]))
    assert hi == pytest.approx(acc + normal_half_width([big]), abs=0.05 * normal_half_width([big]))


def test_the_interval_of_a_mean_is_bootstrapped_whole_not_averaged_from_its_parts():
    rng = np.random.default_rng(2)
    parts = [(8, random_counts(rng, 3000, 8)), (4, random_counts(rng, 2000, 4))]
    lo, hi = acc_interval(parts)
    mean = sum(acc_at_n(c, n) for n, c in parts) / 2
    half = normal_half_width(parts)
    assert lo == pytest.approx(mean - half, abs=0.06 * half) and hi == pytest.approx(mean + half, abs=0.06 * half)
    # Independent errors partly cancel: the mean's interval is narrower than its parts' average width.
    widths = [h - lo_ for lo_, h in (acc_interval([p]) for p in parts)]
    assert hi - lo < 0.8 * sum(widths) / 2


def test_a_problems_samples_stay_together():
    # Half the problems always solved, half never: accuracy 0.5 over 100 problems. Redrawing problems
    # gives a standard error of 0.5 / sqrt(100); redrawing the 800 samples one by one would give
    # 0.5 / sqrt(800), an interval ~2.8 times too narrow.
    split = [8] * 50 + [0] * 50
    lo, hi = acc_interval([(8, split)])
    assert (hi - lo) / 2 == pytest.approx(Z95 * 0.05, rel=0.1)
    # Every problem solved 4 times of 8: the same accuracy, but no problem differs from another, so
    # redrawing problems cannot move it (redrawing samples would give the 0.035 half-width again).
    assert acc_interval([(8, [4] * 100)]) == (0.5, 0.5)


def test_acc_interval_degenerate_sets_have_zero_width():
    assert acc_interval([(16, [16] * 40)]) == (1.0, 1.0)
    assert acc_interval([(16, [16] * 40), (1, [1] * 7)]) == (1.0, 1.0)
    assert acc_interval([(8, [0] * 40)]) == (0.0, 0.0)
    assert acc_interval([(8, [3])]) == (3 / 8, 3 / 8)  # one problem: every replicate redraws it


def test_acc_interval_contains_the_point_estimate():
    rng = np.random.default_rng(3)
    cases = [(8, [8] + [0] * 199), (8, [0] + [8] * 199), (1, [1, 0]), (16, [1] * 30)]
    cases += [(n, random_counts(rng, int(rng.integers(1, 300)), n)) for n in (1, 4, 16) for _ in range(10)]
    for n, counts in cases:
        lo, hi = acc_interval([(n, counts)])
        assert lo <= acc_at_n(counts, n) <= hi


def test_acc_interval_is_reproducible_and_follows_level_and_seed():
    counts = random_counts(np.random.default_rng(4), 200, 8)
    base = acc_interval([(8, counts)])
    assert acc_interval([(8, counts)]) == base
    # The problems' order is no input of the interval: records arrive in group-by order.
    assert acc_interval([(8, counts[::-1])]) == base
    other = acc_interval([(8, counts)], seed=7)
    assert other != base and other == pytest.approx(base, abs=0.01)
    narrow = acc_interval([(8, counts)], level=0.5)
    assert base[0] < narrow[0] < narrow[1] < base[1]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"benchmarks": []}, "zero benchmarks"),
        ({"benchmarks": [(4, [5, 1])]}, "exceed n=4"),
        ({"benchmarks": [(4, [])]}, "zero problems"),
        ({"benchmarks": [(0, [0])]}, "n must be >= 1"),
        ({"benchmarks": [(4, [1])], "level": 1.0}, "level must be a number in"),
        ({"benchmarks": [(4, [1])], "level": 95}, "level must be a number in"),
        ({"benchmarks": [(4, [1])], "level": True}, "level must be a number in"),
        ({"benchmarks": [(4, [1])], "resamples": 0}, "resamples must be >= 1"),
    ],
)
def test_acc_interval_rejects(kwargs, message):
    with pytest.raises(ValueError, match=message):
        acc_interval(**kwargs)
