"""The study table: per experiment the verdict on both splits and the drift numbers, per group the counts
of seeds that reproduce; a summary without validation scores leaves those columns empty."""

import math

import polars as pl
import pytest

from graftlab.analysis.moe import MoeConfig
from graftlab.analysis.study import _moe_columns, write_study
from graftlab.planning.config import resolve
from graftlab.planning.layout import parse_run

GRAFT = "graft/step~100/lr~1e-3/epoch~2/lam~1/mask~none/rho~0"
SFT = "sft/post/lr~1e-3/epoch~2"
MOE = MoeConfig.from_config(resolve({}))  # the schema's §3 model: orthogonal tasks (task_cosine 0)


def _summary(path, graft_old: float, validation: bool = True, graft_new: float = 0.6, sft_new: float = 0.5, more=()):
    """post (0, 0.9), SFT (sft_new, 0.2), a graft (graft_new, graft_old) and `more` (run, new, old);
    intervals +-0.05; validation = test scores."""
    rows = []
    for run, new, old in (("post", 0.0, 0.9), (SFT, sft_new, 0.2), (GRAFT, graft_new, graft_old), *more):
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
    groups = write_study(exps, out / "study.parquet", out / "groups.parquet", out / "study.png", MOE)
    row = pl.read_parquet(out / "study.parquet").row(0, named=True)
    assert (row["takeover_sft"], row["takeover_donor_sft"], row["takeover_graft"]) == (pytest.approx(0.8), 0.8, 0.4)
    assert (row["misrouted_post"], row["misrouted_donor"]) == (0.9, pytest.approx(0.3))  # eps_P and eps_D
    assert groups["takeover_sft"].item() == pytest.approx(0.8)
    # The §3 model at (eps_D, eps_P) = (0.3, 0.9), by hand for orthogonal unit tasks (task_cosine 0), expert
    # A = w_A*, B = 0: residuals u = eps_D w_A - w_B and v = eps_P w_A - w_B, so cos theta = (eps_D eps_P + 1)
    # / sqrt((eps_D^2 + 1)(eps_P^2 + 1)); k = eps_D s_P / (eps_P m) with s_P = 0.9^2 + 0.1^2, m = g_P . g_D.
    cos = (0.27 + 1) / math.sqrt(1.09 * 1.81)
    k = 0.3 * 0.82 / (0.9 * (0.27 + 0.07))
    assert (row["moe_cos_theta"], row["moe_k"]) == (pytest.approx(cos), pytest.approx(k))
    # cos 0.904 > k 0.804: a win near the post model; below 2k / (1 + k^2) = 0.977: not all the way.
    assert row["moe_wins_small"] and not row["moe_wins_to_best"] and groups["moe_wins_to_best"].item() == 0


@pytest.mark.parametrize("eps_p, eps_d", [(0.0, 0.0), (0.5, 0.5), (1.0, 0.0), (0.4, 0.9)])
def test_the_section_3_model_predicts_no_win_where_the_donor_routes_no_better(eps_p, eps_d):
    """No misrouting to undo, or a donor that misroutes as much or more: no win, and no division error."""
    cols = _moe_columns(eps_p, eps_d, MOE)
    assert cols["moe_wins_small"] is False and cols["moe_wins_to_best"] is False
    assert _moe_columns(eps_p, None, MOE)["moe_wins_small"] is None  # not measured: no prediction


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


def test_a_merge_is_judged_beside_the_grafts(tmp_path):
    # A merge (the post model's own SFT update, halved) at (0.55, 0.6): 0.55 over SFT's old_hi 0.25; a
    # graft at (0.6, 0.8) dominates it, yet it is judged, not left off the frontier.
    merge = ("graft/post/lr~1e-3/epoch~2/lam~0.5/mask~none/rho~0", 0.55, 0.6)
    exps = [{"exp": "e", "group": "g", "seed": 0, "summary": _summary(tmp_path / "s.parquet", 0.8, more=[merge])}]
    out = tmp_path / "out"
    groups = write_study(exps, out / "study.parquet", out / "groups.parquet", out / "study.png")
    row = pl.read_parquet(out / "study.parquet").row(0, named=True)
    assert row["merge_margin"] == pytest.approx(0.3) and row["merge_margin_val"] == pytest.approx(0.3)
    assert groups["merge_margin"].item() == pytest.approx(0.3)
    # The graft (0.6, 0.8) held to the merge (0.55, 0.6): 0.75 - 0.65; no OPSD run, no margin over it.
    assert row["margin_merge"] == pytest.approx(0.1) and row["margin_merge_val"] == pytest.approx(0.1)
    assert row["margin_opsd"] is None and groups["margin_merge"].item() == pytest.approx(0.1)


def test_an_adaptive_experiments_screened_out_merge_is_held_to_on_both_splits(tmp_path):
    # The graft (0.6, 0.8) beats the merge it was scored beside by 0.75 - 0.65. A screened-out merge whose
    # screening interval may lie below the graft's new-task score with old-task accuracy up to 0.9 binds
    # instead: 0.75 - 0.9, no win on either split.
    merge = ("graft/post/lr~1e-3/epoch~2/lam~0.5/mask~none/rho~0", 0.55, 0.6)
    wild = "graft/post/lr~1e-3/epoch~2/lam~0.25/mask~none/rho~0"
    screened = tmp_path / "screened.parquet"
    pl.DataFrame(
        {"run": [wild], "by": [GRAFT], "new_val_lo": [0.0], "new_val_hi": [0.7], "old_val_lo": [0.5]}
        | {"old_val_hi": [0.9]}
    ).write_parquet(screened)
    exp = {"exp": "e", "group": "g", "seed": 0, "summary": _summary(tmp_path / "s.parquet", 0.8, more=[merge])}
    out = tmp_path / "out"
    for screening, margin in ((None, 0.1), (screened, -0.15)):
        write_study([exp | {"screened": screening}], out / "study.parquet", out / "groups.parquet", out / "study.png")
        row = pl.read_parquet(out / "study.parquet").row(0, named=True)
        assert row["margin_merge"] == pytest.approx(margin) and row["margin_merge_val"] == pytest.approx(margin)
