"""The verdict on hand-built summaries: a graft reproduces the paper when it is on the frontier and beats,
beyond the intervals, every SFT point of no greater new-task accuracy."""

import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from graftlab.analysis.verdict import judge_runs, reproduces
from graftlab.planning.layout import parse_run


def graft(lam: str, mask: str = "none") -> str:
    return f"graft/step~400/lr~1e-3/epoch~2/lam~{lam}/mask~{mask}/rho~{'0' if mask == 'none' else '0.01'}"


def sft(epoch: int) -> str:
    return f"sft/post/lr~1e-3/epoch~{epoch}"


MERGE = "graft/post/lr~1e-3/epoch~2/lam~0.5/mask~none/rho~0"
DONOR_SFT = "sft/step~400/lr~1e-3/epoch~2"
OPSD = "opsd/post/alpha~0.5/lr~1e-4/step~40"


def summary(points: dict[str, tuple[float, float, float | None]]) -> pl.DataFrame:
    """A summary from run: (new, old, half-width of both intervals; None = no intervals)."""
    rows = []
    for run, (new, old, half) in points.items():
        bounds = dict.fromkeys(("old_lo", "old_hi", "new_lo", "new_hi"))
        if half is not None:
            bounds = {"old_lo": old - half, "old_hi": old + half, "new_lo": new - half, "new_hi": new + half}
        rows.append({"run": run} | parse_run(run) | {"new": new, "old": old} | bounds)
    return pl.DataFrame(rows)


# The post model and an SFT run forgetting as it learns, every point +-0.03.
BASE = {"post": (0.0, 0.9, 0.03), sft(1): (0.2, 0.6, 0.03), sft(2): (0.5, 0.4, 0.03), sft(3): (0.8, 0.2, 0.03)}


def test_a_clear_win_reproduces_with_its_margin():
    verdict = reproduces(summary(BASE | {graft("0.5"): (0.5, 0.8, 0.03)}))
    assert verdict["reproduces"] and verdict["qualifying"] == [graft("0.5")]
    (row,) = verdict["frontier_grafts"]
    # Compared with the SFT points of new <= 0.5 (epochs 1 and 2, the tie included); epoch 1 binds.
    assert (row["sft_compared"], row["closest_sft"]) == (2, sft(1))
    assert row["sft_old_hi"] == pytest.approx(0.63) and row["margin"] == pytest.approx(0.77 - 0.63)
    assert row["reproduces"] and (row["run"], row["new"], row["old"]) == (graft("0.5"), 0.5, 0.8)


def test_a_win_within_the_intervals_does_not_reproduce():
    # Above SFT's epoch 1 (0.64 > 0.6) and on the frontier, but 0.61 < 0.63: the intervals overlap.
    verdict = reproduces(summary(BASE | {graft("0.5"): (0.5, 0.64, 0.03)}))
    assert not verdict["reproduces"] and verdict["qualifying"] == []
    (row,) = verdict["frontier_grafts"]
    assert not row["reproduces"] and row["margin"] == pytest.approx(-0.02)
    # Meeting the bound is not beyond it; a tighter interval of the graft (more problems) would carry it.
    assert reproduces(summary(BASE | {graft("0.5"): (0.5, 0.64, 0.01)}))["frontier_grafts"][0][
        "margin"
    ] == pytest.approx(0)
    assert not reproduces(summary(BASE | {graft("0.5"): (0.5, 0.64, 0.01)}))["reproduces"]
    assert reproduces(summary(BASE | {graft("0.5"): (0.5, 0.64, 0.005)}))["qualifying"] == [graft("0.5")]


