"""The smoke run's continual experiment (configs/smoke.yaml `continual`: order, then knowledge): every method's
chain for two stages in continual.parquet, its gain and forgetting recomputed from acc and base_acc, the
collapse and drift tables, and the chains' caching: a change to stage 2 re-runs stage 2 and nothing before."""

import json

import polars as pl
import pytest
import yaml
from conftest import SMOKE
from test_workflow import planned_jobs, write_config

pytestmark = pytest.mark.workflow
METHODS = {
    "sft",
    "graft_chain",
    "graft_cumulative",
    "merge_chain",
    "opsd",
    "grpo",
    "sdpo:frozen",
    "sdpo:ema:0.05",
    "sdpo:refresh:1",
    "sdpo_cot:ema:0.05",
}
# What any change to the continual experiment re-makes once: its tables and figures, and the default target.
CONTINUAL_ANALYSES = {"continual": 1, "param_drift": 1, "response_kl": 1, "report_tables": 1, "all": 1}


def stages_overlay(tmp_path, name, edit) -> object:
    """The smoke config's continual stages with `edit(stages)` applied (lists replace, so all are given)."""
    stages = yaml.safe_load(SMOKE.read_text())["experiments"]["continual"]["stages"]
    edit(stages)
    return write_config(tmp_path, name, {"experiments": {"continual": {"stages": stages}}})


def test_continual_table_has_every_method_after_every_stage(smoke):
    table = pl.read_parquet(smoke / "results" / "continual" / "continual.parquet")
    assert set(table["method"]) == METHODS
    assert sorted(set(table["stage"])) == [1, 2]
    assert set(table["benchmark"]) == {"add", "sub", "compare", "order", "knowledge"}
    assert table.height == len(METHODS) * 2 * 5
    base = json.loads((smoke / "results/continual/eval/post/metrics.json").read_text())["benchmarks"]
    for row in table.iter_rows(named=True):
        acc0 = base[row["benchmark"]]["acc@n"]
        assert row["base_acc"] == acc0 and row["delta"] == pytest.approx(row["acc"] - acc0)
        if acc0 == 0:
            assert row["rel_delta"] is None and row["gain"] is None and row["forgetting"] is None
        else:
            rel = (row["acc"] - acc0) / acc0
            assert row["gain"] == pytest.approx(max(rel, 0)) and row["forgetting"] == pytest.approx(max(-rel, 0))


def test_continual_summary_carries_averages_and_collapse(smoke):
    summary = pl.read_parquet(smoke / "results" / "continual" / "summary.parquet")
    assert summary.height == len(METHODS) * 2
    for column in ("avg_acc", "avg_forgetting", "collapsed", "collapse_reason", "collapse_stage", "repeated_share"):
        assert column in summary.columns
    assert summary.filter(pl.col("collapsed"))["collapse_reason"].null_count() == 0


def test_drift_tables_cover_every_model(smoke):
    root = smoke / "results" / "continual"
    drift = pl.read_parquet(root / "param_drift.parquet")
    assert set(drift["method"]) == METHODS and set(drift["against"]) == {"stage_start", "post"}
    # A graft chain's first stage against the post model is one update of the donor: the same as its start.
    first = drift.filter((pl.col("stage") == 1) & (pl.col("method") == "graft_chain"))
    by = {a: first.filter(pl.col("against") == a).sort("tensor")["rel_update_norm"] for a in ("stage_start", "post")}
    assert by["stage_start"].to_list() == by["post"].to_list()
    responses = pl.read_parquet(root / "response_drift.parquet")
    assert {r.split("@")[0] for r in responses["run"]} == METHODS
    kl = pl.read_parquet(root / "kl_forgetting.parquet")
    assert kl.filter(pl.col("method") == "post").select("kl_reverse", "kl_forward").row(0) == (0.0, 0.0)
    assert kl.filter(pl.col("method") == "sft")["kl_forward"].min() > 0  # SFT moved: both directions see it
    assert {"residual_reverse", "residual_forward"} <= set(kl.columns)
    # The post model, every chain after each stage, and OPSD's first of two checkpoints in each stage.
    assert kl.height == 1 + len(METHODS) * 2 + 2 and kl.filter(pl.col("step").is_not_null())[
        "method"
    ].unique().to_list() == ["opsd"]
    assert all(kl[f"residual_{d}"].null_count() <= kl["forgetting"].null_count() for d in ("reverse", "forward"))
    for png in ("continual_accuracy", "continual_heatmap", "param_drift", "response_drift", "kl_forgetting"):
        assert (root / f"{png}.png").stat().st_size > 10_000


def test_the_merge_chain_adds_half_its_own_update_at_each_stage(smoke):
    """merge_chain at lam 0.5 (configs/smoke.yaml): after stage k the model is M + 0.5 (SFT(M) - M), M the
    chain's model after stage k-1 (the post model before stage 1) and SFT(M) its SFT on stage k, tensor by
    tensor, recomputed here from the files."""
    import torch
    from safetensors.torch import load_file

    chain = smoke / "results/continual/chain/merge_chain/post/lr~1e-3/lam~0.5/mask~none/rho~0"
    start = smoke / "results/world/post"
    for k in (1, 2):
        stage = chain / f"stage~{k}"
        m, tuned = load_file(start / "model.safetensors"), load_file(stage / "sft/epoch~1/model.safetensors")
        merged = load_file(stage / "model/model.safetensors")
        assert merged.keys() == m.keys() and any(not torch.equal(tuned[n], m[n]) for n in m)
        for name, w in m.items():
            expected = (w.double() + 0.5 * (tuned[name].double() - w.double())).to(w.dtype)
            assert torch.allclose(merged[name], expected, atol=1e-6), (k, name)
        start = stage / "model"


def test_a_change_to_stage_2_reruns_stage_2_and_nothing_before(smoke, tmp_path):
    def longer(stages):
        stages[1]["steps"] = 3

    jobs = planned_jobs(smoke, stages_overlay(tmp_path, "steps", longer))
    # The on-policy chains' second stages (OPSD, GRPO, 4 SDPO) and their evaluations; SFT and grafts keep theirs.
    # OPSD keeps two checkpoints a stage: both are scored. Each of those chains' drift after stage 2.
    expected = {"chain_opsd": 1, "chain_grpo": 1, "chain_sdpo": 4, "evaluate": 7, "stage_drift": 6}
    assert jobs == expected | CONTINUAL_ANALYSES


def test_a_change_to_stage_1_reruns_its_chains_from_stage_1_on(smoke, tmp_path):
    def longer(stages):
        stages[0]["epochs"] = 2

    jobs = planned_jobs(smoke, stages_overlay(tmp_path, "epochs", longer))
    # SFT from stage 1 on; the donor's tuning on stage 1 and its cumulative chain from stage 1 on; both
    # graft chains from stage 1 on. Stage 2's lone tuning and every on-policy chain stay.
    # The merge chain from stage 1 on: its SFT of its own model, and its merge, at each stage.
    expected = {"chain_sft": 2 + 1 + 2, "chain_merge_sft": 2, "chain_graft": 6, "evaluate": 8}
    # The four chains' drift after both stages.
    assert jobs == expected | CONTINUAL_ANALYSES | {"stage_drift": 4 * 2}
