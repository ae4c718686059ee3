"""Run parsing, the summary table, the Pareto frontier and its figure."""

import json
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from graftlab.analysis.pareto import plot_pareto
from graftlab.analysis.summary import pareto_front, summarize, write_summary
from graftlab.planning.layout import parse_run

GRAFT = "graft/step~400/lr~1e-3/epoch~2/lam~0.5/mask~none/rho~0"
MERGE = "graft/post/lr~1e-3/epoch~2/lam~0.5/mask~diag/rho~0.01"


def write_metrics(root: Path, run: str, old: float, new: float, ks=(1, 4, 8), half: float | None = None) -> Path:
    """A metrics.json; `half` adds intervals of that half-width (None: one written before intervals)."""

    def interval(prefix: str, acc: float) -> dict:
        return {} if half is None else {f"{prefix}_lo": acc - half, f"{prefix}_hi": acc + half}

    def bench(role: str, acc: float) -> dict:
        return (
            {"role": role, "n": 8, "problems": 10, "acc@n": acc}
            | interval("acc@n", acc)
            | {f"pass@{k}": min(1.0, acc + 0.01 * k) for k in ks}
        )

    record = (
        {
            "run": run,
            "benchmarks": {
                "add": bench("old", old),
                "sub": bench("old", old),
                "mul": bench("new", new),
            },
            "old": old,
            "new": new,
        }
        | interval("old", old)
        | interval("new", new)
    )
    path = root / "eval" / run / "metrics.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(record))
    return path


@pytest.fixture
def metrics_files(tmp_path: Path) -> list[Path]:
    return [
        write_metrics(tmp_path, GRAFT, 0.90, 0.30),
        write_metrics(tmp_path, "post", 0.95, 0.0),
        write_metrics(tmp_path, MERGE, 0.60, 0.50),
        write_metrics(tmp_path, "sft/post/lr~1e-3/epoch~2", 0.10, 0.90),
        write_metrics(tmp_path, "sft/step~400/lr~1e-3/epoch~1", 0.05, 0.95, ks=(1,)),
    ]


def test_summarize(metrics_files: list[Path], tmp_path: Path) -> None:
    df = summarize(metrics_files, "demo")
    assert df.height == 5
    assert df.columns[:11] == [
        "exp",
        "run",
        "method",
        "donor",
        "lr",
        "epoch",
        "lam",
        "mask",
        "rho",
        "old",
        "new",
    ]
    assert {"add_acc", "sub_pass@4", "mul_pass@8"} <= set(df.columns)
    assert df["run"].to_list() == sorted(df["run"].to_list())
    assert df.schema["lr"] == pl.String and df.schema["mul_acc"] == pl.Float64
    by_run = {r["run"]: r for r in df.iter_rows(named=True)}
    assert by_run[MERGE]["method"] == "merge" and by_run[MERGE]["mask"] == "diag"
    assert by_run["post"]["lr"] is None and by_run["post"]["exp"] == "demo"
    assert by_run[GRAFT]["mul_acc"] == pytest.approx(0.30)
    # The donor SFT was scored at k = 1 only: its larger-k columns are null, not missing.
    assert by_run["sft/step~400/lr~1e-3/epoch~1"]["mul_pass@4"] is None

    # These metrics.json files predate bootstrap intervals: their interval columns exist, all null.
    bounds = ["old_lo", "old_hi", "new_lo", "new_hi", "add_acc_lo", "add_acc_hi", "mul_acc_lo", "mul_acc_hi"]
    assert set(bounds) <= set(df.columns) and df.select(bounds).null_count().row(0) == (5,) * 8

    out = tmp_path / "out" / "summary.parquet"
    written = write_summary(metrics_files, "demo", out)
    assert pl.read_parquet(out).equals(written)
    assert [p.name for p in out.parent.iterdir()] == ["summary.parquet"]


def test_summary_carries_intervals_and_nulls_where_a_run_has_none(tmp_path: Path) -> None:
    sft_run = "sft/post/lr~1e-3/epoch~2"
    files = [
        write_metrics(tmp_path, GRAFT, 0.90, 0.30, half=0.05),
        write_metrics(tmp_path, sft_run, 0.10, 0.90),  # evaluated before intervals
    ]
    df = summarize(files, "demo")
    assert df.columns[9:15] == ["old", "new", "old_lo", "old_hi", "new_lo", "new_hi"]
    graft, sft = (df.filter(pl.col("run") == r).row(0, named=True) for r in (GRAFT, sft_run))
    assert (graft["old_lo"], graft["old_hi"], graft["new_lo"], graft["new_hi"]) == pytest.approx(
        (0.85, 0.95, 0.25, 0.35)
    )
    assert (graft["add_acc_lo"], graft["mul_acc_hi"]) == pytest.approx((0.85, 0.35))
    assert all(sft[c] is None for c in ("old_lo", "old_hi", "new_lo", "new_hi", "add_acc_lo", "mul_acc_hi"))
    assert df.schema["old_lo"] == pl.Float64 and df.schema["mul_acc_lo"] == pl.Float64
    # A path key named like an interval column would overwrite it.
    with pytest.raises(ValueError, match="key 'old_lo' clashes"):
        parse_run("sft/post/lr~1e-3/epoch~1/old_lo~x")


