"""The sensitive-weight analysis: shares of an update in the top Fisher coordinates, checked against
numpy sorts over all flattened parameters, hand-placed updates and tie cases; errors; the figure."""

import math

import numpy as np
import polars as pl
import pytest
import torch
from safetensors.torch import load_file, save_file

from graftlab.analysis.sensitivity import collect_sensitivity, plot_sensitivity
from graftlab.analysis.sensitivity_shares import KINDS, sensitivity_table, top_threshold, write_update_sensitivity
from graftlab.errors import GraftlabError

SFT = "sft/post/lr~1e-3/epoch~2"
GRAFT = "graft/step~100/lr~1e-3/epoch~2/lam~0.5/mask~diag/rho~0.01"
MERGE = "graft/post/lr~1e-3/epoch~2/lam~0.25/mask~none/rho~0"


def weights(model_dir) -> dict[str, torch.Tensor]:
    return load_file(model_dir / "model.safetensors")


def save_model(path, tensors: dict[str, torch.Tensor]):
    path.mkdir(parents=True)
    save_file({n: t.contiguous() for n, t in tensors.items()}, path / "model.safetensors")
    return path


def save_fisher(path, tensors: dict[str, torch.Tensor]):
    path.mkdir(parents=True)
    save_file(tensors, path / "diag.safetensors")
    return path


@pytest.fixture
def post(pico_model):
    return pico_model("post")


def random_fisher(post, tmp_path, seed=0):
    """Positive, heavy-tailed (like a real Fisher) and free of ties."""
    gen = torch.Generator().manual_seed(seed)
    return save_fisher(
        tmp_path / "fisher", {n: torch.rand(t.shape, generator=gen) ** 6 for n, t in weights(post).items()}
    )


def flat(tensors: dict[str, torch.Tensor], names) -> np.ndarray:
    return np.concatenate([tensors[n].double().numpy().ravel() for n in names])


def reference(fisher_dir, post, model, top, keep=lambda name: True) -> dict[str, float]:
    """The measures by a plain numpy sort over every flattened coordinate (no ties in F)."""
    F, p = load_file(fisher_dir / "diag.safetensors"), weights(post)
    names = sorted(F)
    f, u = flat(F, names), flat(weights(model), names) - flat(p, names)
    kept = np.concatenate([np.full(F[n].numel(), keep(n)) for n in names])
    k = round(top * f.size)
    in_top = np.zeros(f.size, dtype=bool)
    in_top[np.argsort(-f, kind="stable")[:k]] = True
    fu2 = f * u**2
    return {
        "top_count": k,
        "fisher_share": fu2[in_top].sum() / fu2.sum(),
        "sq_share": (u**2)[in_top].sum() / (u**2).sum(),
        "predicted_rise": 0.5 * fu2.sum(),
        "update_norm": math.sqrt((u**2).sum()),
        "fisher_top_mass": f[in_top].sum() / f.sum(),
        "kept_share": fu2[in_top & kept].sum() / fu2.sum(),
    }


