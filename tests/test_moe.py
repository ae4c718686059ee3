"""The §3 mixture-of-linear-experts model: closed forms against a simulation, what a user relies on
(lam = 0, equal routing, one SFT curve), the paper's claim where the closed forms say it holds, config."""

import numpy as np
import polars as pl
import pytest
from conftest import REPO, snakemake

from graftlab.analysis import moe
from graftlab.analysis.moe import MoeConfig
from graftlab.errors import GraftlabError
from graftlab.planning.config import ConfigError, resolve

DEFAULTS = resolve({})  # the schema's defaults, once: resolving checks the whole world (0.5 s)


def config(**section) -> MoeConfig:
    """The schema's `moe` defaults with `section` over them (ranges: test_schema_refuses_the_moe_section)."""
    return MoeConfig.from_config(DEFAULTS | {"moe": DEFAULTS["moe"] | section})


def random_state(seed: int, dim: int = 5) -> tuple[np.ndarray, np.ndarray]:
    """Targets and experts in general position: expert A off w_A*, expert B non-zero."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((2, dim)), rng.standard_normal((2, dim))


def test_gradient_is_autograd_of_the_per_input_forward():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    experts, x, y = rng.standard_normal((2, 6)), rng.standard_normal((50, 6)), rng.standard_normal(50)
    w = torch.tensor(experts, requires_grad=True)
    xt = torch.tensor(x)
    pred = 0.3 * (xt @ w[0]) + 0.7 * (xt @ w[1])  # the soft gate, written out independently of moe.py
    (0.5 * ((pred - torch.tensor(y)) ** 2).mean()).backward()
    np.testing.assert_allclose(moe.gradient(experts, x, y, 0.3), w.grad.numpy(), rtol=1e-12)


def test_closed_forms_match_the_simulation():
    # Tolerance: 5% of the value plus 1% of the post model's task-B loss (the problem's scale). At
    # d = 8 and 20,000 samples the sampling error is about sqrt(d / n) = 2%; seeds 0-4 use at most half
    # the tolerance, while a missing 1/s in the update would be off by 20-100%.
    cfg = config(dim=8, samples=20000, eps_post=[0.3, 0.6, 0.9], lam=[0, 0.5, 1, 2], steps=10)
    table = moe.moe_table(cfg)
    scale = table.filter((pl.col("method") == "sft") & (pl.col("step") == 0)).select("eps_post", scale="loss_b")
    table = table.join(scale, on="eps_post")
    assert table.height == 3 * (11 + 4 + 1)
    for loss in ("loss_a", "loss_b"):
        error = (table[f"sim_{loss}"] - table[loss]).abs()
        assert (error <= 0.05 * table[loss] + 0.01 * table["scale"]).all(), table.filter(error > 0.01 * table["scale"])
    # Fine-tuning moved something: the check is not of a model standing still.
    assert table.filter(pl.col("method") == "sft")["loss_b"].min() < 0.1 * table["scale"].min()


def test_losses_are_the_expected_squared_errors_of_the_forward():
    targets, experts = random_state(1)
    x = np.random.default_rng(2).standard_normal((400_000, 5))
    np.testing.assert_allclose(
        moe.sampled_losses(experts, targets, 0.4, x), moe.losses(experts, targets, 0.4), rtol=0.01
    )


def test_lam_zero_leaves_the_post_model():
    table = moe.moe_table(config(dim=4, samples=2000, steps=3))
    post = table.filter((pl.col("method") == "sft") & (pl.col("step") == 0)).sort("eps_post")
    zero = table.filter((pl.col("method") == "graft") & (pl.col("lam") == 0)).sort("eps_post")
    for column in ("loss_a", "loss_b", "sim_loss_a", "sim_loss_b"):
        assert zero[column].to_list() == post[column].to_list()
    assert (zero["loss_a"] == 0).all()  # the post model's expert A is w_A*
    # With expert A off target, the graft at lam = 0 still has the post model's losses exactly.
    targets, experts = random_state(3)
    delta = moe.sft_delta(experts, targets, 0.1, 0.8)
    assert moe.losses(experts + 0.0 * delta, targets, 0.6) == moe.losses(experts, targets, 0.6)
    assert moe.losses(experts + delta, targets, 0.6)[0] != moe.losses(experts, targets, 0.6)[0]


def test_equal_routing_graft_at_one_is_fine_tuning_the_post_model():
    # eps_D = eps_P is refused as a configuration (the paper's eps_D < eps_P); its limit is the case.
    cfg = config(dim=4, samples=2000, eps_donor=0.5 - 1e-12, eps_post=[0.5], lam=[0, 1], steps=7)
    table = moe.moe_table(cfg)
    graft = table.filter((pl.col("method") == "graft") & (pl.col("lam") == 1)).row(0, named=True)
    sft = table.filter((pl.col("method") == "sft") & (pl.col("step") == 7)).row(0, named=True)
    for column in ("loss_a", "loss_b", "sim_loss_a", "sim_loss_b"):
        assert graft[column] == pytest.approx(sft[column], rel=1e-9, abs=1e-12)
    assert graft["sft_loss_a_matched"] == pytest.approx(graft["loss_a"], rel=1e-6)


@pytest.mark.parametrize("lr, steps", [(0.05, 3), (0.3, 10), (1.0, 2), (0.8, 40)])
def test_sft_of_post_is_one_curve_whatever_lr_and_steps(lr, steps):
    targets, experts = random_state(4)
    for eps in (0.2, 0.7):
        tuned = experts + moe.sft_delta(experts, targets, eps, moe.progress(eps, lr, steps))
        loss_a, loss_b = moe.losses(tuned, targets, eps)
        assert moe.sft_task_a_at(loss_b, experts, targets, eps) == pytest.approx(loss_a, rel=1e-9)
        # Explicit GD on the expected loss (the gradient with E[x x^T] = I) lands on the same experts.
        w = experts.copy()
        for _ in range(steps):
            w = w - lr * np.outer(moe.gate(eps), moe.gate(eps) @ w - targets[1])
        np.testing.assert_allclose(w, tuned, rtol=1e-9, atol=1e-12)


def test_fine_tuning_routes_the_share_eps_of_its_update_through_expert_a():
    # The paper's mechanism: the update is (eps, 1 - eps) x residual, so expert A takes the share eps.
    targets, experts = random_state(5)
    for eps in (0.1, 0.5, 0.9):
        delta = moe.sft_delta(experts, targets, eps, 0.6)
        ratio = np.linalg.norm(delta[0]) / np.linalg.norm(delta[1])
        assert ratio == pytest.approx(eps / (1 - eps))


def _brute_force(eps_d: float, eps_p: float, cosine: float) -> tuple[bool, bool]:
    """(graft below SFT at equal task-B loss for small lam, and for every lam up to its best)."""
    cfg = config(dim=2, samples=20, task_cosine=cosine, eps_donor=eps_d, eps_post=[eps_p])
    targets, post = moe.tasks(cfg)
    delta = moe.sft_delta(post, targets, eps_d, 1.0)
    best = moe.best_lam(post, delta, targets, eps_p)
    wins = []
    for lam in np.linspace(best / 400, best, 400):
        loss_a, loss_b = moe.losses(post + lam * delta, targets, eps_p)
        wins.append(loss_a < moe.sft_task_a_at(loss_b, post, targets, eps_p))
    return wins[0], all(wins)


def test_where_the_graft_beats_sft_at_equal_task_b_loss_is_the_closed_form_condition():
    grid = np.round(np.arange(0.0, 1.0, 0.1), 2)
    seen = {(True, True): 0, (True, False): 0, (False, False): 0}
    for cosine in (-0.5, 0.0, 0.5):
        for eps_d in grid:
            for eps_p in np.round(np.arange(eps_d + 0.05, 1.0, 0.1), 2):
                cfg = config(dim=2, samples=20, task_cosine=cosine, eps_donor=eps_d, eps_post=[eps_p])
                targets, post = moe.tasks(cfg)
                cond = moe.graft_condition(post, targets, eps_d, eps_p)
                small, to_best = _brute_force(eps_d, eps_p, cosine)
                assert (small, to_best) == (cond["wins_small"], cond["wins_to_best"]), (cosine, eps_d, eps_p, cond)
                seen[small, to_best] += 1
    # The grid holds all three regimes: the claim everywhere, near the post model only, nowhere.
    assert all(seen.values()), seen


def test_the_paper_claim_holds_on_the_default_gaps_until_the_post_model_routes_almost_all_through_a():
    table = moe.moe_table(config(dim=4, samples=2000))
    grafts = table.filter(pl.col("method").is_in(["graft", "graft_best"]) & (pl.col("lam") > 0))
    # Up to its best lam the graft is below SFT of post at equal task-B loss on every default gap up to
    # 0.7 (gap 0.1 at lam 1.5 and 2 overshoots its best lam 1.13, a point its own smaller lams beat).
    below = grafts.filter((pl.col("gap") < 0.8) & (pl.col("lam") <= 1) | (pl.col("method") == "graft_best"))
    below = below.filter(pl.col("gap") < 0.8)
    assert below.height == 5 * 4 and (below["loss_a"] < below["sft_loss_a_matched"]).all()
    # At gap 0.85 (eps_P = 0.95) only near the post model, not at its best lam.
    last = grafts.filter(pl.col("eps_post") == 0.95)
    assert not last["wins_to_best"][0] and last["wins_small"][0]
    best = last.filter(pl.col("method") == "graft_best").row(0, named=True)
    assert best["loss_a"] > best["sft_loss_a_matched"]
    # With eps_D = 0 the donor's update never touches expert A: no task-A loss at any lam.
    clean = moe.moe_table(config(dim=4, samples=2000, eps_donor=0.0, eps_post=[0.5, 0.99]))
    assert (clean.filter(pl.col("method") != "sft")["loss_a"] == 0).all()


@pytest.mark.parametrize(
    "section, message",
    [
        ({"eps_donor": 0.5, "eps_post": [0.4, 0.9]}, "moe.eps_post: [0.4] must each lie above moe.eps_donor = 0.5"),
        ({"eps_donor": 0.5, "eps_post": [0.5]}, "moe.eps_post: [0.5] must each lie above"),
        ({"dim": 100, "samples": 500}, "moe.samples: 500 must be at least 10 x moe.dim = 1000"),
    ],
)
def test_routing_and_sizes_are_checked_naming_the_key(section, message):
    with pytest.raises(GraftlabError) as err:
        config(**section)
    assert str(err.value).startswith(message)


@pytest.mark.parametrize(
    "section, message",
    [
        ({"eps": 0.1}, "config key moe: Additional properties are not allowed ('eps' was unexpected)"),
        ({"eps_donor": 1.0}, "config key moe.eps_donor: 1.0 is greater than or equal to the maximum of 1"),
        ({"eps_post": [0.5, 1.2]}, "config key moe.eps_post.1: 1.2 is greater than or equal to the maximum of 1"),
        ({"lr": 1.5}, "config key moe.lr: 1.5 is greater than the maximum of 1"),
    ],
)
def test_schema_refuses_the_moe_section(section, message):
    with pytest.raises(ConfigError) as err:
        resolve({"moe": section})
    assert str(err.value).startswith(message)


def test_dry_run_refuses_bad_routing_before_any_job(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("moe: {eps_donor: 0.5, eps_post: [0.3]}\n")
    proc = snakemake(tmp_path, "-n", "results/moe/moe.png", configs=(REPO / "configs" / "smoke.yaml", bad))
    assert proc.returncode != 0
    assert "config key moe.eps_post: [0.3] must each lie above moe.eps_donor = 0.5" in proc.stdout + proc.stderr


def test_write_moe_writes_the_table_and_a_figure(tmp_path):
    from matplotlib.image import imread

    cfg = config(dim=4, samples=2000, eps_post=[0.5, 0.9], lam=[0, 1], steps=5)
    table = moe.write_moe(cfg, tmp_path / "moe.parquet", tmp_path / "moe.png")
    assert pl.read_parquet(tmp_path / "moe.parquet").equals(table)
    assert set(table["method"]) == {"sft", "graft", "graft_best"}
    assert imread(tmp_path / "moe.png").shape[:2] == (825, 1950)