def test_a_graft_off_the_frontier_does_not_reproduce_however_far_above_sft():
    # The graft beats SFT's epoch 1 by far, but a merge is better on both axes.
    points = BASE | {graft("0.5"): (0.3, 0.75, 0.01), MERGE: (0.35, 0.8, 0.01)}
    verdict = reproduces(summary(points))
    assert verdict == {"reproduces": False, "qualifying": [], "beats": {"opsd": [], "merge": []}, "frontier_grafts": []}
    # Dominated by OPSD likewise; a donor, as it is or after its own SFT, is no candidate and dominates nothing.
    assert reproduces(summary(points | {MERGE: (0.1, 0.5, 0.01), OPSD: (0.3, 0.76, 0.01)}))["frontier_grafts"] == []
    assert reproduces(summary(points | {MERGE: (0.1, 0.5, 0.01), DONOR_SFT: (0.9, 0.9, 0.01)}))["reproduces"]
    assert reproduces(summary(points | {MERGE: (0.1, 0.5, 0.01), "donor/step~400": (0.9, 0.9, 0.01)}))["reproduces"]


def test_a_graft_with_no_sft_point_at_or_below_its_new_accuracy_does_not_reproduce():
    # On the frontier and far above every SFT point in old-task accuracy, but it learned less of the new
    # task than any of them: nothing to compare with, so no verdict in its favour and no margin.
    verdict = reproduces(summary(BASE | {graft("0.25"): (0.1, 0.88, 0.01)}))
    (row,) = verdict["frontier_grafts"]
    assert not verdict["reproduces"]
    assert (row["sft_compared"], row["closest_sft"], row["sft_old_hi"], row["margin"]) == (0, None, None, None)


def test_masked_grafts_count_and_qualifying_runs_come_largest_margin_first():
    points = BASE | {
        graft("0.5"): (0.5, 0.7, 0.03),  # epochs 1 and 2: margin 0.67 - 0.63
        graft("1", "diag"): (0.6, 0.69, 0.01),  # margin 0.68 - 0.63
        graft("0.25"): (0.3, 0.72, 0.03),  # compared with epoch 1 only: margin 0.69 - 0.63
        MERGE: (0.45, 0.69, 0.01),  # dominated by graft 0.5: merges never qualify anyway
    }
    verdict = reproduces(summary(points))
    assert verdict["qualifying"] == [graft("0.25"), graft("1", "diag"), graft("0.5")]
    assert [r["run"] for r in verdict["frontier_grafts"]] == [graft("0.25"), graft("0.5"), graft("1", "diag")]


def test_a_graft_that_learned_nothing_does_not_reproduce_however_much_sft_forgot():
    # SFT forgets before it learns: its first checkpoint sits at the post model's new-task accuracy with
    # the old tasks gone. A graft that learned nothing (here a masked one that kept the post model's
    # scores, so it shares the frontier with it) "beats" it, and so would the post model itself.
    forgetful = {"post": (0.0, 0.99, 0.01), sft(1): (0.0, 0.01, 0.01), sft(2): (0.5, 0.0, 0.01)}
    verdict = reproduces(summary(forgetful | {graft("0.5"): (0.0, 0.99, 0.01)}))
    assert not verdict["reproduces"]
    assert [(r["learned"], r["margin"] > 0) for r in verdict["frontier_grafts"]] == [(False, True)]
    # A graft that learned a little, beyond the post model's interval, does reproduce.
    learned = reproduces(summary(forgetful | {graft("0.5"): (0.05, 0.97, 0.01)}))
    assert learned["reproduces"] and learned["frontier_grafts"][0]["learned"]
    with pytest.raises(ValueError, match="post model's row"):
        reproduces(summary({sft(1): (0.0, 0.01, 0.01), graft("0.5"): (0.05, 0.97, 0.01)}))