def test_summary_carries_validation_scores_only_where_evaluated_with_a_share(tmp_path: Path) -> None:
    plain = summarize([write_metrics(tmp_path, "post", 0.9, 0.1, half=0.05)], "demo")
    assert "old_val" not in plain.columns
    path = write_metrics(tmp_path, GRAFT, 0.8, 0.3, half=0.05)
    record = json.loads(path.read_text())
    record |= {
        "old_val": 0.7,
        "old_val_lo": 0.6,
        "old_val_hi": 0.8,
        "new_val": 0.2,
        "new_val_lo": 0.1,
        "new_val_hi": 0.3,
    }
    path.write_text(json.dumps(record))
    row = summarize([path], "demo").row(0, named=True)
    assert (row["old"], row["old_val"], row["new_val_hi"]) == (0.8, 0.7, 0.3)
    with pytest.raises(ValueError, match="key 'new_val' clashes"):
        parse_run("sft/post/lr~1e-3/epoch~1/new_val~x")


def test_summarize_rejects(metrics_files: list[Path], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="evaluated twice"):
        summarize(metrics_files + metrics_files[:1], "demo")
    with pytest.raises(ValueError, match="no metrics files"):
        summarize([], "demo")
    broken = tmp_path / "broken.json"
    broken.write_text('{"benchmarks": {}}')
    with pytest.raises(ValueError, match="not a readable metrics.json"):
        summarize([broken], "demo")


def front_of(points: list[tuple[float | None, float | None]]) -> list[bool]:
    df = pl.DataFrame({"new": [p[0] for p in points], "old": [p[1] for p in points]})
    return pareto_front(df)["on_front"].to_list()


def test_pareto_front_simple() -> None:
    points = [(0.0, 1.0), (0.5, 0.5), (0.4, 0.4), (1.0, 0.0), (0.2, 0.9), (0.1, 0.8)]
    assert front_of(points) == [True, True, False, True, True, False]


def test_pareto_front_ties_and_duplicates() -> None:
    # Exact duplicates dominate neither each other: both stay on the front.
    assert front_of([(0.5, 0.5), (0.5, 0.5), (0.2, 0.2)]) == [True, True, False]
    # Equal x, lower y is dominated; equal y, lower x is dominated.
    assert front_of([(0.5, 0.5), (0.5, 0.4)]) == [True, False]
    assert front_of([(0.5, 0.5), (0.3, 0.5)]) == [True, False]
    # A duplicate of a dominated point stays dominated.
    assert front_of([(0.6, 0.6), (0.5, 0.5), (0.5, 0.5)]) == [True, False, False]


def test_pareto_front_missing_values_and_columns() -> None:
    assert front_of([(None, 1.0), (0.5, 0.5), (float("nan"), 2.0)]) == [False, True, False]
    assert front_of([]) == []
    with pytest.raises(ValueError, match="no column"):
        pareto_front(pl.DataFrame({"new": [1.0]}))


def test_pareto_front_keeps_columns() -> None:
    df = pl.DataFrame({"run": ["a", "b"], "x": [1, 2], "y": [2, 1]})
    out = pareto_front(df, x="x", y="y")
    assert out.columns == ["run", "x", "y", "on_front"]
    assert out["on_front"].to_list() == [True, True]


def test_plot_pareto_writes_readable_png(metrics_files: list[Path], tmp_path: Path) -> None:
    from matplotlib.image import imread

    summary = tmp_path / "summary.parquet"
    write_summary(metrics_files, "demo", summary)
    for source, name in [(summary, "from_path.png"), (pl.read_parquet(summary), "from_df.png")]:
        out = tmp_path / "fig" / name
        plot_pareto(source, out, title="demo")
        assert out.stat().st_size > 0
        image = imread(out)
        assert image.ndim == 3 and image.shape[0] > 300 and image.shape[1] > 300