@pytest.mark.parametrize("top", [0.01, 0.1])
def test_shares_equal_an_independent_sort_over_all_parameters(pico_model, post, tmp_path, top):
    fisher = random_fisher(post, tmp_path)
    sft = pico_model("sft", seed=1, base=post, noise=0.01)
    graft = pico_model("graft", seed=2, base=post, noise=0.003)
    table = sensitivity_table(fisher, post, {SFT: sft, GRAFT: graft}, top=top)
    assert table["run"].to_list() == sorted([SFT, GRAFT])
    for run, model in ((SFT, sft), (GRAFT, graft)):
        row = table.filter(pl.col("run") == run).row(0, named=True)
        want = reference(fisher, post, model, top, keep=lambda n: "mlp" in n)
        assert row["top_count"] == want["top_count"]
        for col in ("fisher_share", "sq_share", "predicted_rise", "update_norm", "fisher_top_mass"):
            assert row[col] == pytest.approx(want[col], rel=1e-5), col
        assert row["fisher_share_mlp"] == pytest.approx(want["kept_share"], rel=1e-5)
        assert sum(row[f"fisher_share_{k}"] for k in KINDS) == pytest.approx(row["fisher_share"], rel=1e-9)
    graft_row = table.filter(pl.col("run") == GRAFT).row(0, named=True)
    assert (graft_row["method"], graft_row["donor"], graft_row["lam"], graft_row["mask"]) == (
        "graft",
        "step~100",
        "0.5",
        "diag",
    )
    assert table.filter(pl.col("run") == SFT)["method"].item() == "sft"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_models_are_widened_exactly(pico_model, tmp_path, dtype):
    """Real models are stored in bf16, which numpy lacks: read as raw bits and widened, the measures equal
    the independent sort over the same values widened by torch."""
    post = pico_model("post", dtype=dtype)
    fisher = random_fisher(post, tmp_path)
    sft = pico_model("sft", seed=1, base=post, noise=0.01, dtype=dtype)
    graft = pico_model("graft", seed=2, base=post, noise=0.003, dtype=dtype)
    assert {t.dtype for m in (post, sft, graft) for t in weights(m).values()} == {dtype}
    table = sensitivity_table(fisher, post, {SFT: sft, GRAFT: graft}, top=0.1)
    for run, model in ((SFT, sft), (GRAFT, graft)):
        row = table.filter(pl.col("run") == run).row(0, named=True)
        want = reference(fisher, post, model, 0.1, keep=lambda n: "mlp" in n)
        assert row["top_count"] == want["top_count"]
        for col in ("fisher_share", "sq_share", "predicted_rise", "update_norm", "fisher_top_mass"):
            assert row[col] == pytest.approx(want[col], rel=1e-5), col
        assert row["fisher_share_mlp"] == pytest.approx(want["kept_share"], rel=1e-5)


def placed_update(post, tmp_path, name, fisher_dir, inside: bool, seed=0):
    """post + a random update exactly on the top-1% Fisher coordinates (or exactly off them)."""
    F, p = load_file(fisher_dir / "diag.safetensors"), weights(post)
    names = sorted(F)
    f = flat(F, names)
    in_top = np.zeros(f.size, dtype=bool)
    in_top[np.argsort(-f)[: round(0.01 * f.size)]] = True
    gen = torch.Generator().manual_seed(seed)
    out, start = {}, 0
    for n in names:
        where = torch.from_numpy(in_top[start : start + p[n].numel()] == inside).reshape(p[n].shape)
        out[n] = p[n] + torch.where(where, torch.randn(p[n].shape, generator=gen) * 0.01, 0.0)
        start += p[n].numel()
    return save_model(tmp_path / name, out)


def test_update_on_the_top_set_has_share_one_and_off_it_zero(post, tmp_path):
    fisher = random_fisher(post, tmp_path)
    on = placed_update(post, tmp_path, "on", fisher, inside=True)
    off = placed_update(post, tmp_path, "off", fisher, inside=False)
    table = sensitivity_table(fisher, post, {SFT: on, MERGE: off})
    on_row, off_row = (table.filter(pl.col("run") == r).row(0, named=True) for r in (SFT, MERGE))
    assert on_row["fisher_share"] == pytest.approx(1.0) and on_row["sq_share"] == pytest.approx(1.0)
    assert off_row["fisher_share"] == 0.0 and off_row["sq_share"] == 0.0
    assert off_row["method"] == "merge" and off_row["update_norm"] > 0


def test_an_update_of_equal_magnitude_everywhere_has_the_uniform_shares(post, tmp_path):
    """|u_i| = c for every i: the plain share is exactly k/N, the F-weighted one the Fisher's own top mass."""
    fisher = random_fisher(post, tmp_path)
    gen = torch.Generator().manual_seed(3)
    signs = {n: torch.randint(0, 2, t.shape, generator=gen) * 2.0 - 1 for n, t in weights(post).items()}
    # Powers of two keep post + u - post exact in fp32, so |u| stays equal to the last bit.
    model = save_model(
        tmp_path / "eq",
        {n: t.double().mul(64).round().div(64).float() + signs[n] / 64 for n, t in weights(post).items()},
    )
    post_rounded = save_model(
        tmp_path / "post64", {n: t.double().mul(64).round().div(64).float() for n, t in weights(post).items()}
    )
    row = sensitivity_table(fisher, post_rounded, {SFT: model}).row(0, named=True)
    n_params = sum(t.numel() for t in weights(post).values())
    assert row["sq_share"] == pytest.approx(round(0.01 * n_params) / n_params, rel=1e-12)
    assert row["fisher_share"] == pytest.approx(row["fisher_top_mass"], rel=1e-6)
    f = np.sort(flat(load_file(fisher / "diag.safetensors"), sorted(signs)))[::-1]
    assert row["fisher_top_mass"] == pytest.approx(f[: round(0.01 * n_params)].sum() / f.sum(), rel=1e-6)


