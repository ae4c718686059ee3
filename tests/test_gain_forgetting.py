"""Gain and forgetting against the post model (Denser ≠ Better): the numbers against hand computation on
a small summary, acc₀ = 0, the rows left out, the run each method shows, and the heatmap file."""

import polars as pl
import pytest

from graftlab.analysis.gain_forgetting import (
    ZERO_BASE,
    gain_forgetting,
    infer_roles,
    shown_runs,
    write_gain_forgetting,
)
from graftlab.planning.layout import parse_run

ROLES = {"add": "old", "sub": "old", "mul": "new"}
SFT1, SFT2 = "sft/post/lr~1e-3/epoch~1", "sft/post/lr~1e-3/epoch~2"
GRAFT = "graft/step~100/lr~1e-3/epoch~2/lam~0.5/mask~none/rho~0"
MERGE_LO, MERGE_HI = (f"graft/post/lr~1e-3/epoch~2/lam~{lam}/mask~none/rho~0" for lam in ("1", "0.5"))
SDPO = "sdpo/post/teacher~post/step~40"
# (add, sub, mul) per run; mul is the new task, which the post model never solves (acc₀ = 0).
ACC = {
    "post": (0.80, 0.50, 0.00),
    SFT1: (0.40, 0.60, 0.30),
    SFT2: (0.20, 0.25, 0.50),
    GRAFT: (0.80, 0.45, 0.10),
    MERGE_LO: (0.10, 0.10, 0.00),
    MERGE_HI: (0.70, 0.40, 0.00),
    SDPO: (0.60, 0.50, 0.05),
    "donor/step~100": (0.30, 0.20, 0.00),
    "sft/step~100/lr~1e-3/epoch~2": (0.10, 0.10, 0.60),
}


def _ids(run: str) -> dict:
    if run == SDPO:  # a method newer than the layout's parser, with keys of its own
        return {"method": "sdpo", "donor": "post", "teacher": "post", "step": "40"}
    return parse_run(run) | {"teacher": None}


def _summary() -> pl.DataFrame:
    """The columns of a real summary: ids, keys, role means, per benchmark acc with interval and pass@k,
    and the data columns."""
    rows = []
    for run, accs in ACC.items():
        row = {"exp": "toy", "run": run} | _ids(run) | {"old": (accs[0] + accs[1]) / 2, "new": accs[2]}
        for bench, acc in zip(ROLES, accs):
            row |= {f"{bench}_acc": acc, f"{bench}_acc_lo": max(acc - 0.05, 0), f"{bench}_acc_hi": acc + 0.05}
            row |= {f"{bench}_pass@1": acc}
        rows.append(row | {"data": "expert", "data_traces": 40})
    return pl.DataFrame(rows)


def _cell(table: pl.DataFrame, run: str, bench: str) -> dict:
    return table.filter(run=run, benchmark=bench).row(0, named=True)


def test_numbers_match_hand_computation():
    table = gain_forgetting(_summary(), ROLES)
    add = _cell(table, SFT1, "add")  # 0.40 against 0.80: half of it forgotten
    assert (add["base_acc"], add["delta"], add["rel_delta"]) == pytest.approx((0.80, -0.40, -0.5))
    assert (add["gain"], add["forgetting"], add["note"]) == (0.0, pytest.approx(0.5), None)
    sub = _cell(table, SFT1, "sub")  # 0.60 against 0.50: a fifth gained
    assert (sub["delta"], sub["rel_delta"], sub["gain"], sub["forgetting"]) == pytest.approx((0.1, 0.2, 0.2, 0.0))
    same = _cell(table, GRAFT, "add")  # unchanged: neither gain nor forgetting, and no -0.0
    assert (same["delta"], same["gain"], same["forgetting"]) == (0.0, 0.0, 0.0)
    assert (_cell(table, SDPO, "sub")["forgetting"], _cell(table, SDPO, "add")["forgetting"]) == pytest.approx(
        (0, 0.25)
    )
    lo = _cell(table, SFT2, "add")
    assert (lo["acc"], lo["acc_lo"], lo["acc_hi"]) == pytest.approx((0.2, 0.15, 0.25)) and lo["role"] == "old"


def test_zero_base_keeps_delta_and_leaves_the_relative_change_undefined():
    table = gain_forgetting(_summary(), ROLES)
    mul = table.filter(benchmark="mul")
    assert mul["base_acc"].to_list() == [0.0] * mul.height
    assert mul.filter(run=SFT2)["delta"].item() == pytest.approx(0.5)
    assert mul.select("rel_delta", "gain", "forgetting").null_count().row(0) == (mul.height,) * 3
    assert set(mul["note"]) == {ZERO_BASE} and table.filter(benchmark="add")["note"].null_count() == 6
    assert set(mul["role"]) == {"new"}


def test_gain_and_forgetting_never_both_positive():
    table = gain_forgetting(_summary(), ROLES).drop_nulls("rel_delta")
    assert table.filter((pl.col("gain") > 0) & (pl.col("forgetting") > 0)).height == 0
    assert table.select((pl.col("gain") - pl.col("forgetting") - pl.col("rel_delta")).abs().max()).item() < 1e-12
    assert table.select((pl.col("gain") >= 0) & (pl.col("forgetting") >= 0)).to_series().all()


def test_post_and_ingredients_left_out_keys_kept():
    table = gain_forgetting(_summary(), ROLES)
    assert sorted(set(table["method"])) == ["graft", "merge", "sdpo", "sft"]
    assert table.height == 6 * 3  # six candidate runs, three benchmarks
    assert table.columns[:4] == ["exp", "run", "method", "donor"]
    assert {"lr", "epoch", "lam", "mask", "rho", "teacher", "step"} <= set(table.columns)
    assert not {"data", "data_traces", "old", "new", "add_pass@1"} & set(table.columns)
    assert _cell(table, SDPO, "add")["teacher"] == "post"
    assert table.unique("benchmark", maintain_order=True)["benchmark"].to_list() == ["add", "sub", "mul"]


def test_roles_inferred_from_new_and_checked():
    summary = _summary()
    assert infer_roles(summary) == ROLES
    assert gain_forgetting(summary).equals(gain_forgetting(summary, ROLES))
    with pytest.raises(ValueError, match="roles name"):
        gain_forgetting(summary, {"add": "old", "mul": "new"})
    with pytest.raises(ValueError, match="exactly one `post`"):
        gain_forgetting(summary.filter(pl.col("method") != "post"), ROLES)


def test_each_method_shows_its_best_new_task_run_ties_to_old():
    shown = shown_runs(gain_forgetting(_summary(), ROLES))
    runs = dict(shown.unique("method").select("method", "run").iter_rows())
    # Both merges score 0 on the new task: the one that kept more of the old tasks is shown.
    assert runs == {"sft": SFT2, "graft": GRAFT, "merge": MERGE_HI, "sdpo": SDPO}
    assert shown.height == 4 * 3


def test_write_gain_forgetting_writes_the_table_and_a_png(tmp_path):
    src = tmp_path / "summary.parquet"
    _summary().write_parquet(src)
    table = write_gain_forgetting(src, tmp_path / "gf.parquet", tmp_path / "gf.png", roles=ROLES)
    assert pl.read_parquet(tmp_path / "gf.parquet").equals(table)
    assert (tmp_path / "gf.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gf.parquet", "gf.png", "summary.parquet"]
