"""Drift diagnostics: the ratio and the cosines equal numpy's on the flattened parameters, per kind too,
and models of different architectures are refused by name."""

import numpy as np
import polars as pl
import pytest
import torch
from safetensors.torch import save_file

from graftlab.analysis.drift import delta_geometry, drift_ratio, update_cosines
from graftlab.errors import GraftlabError

NAMES = {
    "model.embed_tokens.weight": (6, 4),
    "model.layers.0.self_attn.q_proj.weight": (4, 4),
    "model.layers.0.mlp.up_proj.weight": (8, 4),
    "model.norm.weight": (4,),
}


def _model(path, seed: int, names=NAMES):
    gen = torch.Generator().manual_seed(seed)
    tensors = {n: torch.randn(shape, generator=gen) for n, shape in names.items()}
    path.mkdir()
    save_file(tensors, str(path / "model.safetensors"))
    return path, tensors


def _flat(tensors, only=None) -> np.ndarray:
    return np.concatenate([t.double().flatten().numpy() for n, t in tensors.items() if only is None or only in n])


@pytest.fixture
def models(tmp_path):
    return {
        name: _model(tmp_path / name, seed)
        for seed, name in enumerate(("init", "base", "post", "sft", "donor", "tuned"))
    }


def test_drift_ratio_is_the_ratio_of_flat_norms(models):
    (init, i), (base, b), (post, p) = models["init"], models["base"], models["post"]
    expected = np.linalg.norm(_flat(p) - _flat(b)) / np.linalg.norm(_flat(b) - _flat(i))
    assert drift_ratio(init, base, post) == pytest.approx(expected, rel=1e-12)


def test_update_cosine_matches_numpy_overall_and_per_kind(models):
    (post, p), (sft, s), (donor, d), (tuned, t) = (models[k] for k in ("post", "sft", "donor", "tuned"))
    [row] = update_cosines((post, sft), {"step~1": (donor, tuned)})
    for column, only in (("cos", None), ("cos_mlp", "mlp"), ("cos_attention", "attn"), ("cos_embedding", "embed")):
        u, v = _flat(s, only) - _flat(p, only), _flat(t, only) - _flat(d, only)
        assert row[column] == pytest.approx(u @ v / np.linalg.norm(u) / np.linalg.norm(v), rel=1e-10), column
    assert row["cos_other"] is None  # no tensor of that kind: undefined, not 0
    assert row["donor_norm"] == pytest.approx(np.linalg.norm(_flat(t) - _flat(d)))


def test_a_delta_with_itself_has_cosine_one_and_kinds_add_up(models):
    (post, _), (sft, _) = models["post"], models["sft"]
    sq, dot = delta_geometry({"a": (post, sft), "b": (post, sft)})
    assert dot[("a", "b")]["all"] == pytest.approx(sq["a"]["all"])
    assert sum(v for k, v in sq["a"].items() if k != "all") == pytest.approx(sq["a"]["all"])


def test_another_architecture_is_refused_by_name(models, tmp_path):
    other, _ = _model(tmp_path / "other", 9, NAMES | {"model.norm.weight": (5,)})
    with pytest.raises(GraftlabError, match="not one architecture.*model.norm.weight"):
        drift_ratio(models["init"][0], models["base"][0], other)
    with pytest.raises(GraftlabError, match="identical"):
        drift_ratio(models["base"][0], models["base"][0], models["post"][0])


def test_drift_table_pairs_each_donor_update_with_the_post_sft_of_the_same_lr_and_epoch(models, tmp_path):
    from graftlab.analysis.drift import write_drift

    (post, p), (sft, s), (donor, d), (tuned, t) = (models[k] for k in ("post", "sft", "donor", "tuned"))
    other, o = _model(tmp_path / "other_sft", 11)
    updates = [
        {"donor": "step~1", "lr": "1e-3", "epoch": 1, "donor_dir": donor, "tuned_dir": tuned, "post_sft_dir": sft},
        {"donor": "step~1", "lr": "1e-3", "epoch": 2, "donor_dir": donor, "tuned_dir": tuned, "post_sft_dir": other},
    ]
    table = write_drift(models["init"][0], models["base"][0], post, updates, tmp_path / "out" / "drift.parquet")
    assert table.equals(pl.read_parquet(tmp_path / "out" / "drift.parquet"))
    v = _flat(t) - _flat(d)
    for row, sft_tensors in zip(table.iter_rows(named=True), (s, o)):
        u = _flat(sft_tensors) - _flat(p)
        assert row["cos"] == pytest.approx(u @ v / np.linalg.norm(u) / np.linalg.norm(v), rel=1e-10)
    assert table["epoch"].to_list() == ["1", "2"] and table["drift_ratio"].n_unique() == 1