def test_missing_intervals_are_refused_not_scored_as_a_loss():
    with pytest.raises(ValueError, match=r"without intervals.*epoch~1"):
        reproduces(summary(BASE | {sft(1): (0.2, 0.6, None), graft("0.5"): (0.5, 0.8, 0.03)}))
    # The post model's and a donor SFT's intervals decide nothing and may be missing.
    ok = summary(BASE | {"post": (0.0, 0.9, None), DONOR_SFT: (0.5, 0.1, None), graft("0.5"): (0.5, 0.8, 0.03)})
    assert reproduces(ok)["reproduces"]
    with pytest.raises(ValueError, match=r"lacks column\(s\) \['old_lo', 'old_hi'\].*re-run the evaluations"):
        reproduces(ok.drop("old_lo", "old_hi"))
    with pytest.raises(ValueError, match=r"unknown method\(s\) \['ppo'\]"):
        reproduces(ok.with_columns(method=pl.when(pl.col("run") == DONOR_SFT).then(pl.lit("ppo")).otherwise("method")))
    with pytest.raises(TypeError, match="polars DataFrame"):
        reproduces({"run": ["post"]})


def test_the_validation_split_is_judged_on_its_own_scores():
    test = summary({"post": (0.0, 0.95, 0.02), sft(1): (0.5, 0.2, 0.02), graft("1"): (0.6, 0.9, 0.02)})
    # On the validation problems the same graft loses: its validation scores replace old and new.
    val = test.with_columns(
        old_val=pl.col("old") * pl.when(pl.col("method") == "graft").then(0.1).otherwise(1.0),
        new_val=pl.col("new"),
    ).with_columns(
        old_val_lo=pl.col("old_val") - 0.02,
        old_val_hi=pl.col("old_val") + 0.02,
        new_val_lo=pl.col("new_val") - 0.02,
        new_val_hi=pl.col("new_val") + 0.02,
    )
    assert reproduces(val)["reproduces"] and not reproduces(val, split="validation")["reproduces"]
    with pytest.raises(ValueError, match="no validation scores"):
        reproduces(test, split="validation")
    with pytest.raises(ValueError, match="split must be"):
        reproduces(test, split="heldout")


def test_a_baseline_is_judged_by_the_grafts_yardstick_off_the_frontier_too():
    # The merge beats SFT's epoch 1 (0.77 > 0.63) but a graft dominates it: off the frontier, still judged.
    points = BASE | {MERGE: (0.5, 0.8, 0.03), graft("1"): (0.6, 0.85, 0.03), OPSD: (0.0, 0.5, 0.03)}
    (merge,) = judge_runs(summary(points), "merge")
    assert merge["learned"] and merge["closest_sft"] == sft(1) and merge["margin"] == pytest.approx(0.77 - 0.63)
    assert merge["run"] not in [g["run"] for g in reproduces(summary(points))["frontier_grafts"]]
    # OPSD learned nothing (0.0 - 0.03 is not above the post model's 0.03): no win, and no SFT point below it.
    (opsd,) = judge_runs(summary(points), "opsd")
    assert not opsd["learned"] and opsd["margin"] is None and not opsd["reproduces"]
    with pytest.raises(ValueError, match="'donor' is not a candidate"):
        judge_runs(summary(points), "donor")
    with pytest.raises(ValueError, match=f"without intervals.*{OPSD}"):
        judge_runs(summary(points | {OPSD: (0.0, 0.5, None)}), "opsd")


def test_each_graft_is_held_to_opsd_and_the_merge_beyond_the_intervals_too():
    """The families table's case: a graft that learns a little (new 0.06 [0.01, 0.11]) and keeps the old tasks
    (0.69 [0.64, 0.74]) against OPSD, which learned nothing and forgot (0.00, old 0.42 [0.37, 0.47]): beyond
    it by 0.64 - 0.47; a merge of no more new-task accuracy whose old-task interval overlaps the graft's is
    not beaten. SFT of post forgets first, so the rule's own verdict is decided apart."""
    points = {
        "post": (0.0, 0.9, 0.005),
        sft(1): (0.3, 0.3, 0.05),
        graft("1"): (0.06, 0.69, 0.05),
        OPSD: (0.0, 0.42, 0.05),
        MERGE: (0.04, 0.72, 0.05),
    }
    verdict = reproduces(summary(points))
    (row,) = [r for r in verdict["frontier_grafts"] if r["run"] == graft("1")]
    assert row["learned"] and row["closest_opsd"] == OPSD and row["margin_opsd"] == pytest.approx(0.64 - 0.47)
    assert row["beats_opsd"] and verdict["beats"]["opsd"] == [graft("1")]
    assert row["closest_merge"] == MERGE and row["margin_merge"] == pytest.approx(0.64 - 0.77)
    assert not row["beats_merge"] and verdict["beats"]["merge"] == []
    assert row["sft_compared"] == 0 and not row["reproduces"]  # no SFT point at or below its new-task score
    # A graft that learned nothing beyond the post model beats no baseline, however far above it lies.
    (row,) = judge_runs(summary(points | {graft("1"): (0.02, 0.69, 0.05)}), "graft")
    assert row["margin_opsd"] > 0 and not row["learned"] and not row["beats_opsd"]