def test_ties_at_the_threshold_count_fractionally(pico_model, post, tmp_path):
    """A Fisher of all ones ranks nothing: every update then puts k/N of its norm in the top set. A Fisher
    positive on only 0.5% of coordinates puts all its weight there, the zeros filling the rest of the 1%."""
    sft = pico_model("sft", seed=1, base=post, noise=0.01)
    p, s = weights(post), weights(sft)
    ones = save_fisher(tmp_path / "ones", {n: torch.ones_like(t) for n, t in p.items()})
    n_params = sum(t.numel() for t in p.values())
    k = round(0.01 * n_params)
    row = sensitivity_table(ones, post, {SFT: sft}).row(0, named=True)
    assert row["fisher_share"] == pytest.approx(k / n_params) and row["sq_share"] == pytest.approx(k / n_params)

    gen = torch.Generator().manual_seed(5)
    sparse = {
        n: (torch.rand(t.shape, generator=gen) < 0.005) * torch.rand(t.shape, generator=gen) for n, t in p.items()
    }
    row = sensitivity_table(save_fisher(tmp_path / "sparse", sparse), post, {SFT: sft}).row(0, named=True)
    names = sorted(p)
    f, u2 = flat(sparse, names), (flat(s, names) - flat(p, names)) ** 2
    n_pos = int((f > 0).sum())
    weight = (k - n_pos) / (f.size - n_pos)
    assert row["fisher_share"] == pytest.approx(1.0)
    assert row["sq_share"] == pytest.approx((u2[f > 0].sum() + weight * u2[f == 0].sum()) / u2.sum(), rel=1e-6)
    # -0.0 ties with +0.0, though its bit pattern, as an int32, is the most negative one.
    negative_zeros = {n: torch.where(t == 0, -0.0, t) for n, t in sparse.items()}
    negzero = save_fisher(tmp_path / "negzero", negative_zeros)
    assert sensitivity_table(negzero, post, {SFT: sft}).row(0, named=True) == row


@pytest.mark.parametrize("k", [1, 7, 500, 999, 1000])
def test_top_threshold_is_the_kth_largest_with_its_ties(k):
    gen = torch.Generator().manual_seed(k)
    values = torch.randint(0, 50, (1000,), generator=gen).float() / 7  # many duplicates, zeros included
    parts = {"a": values[:300].reshape(30, 10).numpy(), "b": values[300:].numpy()}
    threshold, above, tied = top_threshold(parts, k)
    want = np.sort(values.numpy())[::-1][k - 1]
    assert threshold == want
    assert (above, tied) == (int((values > want).sum()), int((values == want).sum()))
    assert above < k <= above + tied