def test_plot_pareto_rejects_empty_and_unknown(tmp_path: Path) -> None:
    df = pl.DataFrame({"method": ["post"], "new": [None], "old": [0.9]}, schema_overrides={"new": pl.Float64})
    with pytest.raises(ValueError, match="no run with both"):
        plot_pareto(df, tmp_path / "x.png")
    with pytest.raises(ValueError, match=r"unknown method\(s\) \['ppo'\]"):
        plot_pareto(pl.DataFrame({"method": ["ppo"], "new": [0.1], "old": [0.2]}), tmp_path / "y.png")


def test_an_opsd_run_is_its_own_method_with_alpha_and_step() -> None:
    row = parse_run("opsd/post/alpha~0.5/lr~1e-4/step~40")
    assert (row["method"], row["donor"], row["alpha"], row["lr"], row["step"]) == ("opsd", "post", "0.5", "1e-4", "40")
    with pytest.raises(ValueError, match="opsd trains the post model"):
        parse_run("opsd/step~100/alpha~0.5/lr~1e-4/step~40")
    with pytest.raises(ValueError, match=r"lacks key\(s\) \['step'\]"):
        parse_run("opsd/post/alpha~0.5/lr~1e-4")


def test_pareto_front_matches_brute_force() -> None:
    # A coarse grid forces many ties and duplicates.
    rng = np.random.default_rng(0)
    for _ in range(50):
        pts = rng.integers(0, 5, size=(int(rng.integers(1, 30)), 2)) / 4
        ge = (pts[None, :, :] >= pts[:, None, :]).all(-1)
        gt = (pts[None, :, :] > pts[:, None, :]).any(-1)
        expected = ~(ge & gt).any(1)
        assert front_of([tuple(p) for p in pts.tolist()]) == expected.tolist()


def test_pareto_figure_draws_masked_runs_hollow_with_a_marker_per_kind() -> None:
    from graftlab.analysis.pareto import pareto_figure

    scores = {
        "post": (0.0, 0.9),
        GRAFT: (0.2, 0.5),
        GRAFT.replace("mask~none/rho~0", "mask~diag/rho~0.01"): (0.15, 0.6),
        GRAFT.replace("mask~none/rho~0", "mask~kfac/rho~0.01"): (0.1, 0.7),
        MERGE: (0.3, 0.2),  # a diag-masked merge
        MERGE.replace("mask~diag", "mask~eigen"): (0.05, 0.3),  # a kind the plot has no marker for yet
    }
    df = pl.DataFrame([{"run": r} | parse_run(r) | {"new": n, "old": o} for r, (n, o) in scores.items()])
    series = {c.get_label(): c for c in pareto_figure(df).axes[0].collections}
    masked = ["graft + diag mask", "graft + kfac mask", "merge + diag mask", "merge + eigen mask"]
    assert set(masked) | {"graft", "post (reference)"} == set(series)
    assert all(len(series[name].get_facecolor()) == 0 for name in masked)  # hollow
    assert len(series["graft"].get_facecolor()) == 1
    shapes = [series[name].get_paths()[0].vertices.tolist() for name in masked]
    assert shapes[0] == shapes[2] and shapes[0] != shapes[1] and shapes[3] not in shapes[:2]
    # Colour is the method: a masked graft keeps the graft's colour.
    assert (series["graft + diag mask"].get_edgecolor()[0][:3] == series["graft"].get_facecolor()[0][:3]).all()


def test_pareto_figure_draws_both_intervals_of_every_point_that_has_them() -> None:
    from matplotlib.colors import to_rgba

    from graftlab.analysis.pareto import ERRORBAR, STYLES, pareto_figure

    masked = GRAFT.replace("mask~none/rho~0", "mask~diag/rho~0.01")
    scores = {  # run: new, old, interval half-width (None: evaluated before intervals)
        "post": (0.0, 0.9, 0.02),
        GRAFT: (0.4, 0.7, 0.05),
        masked: (0.3, 0.75, 0.04),
        "sft/post/lr~1e-3/epoch~2": (0.6, 0.3, 0.03),
        "sft/post/lr~1e-3/epoch~1": (0.5, 0.4, None),
    }
    rows = []
    for run, (new, old, half) in scores.items():
        bounds = (
            dict.fromkeys(("new_lo", "new_hi", "old_lo", "old_hi"))
            if half is None
            else {"new_lo": new - half, "new_hi": new + half, "old_lo": old - half, "old_hi": old + half}
        )
        rows.append({"run": run} | parse_run(run) | {"new": new, "old": old} | bounds)
    ax = pareto_figure(pl.DataFrame(rows)).axes[0]
    bars = {}
    for container in ax.containers:
        _, _, (xbars, ybars) = container
        colour = tuple(xbars.get_colors()[0])
        bars.setdefault(colour, []).extend(zip(xbars.get_segments(), ybars.get_segments()))
        assert xbars.get_linewidth()[0] <= 1 and xbars.get_alpha() == ERRORBAR["alpha"] < 0.5
    blue = tuple(to_rgba(STYLES["graft"]["color"], ERRORBAR["alpha"]))
    green = tuple(to_rgba(STYLES["sft"]["color"], ERRORBAR["alpha"]))
    # Two graft points (the hollow masked one too, in the graft colour), one SFT point: its twin without
    # intervals has none; the post model has its own.
    assert len(bars[blue]) == 2 and len(bars[green]) == 1 and len(bars) == 3
    ((x_segment, y_segment),) = bars[green]
    np.testing.assert_allclose(x_segment, [[0.57, 0.3], [0.63, 0.3]])
    np.testing.assert_allclose(y_segment, [[0.6, 0.27], [0.6, 0.33]])
    assert "95% bootstrap interval" in ax.get_legend_handles_labels()[1]


