"""pass@k, Acc@n and per-benchmark metrics against independent closed forms."""

from fractions import Fraction
from math import comb

import polars as pl
import pytest

from graftlab.evaluate.metrics import acc_at_n, benchmark_metrics, pass_at_k


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
    assert set(got) == {"n", "problems", "acc@n", "pass@1", "pass@2", "pass@4"}
    assert (got["n"], got["problems"]) == (4, 4)
    assert got["acc@n"] == pytest.approx(7 / 16)
    assert got["pass@1"] == pytest.approx(7 / 16)
    # pass@2 per problem: 1, 1 - C(2,2)/C(4,2) = 5/6, 1 - C(3,2)/C(4,2) = 1/2, 0.
    assert got["pass@2"] == pytest.approx((1 + 5 / 6 + 1 / 2 + 0) / 4)
    assert got["pass@4"] == pytest.approx(3 / 4)


def test_benchmark_metrics_greedy_keeps_only_pass_at_1() -> None:
    got = benchmark_metrics(records({"a": [True], "b": [False]}))
    assert got == {"n": 1, "problems": 2, "acc@n": 0.5, "pass@1": 0.5}


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