def test_a_sharded_model_and_a_zero_update_are_read_alike(pico_model, post, tmp_path):
    fisher = random_fisher(post, tmp_path)
    whole = pico_model("whole", seed=1, base=post, noise=0.01)
    sharded = pico_model("sharded", seed=1, base=post, noise=0.01, max_shard_size="4KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    table = sensitivity_table(fisher, post, {SFT: whole, GRAFT: sharded, MERGE: post})
    a, b, zero = (table.filter(pl.col("run") == r).row(0, named=True) for r in (SFT, GRAFT, MERGE))
    assert a["fisher_share"] == b["fisher_share"] and a["predicted_rise"] == b["predicted_rise"]
    # lam = 0: nothing written anywhere, so no share; the rise and the norm are zero.
    assert zero["fisher_share"] is None and zero["sq_share"] is None
    assert zero["predicted_rise"] == 0.0 and zero["update_norm"] == 0.0


def test_a_model_of_another_architecture_is_refused_naming_it(pico_model, post, tmp_path):
    fisher = random_fisher(post, tmp_path)
    wide = pico_model("wide", vocab_size=48)
    with pytest.raises(GraftlabError) as err:
        sensitivity_table(fisher, post, {SFT: pico_model("ok", seed=1, base=post, noise=0.01), GRAFT: wide})
    message = str(err.value)
    assert "\n" not in message and GRAFT in message and str(wide) in message and "embed_tokens" in message

    missing = save_model(tmp_path / "missing", {n: t for n, t in weights(post).items() if "lm_head" not in n})
    with pytest.raises(GraftlabError, match="missing.*lm_head"):
        sensitivity_table(fisher, post, {SFT: missing})
    with pytest.raises(GraftlabError, match="lacks key"):
        sensitivity_table(fisher, post, {"sft/post/lr~1e-3": post})
    negative = save_fisher(tmp_path / "neg", {n: -torch.ones_like(t) for n, t in weights(post).items()})
    with pytest.raises(GraftlabError, match="negative"):
        sensitivity_table(negative, post, {SFT: post})
    nan = save_fisher(tmp_path / "nan", {n: torch.full_like(t, math.nan) for n, t in weights(post).items()})
    with pytest.raises(GraftlabError, match="NaN or Inf"):
        sensitivity_table(nan, post, {SFT: post})
    other = save_fisher(tmp_path / "other", {n: torch.ones(3) for n in weights(post)})
    with pytest.raises(GraftlabError, match="another architecture.*shapes differ"):
        sensitivity_table(other, post, {SFT: post})
    with pytest.raises(GraftlabError, match="no diagonal Fisher"):
        sensitivity_table(tmp_path / "absent", post, {SFT: post})


def test_collected_sensitivity_writes_the_table_and_a_png(pico_model, post, tmp_path):
    fisher = random_fisher(post, tmp_path)
    updates = {
        SFT: pico_model("sft", seed=1, base=post, noise=0.01),
        GRAFT: pico_model("graft", seed=2, base=post, noise=0.003),
        MERGE: pico_model("merge", seed=3, base=post, noise=0.002),
        "graft/step~100/lr~1e-3/epoch~2/lam~0/mask~none/rho~0": post,
    }
    out = tmp_path / "out"
    rows = [tmp_path / "rows" / f"{i}.parquet" for i in range(len(updates))]
    for row, (run, model) in zip(rows, updates.items()):
        write_update_sensitivity(fisher, post, run, model, row)
    table = collect_sensitivity(rows, out / "sensitivity.parquet", out / "sensitivity.png", title="x")
    assert pl.read_parquet(out / "sensitivity.parquet").equals(table)
    png = (out / "sensitivity.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    assert sorted(p.name for p in out.iterdir()) == ["sensitivity.parquet", "sensitivity.png"]  # no temporaries
    with pytest.raises(ValueError, match="unknown method"):
        plot_sensitivity(table.with_columns(method=pl.lit("no_such_method")), out / "bad.png")


def test_rows_written_one_update_at_a_time_collect_into_the_whole_table(pico_model, post, tmp_path):
    """The workflow measures each update on its own job (while its temporary graft exists)."""
    fisher = random_fisher(post, tmp_path)
    updates = {
        SFT: pico_model("sft", seed=1, base=post, noise=0.01),
        GRAFT: pico_model("graft", seed=2, base=post, noise=0.003),
    }
    rows = []
    for i, (run, model) in enumerate(updates.items()):
        rows.append(tmp_path / "rows" / f"{i}.parquet")
        write_update_sensitivity(fisher, post, run, model, rows[-1])
    table = collect_sensitivity(rows[::-1], tmp_path / "s.parquet", tmp_path / "s.png")
    assert table.equals(sensitivity_table(fisher, post, updates))
    assert pl.read_parquet(tmp_path / "s.parquet").equals(table) and (tmp_path / "s.png").stat().st_size > 10_000
    with pytest.raises(GraftlabError, match="no updates"):
        collect_sensitivity([], tmp_path / "t.parquet", tmp_path / "t.png")


def test_every_method_of_the_pipeline_has_a_place_in_the_plot():
    # A method missing from METHODS would be dropped from the figure without a word.
    from graftlab.analysis.pareto import STYLES
    from graftlab.analysis.sensitivity import METHODS

    assert set(METHODS) == set(STYLES) - {"donor"}  # a donor as it is is no update of the post model
