"""The study table: per experiment the verdict on both splits and the drift numbers, per group the counts
of seeds that reproduce; a summary without validation scores leaves those columns empty."""

import polars as pl
import pytest

from graftlab.analysis.study import write_study
from graftlab.layout import parse_run

GRAFT = "graft/step~100/lr~1e-3/epoch~2/lam~1/mask~none/rho~0"
SFT = "sft/post/lr~1e-3/epoch~2"


def _summary(path, graft_old: float, validation: bool = True, graft_new: float = 0.6, sft_new: float = 0.5):
    """post (0, 0.9), SFT (sft_new, 0.2), a graft (graft_new, graft_old); intervals +-0.05; validation =
    test scores."""
    rows = []
    for run, new, old in (("post", 0.0, 0.9), (SFT, sft_new, 0.2), (GRAFT, graft_new, graft_old)):
        row = {"run": run, "new": new, "old": old} | parse_run(run)
        row |= {"old_lo": old - 0.05, "old_hi": old + 0.05, "new_lo": new - 0.05, "new_hi": new + 0.05}
        if validation:
            row |= {f"{k}_val{b}": row[f"{k}{b}"] for k in ("old", "new") for b in ("", "_lo", "_hi")}
        rows.append(row)
    pl.DataFrame(rows).write_parquet(path)
    return path


def _drift(path, ratio: float, cos: float):
    pl.DataFrame({"donor": ["step~100"], "drift_ratio": [ratio], "cos": [cos], "cos_mlp": [cos / 2]}).write_parquet(
        path
    )
    return path


def test_study_counts_seeds_that_reproduce_per_group(tmp_path):
    exps = []
    for group, olds in (("wide", (0.8, 0.85, 0.1)), ("narrow", (0.1, 0.22, 0.2))):
        for seed, old in enumerate(olds):
            name = f"{group}{seed}"
            exps.append(
                {
                    "exp": name,
                    "group": group,
                    "seed": seed,
                    "summary": _summary(tmp_path / f"{name}.parquet", old),
                    "drift": _drift(tmp_path / f"{name}-drift.parquet", 0.5 + seed, 0.1 * seed),
                }
            )
    out = tmp_path / "out"
    groups = write_study(exps, out / "study.parquet", out / "groups.parquet", out / "study.png")
    per_exp = pl.read_parquet(out / "study.parquet")
    wide0 = per_exp.filter(exp="wide0").row(0, named=True)
    # Margin: graft old_lo 0.75 - SFT old_hi 0.25; on the frontier, SFT new 0.5 <= graft new 0.6.
    assert wide0["margin"] == pytest.approx(0.5) and wide0["reproduces"] and wide0["reproduces_val"]
    assert per_exp.filter(exp="narrow1")["reproduces"].item() is False  # 0.17 - 0.25 < 0: within the intervals
    rows = {r["group"]: r for r in groups.iter_rows(named=True)}
    assert (rows["wide"]["seeds"], rows["wide"]["reproduces"], rows["narrow"]["reproduces"]) == (3, 2, 0)
    assert rows["wide"]["drift_ratio"] == pytest.approx(1.5) and rows["wide"]["cos"] == pytest.approx(0.1)
    assert (out / "study.png").read_bytes()[:4] == b"\x89PNG"


def test_takeover_is_averaged_per_method_and_unmasked_grafts_only(tmp_path):
    masked = GRAFT.replace("mask~none/rho~0", "mask~kfac/rho~0.1")
    runs = {
        "post": 0.0,
        SFT: 0.9,
        "sft/post/lr~1e-3/epoch~4": 0.7,
        "sft/step~100/lr~1e-3/epoch~2": 0.8,
        GRAFT: 0.4,
        masked: 0.0,
        "donor/step~100": 0.0,
        "donor/step~300": 0.0,
    }
    misrouted = {"post": 0.9, "donor/step~100": 0.2, "donor/step~300": 0.4}
    takeover = pl.DataFrame(
        [{"run": r, "takeover": t, "misrouted": misrouted.get(r, 0.0)} | parse_run(r) for r, t in runs.items()]
    )
    takeover.write_parquet(tmp_path / "t.parquet")
    exps = [
        {
            "exp": "e",
            "group": "g",
            "seed": 0,
            "summary": _summary(tmp_path / "s.parquet", 0.8),
            "drift": None,
            "takeover": tmp_path / "t.parquet",
        }
    ]
    out = tmp_path / "out"
    groups = write_study(exps, out / "study.parquet", out / "groups.parquet", out / "study.png")
    row = pl.read_parquet(out / "study.parquet").row(0, named=True)
    assert (row["takeover_sft"], row["takeover_donor_sft"], row["takeover_graft"]) == (pytest.approx(0.8), 0.8, 0.4)
    assert (row["misrouted_post"], row["misrouted_donor"]) == (0.9, pytest.approx(0.3))  # eps_P and eps_D
    assert groups["takeover_sft"].item() == pytest.approx(0.8)


def test_an_experiment_without_validation_scores_or_drift_leaves_those_columns_empty(tmp_path):
    exps = [
        {
            "exp": "e",
            "group": "g",
            "seed": 0,
            "summary": _summary(tmp_path / "s.parquet", 0.8, validation=False),
            "drift": None,
        }
    ]
    out = tmp_path / "out"
    write_study(exps, out / "study.parquet", out / "groups.parquet", out / "study.png")
    row = pl.read_parquet(out / "study.parquet").row(0, named=True)
    assert row["reproduces"] and row["reproduces_val"] is None and row["drift_ratio"] is None
    assert row["takeover_sft"] is None and row["misrouted_post"] is None


def test_a_graft_that_learned_nothing_has_no_margin(tmp_path):
    # SFT forgot before it learned (new 0, old 0.2); the graft kept the old tasks (0.8) by learning nothing
    # (new 0.02, within the post model's interval): no win, and no margin that would read as a near miss.
    summary = _summary(tmp_path / "s.parquet", 0.8, graft_new=0.02, sft_new=0.0)
    exps = [{"exp": "e", "group": "g", "seed": 0, "summary": summary, "drift": None}]
    out = tmp_path / "out"
    write_study(exps, out / "study.parquet", out / "groups.parquet", out / "study.png")
    row = pl.read_parquet(out / "study.parquet").row(0, named=True)
    assert not row["reproduces"] and row["margin"] is None and row["margin_val"] is None