def test_pareto_figure_without_intervals_draws_no_bars(metrics_files: list[Path]) -> None:
    from graftlab.analysis.pareto import pareto_figure

    ax = pareto_figure(summarize(metrics_files, "demo")).axes[0]
    assert ax.containers == [] and "95% bootstrap interval" not in ax.get_legend_handles_labels()[1]


def test_sdpo_rows_carry_their_answer_share_and_say_when_sdpo_was_sdpo_cot(tmp_path):
    from graftlab.analysis.summary import distillation_columns

    runs = {
        "sdpo/post/teacher~frozen/lr~1e-4/step~2": [1.0, 1.0, 0.2],  # no think block up to step 2
        "sdpo_cot/post/teacher~frozen/lr~1e-4/step~2": [1.0, 1.0, 1.0],
        "sdpo/post/teacher~ema:0.05/lr~1e-4/step~3": [0.5, 0.25, 0.0],
    }
    for run, shares in runs.items():
        d = tmp_path / run.rsplit("/step~", 1)[0]
        d.mkdir(parents=True, exist_ok=True)
        (d / "steps.jsonl").write_text(
            "".join(json.dumps({"step": i + 1, "answer_share": s}) + "\n" for i, s in enumerate(shares))
        )
    summary = pl.DataFrame({"run": ["post", *runs], "method": ["post", "sdpo", "sdpo_cot", "sdpo"]})
    out = distillation_columns(summary, tmp_path)
    assert out["answer_share"].to_list() == [None, 1.0, 1.0, 0.25]
    same = "no think block: sdpo and sdpo_cot are the same"
    assert out["note"].to_list() == [None, same, same, None]


def test_the_pareto_figures_frontier_is_that_of_the_candidates_never_a_donors() -> None:
    """Donors and their SFTs are ingredients of grafts, drawn faint: even where one dominates every
    candidate, the frontier line runs through the candidates' own frontier, computed here by brute force."""
    from graftlab.analysis.pareto import pareto_figure

    scores = {
        "post": (0.0, 0.9),
        GRAFT: (0.4, 0.7),
        MERGE: (0.3, 0.6),  # dominated by the graft
        "sft/post/lr~1e-3/epoch~2": (0.6, 0.3),
        "sft/post/lr~1e-3/epoch~1": (0.5, 0.2),  # dominated
        "donor/step~400": (0.7, 0.95),  # dominates every candidate
        "sft/step~400/lr~1e-3/epoch~2": (0.8, 0.5),  # beyond every candidate's new-task accuracy
    }
    df = pl.DataFrame([{"run": r} | parse_run(r) | {"new": n, "old": o} for r, (n, o) in scores.items()])
    candidates = [p for r, p in scores.items() if parse_run(r)["method"] not in ("donor", "donor_sft")]
    front = sorted(p for p in candidates if not any(q[0] >= p[0] and q[1] >= p[1] and q != p for q in candidates))
    assert front == [(0.0, 0.9), (0.4, 0.7), (0.6, 0.3)]
    ax = pareto_figure(df).axes[0]
    [line] = [ln for ln in ax.get_lines() if ln.get_label() == "Pareto frontier"]
    assert sorted(zip(line.get_xdata().tolist(), line.get_ydata().tolist())) == front
    # The donors are still drawn, faint, as points.
    drawn = {c.get_label(): c.get_offsets().tolist() for c in ax.collections}
    assert drawn["donor as it is (faint)"] == [[0.7, 0.95]] and drawn["donor SFT (faint)"] == [[0.8, 0.5]]