def screened(points: dict[str, tuple[float, float, float]]) -> pl.DataFrame:
    """A screened.parquet from run: (new_val_lo, new_val_hi, old_val_hi), the bounds the verdict reads."""
    rows = [
        {"run": run, "by": "post", "new_val_lo": lo, "new_val_hi": hi, "old_val_lo": 0.0, "old_val_hi": old}
        for run, (lo, hi, old) in points.items()
    ]
    return pl.DataFrame(rows)


def test_a_screened_out_sft_point_binds_at_its_intervals_worst_corner():
    # Without SFT's epoch 1 the graft is held to epoch 2 alone (old_hi 0.43) and reproduces. Screened out with
    # new-task accuracy in [0.1, 0.3] and old-task accuracy up to 0.85, epoch 1 may lie at or below the graft's
    # 0.5 and binds at 0.85: no win. Known to lie beyond it (new >= 0.6), it binds nothing.
    points = BASE | {graft("0.5"): (0.5, 0.8, 0.03)}
    full = summary({run: p for run, p in points.items() if run != sft(1)})
    assert reproduces(full)["reproduces"]
    (row,) = reproduces(full, screened=screened({sft(1): (0.1, 0.3, 0.85)}))["frontier_grafts"]
    assert row["closest_sft"] == sft(1) and row["margin"] == pytest.approx(0.77 - 0.85) and not row["reproduces"]
    (row,) = reproduces(full, screened=screened({sft(1): (0.6, 0.7, 0.85)}))["frontier_grafts"]
    assert row["closest_sft"] == sft(2) and row["reproduces"]
    # Only a point that must lie at or below the graft counts as the SFT point it is compared with.
    alone = summary({run: p for run, p in points.items() if run not in (sft(1), sft(2))})
    (row,) = reproduces(alone, screened=screened({sft(1): (0.1, 0.6, 0.3)}))["frontier_grafts"]
    assert row["sft_compared"] == 0 and row["margin"] is None and not row["reproduces"]
    with pytest.raises(ValueError, match="lacks column.*old_val_hi"):
        reproduces(full, screened=screened({sft(1): (0.1, 0.3, 0.85)}).drop("old_val_hi"))


BASELINE_RUNS = [sft(e) for e in range(1, 5)] + [OPSD, MERGE, "opsd/post/alpha~1/lr~1e-4/step~40"]
unit = st.floats(0, 1, allow_nan=False)


@st.composite
def screened_experiments(draw):
    """A summary of the post model, grafts and baseline points, every score with an interval; some baseline
    points screened out, each with a screening interval holding its scores."""

    def point():
        new, old, half = draw(unit), draw(unit), draw(st.floats(0, 0.2))
        return new, old, half

    baselines = {run: point() for run in draw(st.lists(st.sampled_from(BASELINE_RUNS), unique=True))}
    grafts = {graft(lam): point() for lam in draw(st.lists(st.sampled_from(["0.25", "0.5", "1", "2"]), unique=True))}
    out = {}
    for run, (new, old, half) in baselines.items():
        if draw(st.booleans()):
            lo, hi = draw(st.floats(0, new)), draw(st.floats(new, 1))
            out[run] = (lo, hi, draw(st.floats(old + half, 2)))
    return {"post": point()} | baselines | grafts, out


