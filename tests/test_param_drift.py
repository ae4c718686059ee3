"""Parameter drift (issue 17): the five values read 0 / 1 where the formulas say, agree with numpy, clip k to
the rank; `graftlab drift` on two Hugging Face models writes one row per weight matrix and refuses
mismatched or missing models in one line, leaving no drift.parquet."""

import json
import math
import shutil
import struct
import subprocess
import sys

import numpy as np
import polars as pl
import pytest
import torch
from conftest import build_pico_model
from safetensors.torch import load_file, save_file

from graftlab.analysis.param_drift import matrix_drift, plot_drift, write_model_drift
from graftlab.commands.cli import main
from graftlab.errors import GraftlabError

COLUMNS = [
    "tensor",
    "rows",
    "cols",
    "spectral_shift",
    "subspace_angle",
    "mask_overlap",
    "update_sparsity",
    "rel_update_norm",
]
# Hidden 32, 2 layers, a small vocabulary: 16 weight matrices, the lm_head untied.
PICO = dict(
    hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=40
)
PERTURBED = "model.layers.1.mlp.up_proj.weight"


def _randn(*shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _rank_one(shape, seed):
    return _randn(shape[0], 1, seed=seed) @ _randn(1, shape[1], seed=seed + 1)


@pytest.mark.parametrize("shape", [(24, 16), (16, 24)])
def test_a_matrix_against_itself_has_not_drifted(shape):
    w = _randn(*shape)
    d = matrix_drift(w, w.clone())
    assert d == pytest.approx(
        {"spectral_shift": 0, "subspace_angle": 0, "mask_overlap": 1, "update_sparsity": 1, "rel_update_norm": 0},
        abs=1e-10,
    )


def test_a_rotation_keeps_the_spectrum_and_turns_the_subspace():
    w = _randn(40, 24)
    q, _ = torch.linalg.qr(_randn(40, 40, seed=1))
    d = matrix_drift(w, q @ w)
    assert d["spectral_shift"] == pytest.approx(0, abs=1e-10)
    assert d["subspace_angle"] > 30
    assert d["update_sparsity"] == 0


def test_the_angle_grows_with_a_rank_one_update():
    w = _randn(40, 24)
    u = _rank_one(w.shape, seed=5)
    u *= w.norm() / u.norm()
    small, large = (matrix_drift(w, w + eps * u) for eps in (1e-4, 1e-2))
    assert 0 < small["subspace_angle"] < 1
    assert large["subspace_angle"] > 10 * small["subspace_angle"]
    assert small["rel_update_norm"] == pytest.approx(1e-4, rel=1e-9)
    assert 0 < small["spectral_shift"] < large["spectral_shift"]


def test_values_match_numpy():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((30, 20))
    w2 = w + 0.3 * rng.standard_normal(w.shape) * (rng.random(w.shape) < 0.4)  # 60% of entries unchanged
    share = 0.05
    d = matrix_drift(w, w2, share=share)

    s, s2 = np.linalg.svd(w, compute_uv=False), np.linalg.svd(w2, compute_uv=False)
    assert d["spectral_shift"] == pytest.approx(np.linalg.norm(s2 - s) / np.linalg.norm(s), rel=1e-10)
    assert d["rel_update_norm"] == pytest.approx(np.linalg.norm(w2 - w) / np.linalg.norm(w), rel=1e-12)
    assert d["update_sparsity"] == np.mean(w2 == w)
    count = max(1, round(share * w.size))
    top, top2 = (set(np.argsort(-np.abs(m).ravel())[:count]) for m in (w, w2))
    assert d["mask_overlap"] == len(top & top2) / len(top | top2)
    assert 0 < d["mask_overlap"] < 1

    u, u2 = np.linalg.svd(w)[0][:, :4], np.linalg.svd(w2)[0][:, :4]
    cos_min = np.linalg.svd(u.T @ u2, compute_uv=False).min()
    sin_max = np.linalg.svd(u2 - u @ (u.T @ u2), compute_uv=False).max()
    angle = matrix_drift(w, w2, k=4)["subspace_angle"]
    assert angle == pytest.approx(np.degrees(np.arccos(cos_min)), rel=1e-8)
    assert angle == pytest.approx(np.degrees(np.arcsin(sin_max)), rel=1e-8)


def test_k_beyond_the_rank_is_clipped_to_it():
    # Rank 3: W' changes within W's column space, so the angle between ranges is 0; the 13 further singular
    # vectors that k=16 would take are noise in the null space and would make it large.
    b = _randn(20, 3)
    w, w2 = b @ _randn(3, 12, seed=1), b @ (_randn(3, 12, seed=1) + 1e-2 * _randn(3, 12, seed=2))
    deep, exact = matrix_drift(w, w2, k=16), matrix_drift(w, w2, k=3)
    assert deep == exact
    assert deep["subspace_angle"] == pytest.approx(0, abs=1e-6)
    assert matrix_drift(w, w2, k=2)["subspace_angle"] > 0


def test_a_zero_base_reads_undefined_and_bad_options_are_refused():
    d = matrix_drift(torch.zeros(4, 3), torch.ones(4, 3))
    assert all(math.isnan(d[k]) for k in ("spectral_shift", "subspace_angle", "rel_update_norm"))
    with pytest.raises(GraftlabError, match="k must be"):
        matrix_drift(torch.ones(2, 2), torch.ones(2, 2), k=0)
    with pytest.raises(GraftlabError, match="share must be"):
        matrix_drift(torch.ones(2, 2), torch.ones(2, 2), share=0)
    with pytest.raises(GraftlabError, match=r"\[2, 2\] and \[2, 3\]"):
        matrix_drift(torch.ones(2, 2), torch.ones(2, 3))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A pico Qwen3 base and a copy of it with one weight matrix changed by a rank-one update."""
    root = tmp_path_factory.mktemp("param-drift")
    base = build_pico_model(root / "base", **PICO)
    tuned = root / "tuned"
    shutil.copytree(base, tuned)
    tensors = load_file(tuned / "model.safetensors")
    w = tensors[PERTURBED]
    tensors[PERTURBED] = w + 0.05 * w.norm() * _rank_one(w.shape, seed=7).float() / _rank_one(w.shape, seed=7).norm()
    save_file(tensors, tuned / "model.safetensors", metadata={"format": "pt"})
    return base, tuned


def _matrices_in_file_order(model_dir):
    raw = (model_dir / "model.safetensors").read_bytes()
    header = json.loads(raw[8 : 8 + struct.unpack("<Q", raw[:8])[0]])
    header.pop("__metadata__", None)
    order = sorted(header, key=lambda n: header[n]["data_offsets"][0])
    return [(n, *header[n]["shape"]) for n in order if len(header[n]["shape"]) == 2]


def test_graftlab_drift_writes_one_row_per_weight_matrix(models, tmp_path, capsys):
    base, tuned = models
    out = tmp_path / "out"
    assert main(["drift", "--base", str(base), "--model", str(tuned), "--out", str(out), "--k", "4"]) == 0
    assert capsys.readouterr().out.strip() == f"graftlab: wrote {out / 'drift.parquet'}"
    table = pl.read_parquet(out / "drift.parquet")
    assert table.columns == COLUMNS
    assert list(table.select("tensor", "rows", "cols").iter_rows()) == _matrices_in_file_order(base)
    assert table.height == 16

    still = table.filter(pl.col("tensor") != PERTURBED)
    for column, value in (("spectral_shift", 0), ("subspace_angle", 0), ("rel_update_norm", 0)):
        assert still[column].abs().max() == pytest.approx(value, abs=1e-10), column
    assert still["mask_overlap"].min() == 1 and still["update_sparsity"].min() == 1
    [moved] = table.filter(pl.col("tensor") == PERTURBED).to_dicts()
    w, w2 = (load_file(m / "model.safetensors")[PERTURBED].double().numpy() for m in models)
    assert moved["rel_update_norm"] == pytest.approx(np.linalg.norm(w2 - w) / np.linalg.norm(w), rel=1e-12)
    assert moved["spectral_shift"] > 0 and moved["subspace_angle"] > 0 and moved["update_sparsity"] < 1


def test_another_hidden_size_is_refused_in_one_line(models, tmp_path, capsys):
    base, _ = models
    wide = build_pico_model(tmp_path / "wide", **(PICO | {"hidden_size": 48}))
    out = tmp_path / "out"
    capsys.readouterr()  # the model's save progress
    assert main(["drift", "--base", str(base), "--model", str(wide), "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("graftlab: error:")
    assert "not one architecture" in err and "model.embed_tokens.weight is [40, 32] against [40, 48]" in err
    assert str(base) in err and str(wide) in err
    assert not out.exists()


@pytest.mark.parametrize("which", ["empty", "absent"])
def test_a_directory_without_weights_is_refused_by_name(models, tmp_path, capsys, which):
    base, _ = models
    bare = tmp_path / "bare"
    if which == "empty":
        bare.mkdir()
        (bare / "config.json").write_text("{}")
    out = tmp_path / "out"
    assert main(["drift", "--base", str(base), "--model", str(bare), "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and str(bare) in err
    assert not out.exists()


def test_an_error_mid_stream_leaves_no_table(models, tmp_path, monkeypatch):
    import graftlab.analysis.param_drift as param_drift

    calls = []

    def failing(*args):
        calls.append(1)
        if len(calls) == 3:
            raise OSError("disk gone")
        return matrix_drift(*args)

    monkeypatch.setattr(param_drift, "matrix_drift", failing)
    with pytest.raises(OSError):
        write_model_drift(*models, tmp_path / "out")
    assert len(calls) == 3 and not (tmp_path / "out").exists()


def test_plot_drift_draws_a_png_per_against_and_method(tmp_path):
    rows = [
        {"method": m, "stage": s, "against": a, "tensor": t}
        | {c: (math.nan if t == "b" and c == "subspace_angle" else 0.1 * s) for c in COLUMNS[3:]}
        for m in ("sft", "graft")
        for s in (1, 2, 3)
        for a in ("stage_start", "post")
        for t in ("a", "b")
    ]
    out = tmp_path / "fig" / "drift.png"
    plot_drift(pl.DataFrame(rows), out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in out.parent.iterdir()] == ["drift.png"]
    with pytest.raises(GraftlabError, match="lacks columns.*stage"):
        plot_drift(pl.DataFrame(rows).drop("stage"), tmp_path / "never.png")
    assert not (tmp_path / "never.png").exists()


def test_importing_the_module_leaves_torch_and_matplotlib_out():
    code = (
        "import sys, graftlab.analysis.param_drift; "
        "print(sorted({'torch', 'transformers', 'matplotlib'} & set(sys.modules)))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