@settings(max_examples=300, deadline=None)
@given(screened_experiments())
def test_screened_points_never_loosen_the_margins_where_full_scoring_lies_within_their_intervals(case):
    points, out = case
    truth = summary(points)
    kept = summary({run: p for run, p in points.items() if run not in out})
    for method in ("graft", "merge"):
        if method == "merge" and MERGE in out:
            continue  # judged runs are scored ones
        full = {r["run"]: r for r in judge_runs(truth, method)}
        for row in judge_runs(kept, method, screened=screened(out)):
            true = full[row["run"]]
            assert row["sft_compared"] <= true["sft_compared"]
            assert not row["reproduces"] or true["reproduces"]
            for name in ("", "_opsd", "_merge"):
                if row[f"margin{name}"] is not None and true[f"margin{name}"] is not None:
                    assert row[f"margin{name}"] <= true[f"margin{name}"] + 1e-12
            assert not row["beats_opsd"] or true["beats_opsd"]
            assert not row["beats_merge"] or true["beats_merge"]


@settings(max_examples=200, deadline=None)
@given(screened_experiments())
def test_a_screened_row_of_a_run_the_summary_scores_is_stale_and_changes_no_verdict(case):
    # An experiment screened once, then scored fully: its old screened.parquet names runs the summary scores.
    points, out = case
    truth = summary(points)
    stale = screened(out)
    assert reproduces(truth, screened=stale) == reproduces(truth)
    for method in ("graft", "merge"):
        assert judge_runs(truth, method, screened=stale) == judge_runs(truth, method)


@st.composite
def screened_runs(draw):
    """Grafts, merges, SFT and OPSD points, each with a screening interval on both axes and the interval a full
    scoring gives it (its scores +-h) within that, on a grid of hundredths, so edges meet; the post model scored
    fully. `graftlab.analysis.screen` decides which are kept, each against its own group (`rivals`)."""

    def interval(half: int) -> tuple[int, int, int]:
        lo = draw(st.integers(0, 100 - 2 * half))
        hi = draw(st.integers(lo + 2 * half, 100))
        return lo, hi, draw(st.integers(lo + half, hi - half))

    runs = draw(
        st.lists(st.sampled_from([*BASELINE_RUNS, *(graft(lam) for lam in ("0.25", "0.5", "1", "2"))]), unique=True)
    )
    drawn = {run: (half := draw(st.integers(0, 10)), interval(half), interval(half)) for run in runs}
    bounds = {
        run: {"new_val_lo": n[0] / 100, "new_val_hi": n[1] / 100, "old_val_lo": o[0] / 100, "old_val_hi": o[1] / 100}
        for run, (_, n, o) in drawn.items()
    }
    tests = {run: (n[2] / 100, o[2] / 100, h / 100) for run, (h, n, o) in drawn.items()}
    return {"post": (0.0, draw(st.integers(0, 100)) / 100, 0.02)} | tests, bounds


@settings(max_examples=500, deadline=None)
@given(screened_runs())
def test_a_screened_verdict_reproduces_only_where_full_scoring_would(case):
    """Wherever each screened run's full-scoring interval lies within its screening interval, a graft that
    reproduces with the screened-out runs held to as `screened.parquet` gives them reproduces with every run
    scored fully: on the frontier too, since a kept run of its group lies beyond each screened-out one."""
    from graftlab.analysis.screen import rivals, screen, screened_table

    tests, bounds = case
    decisions = screen(bounds, {run: rivals(run) for run in bounds})
    kept = {run: p for run, p in tests.items() if run not in decisions or decisions[run]["kept"]}
    verdict = reproduces(summary(kept), screened=screened_table(decisions))
    truth = reproduces(summary(tests))
    assert set(verdict["qualifying"]) <= set(truth["qualifying"])
    for name in ("opsd", "merge"):
        assert set(verdict["beats"][name]) <= set(truth["beats"][name])
