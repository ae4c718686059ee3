"""The grafting paper's §3 model: two linear-regression tasks and a mixture of two linear experts.

Task A (old, the post-trained capability) and task B (new): inputs x ~ N(0, I_d), targets w_A*.x and
w_B*.x. Experts w_A, w_B are the rows of a 2 x d array W. Task-A inputs go through expert A. A task-B input
is routed through expert A with weight eps and through expert B with 1 - eps (a *soft* gate): the
prediction is (eps w_A + (1 - eps) w_B).x. The gate is fixed during fine-tuning, as in the paper. The
donor stage routes eps_D, the post stage eps_P > eps_D; both hold the same experts (expert A = w_A*,
expert B = 0), so routing is the only difference between donor and post, the paper's assumption.

Why soft: a per-input hard gate (probability eps) has the expected loss of the soft gate plus
eps (1 - eps)/2 ||w_A - w_B||^2 (variance over the gate), a term that pulls the experts together and
couples them; the soft gate is its mean field and gives every quantity below in closed form.

Losses are 1/2 E[(prediction - target)^2], exact under isotropic inputs: L_A = 1/2 ||w_A - w_A*||^2,
L_B = 1/2 ||r||^2 with the residual r = eps w_A + (1 - eps) w_B - w_B*. Gradient descent on L_B with
learning rate lr moves W by -lr (eps, 1 - eps) (x) r, and r shrinks by (1 - lr s) per step,
s = eps^2 + (1 - eps)^2. So after k steps W = W0 - (c / s) (eps, 1 - eps) (x) r0, c = 1 - (1 - lr s)^k:
the update keeps one direction whatever lr and k; only its length c moves. docs/fidelity.md has the
derivation and the consequences; `simulate_sft` checks it on sampled data.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import polars as pl

from graftlab.errors import GraftlabError
from graftlab.io.atomic import atomic_file

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


@dataclass(frozen=True)
class MoeConfig:
    """The `moe:` section of the config and the workflow's seed. No defaults here: the schema
    (src/graftlab/config.schema.yaml) is their one home; `from_config(resolve({}))` gives them."""

    dim: int
    task_cosine: float
    eps_donor: float
    eps_post: tuple[float, ...]
    lam: tuple[float, ...]
    lr: float
    steps: int
    samples: int
    seed: int

    def __post_init__(self) -> None:
        # Lists arrive from YAML, integers among the floats; tuples keep the frozen config hashable.
        object.__setattr__(self, "eps_post", tuple(float(e) for e in self.eps_post))
        object.__setattr__(self, "lam", tuple(float(lam) for lam in self.lam))
        check_config(self)

    @classmethod
    def from_config(cls, config: dict) -> "MoeConfig":
        """From a resolved workflow config (graftlab.planning.config.resolve): its `moe` section and `seed`."""
        return cls(**config["moe"], seed=config["seed"])


def check_config(cfg: MoeConfig) -> None:
    """What the schema cannot say: 0 <= eps_D < eps_P < 1 compares two keys; ranges are checked again
    so that a MoeConfig built in Python is held to the same rules as the workflow's config."""
    if not 0 <= cfg.eps_donor < 1:
        raise GraftlabError(f"moe.eps_donor: {cfg.eps_donor} must lie in [0, 1)")
    low = [e for e in cfg.eps_post if not cfg.eps_donor < e < 1]
    if low or not cfg.eps_post:
        raise GraftlabError(
            f"moe.eps_post: {low or 'an empty list'} must each lie above moe.eps_donor = {cfg.eps_donor} "
            "and below 1 (0 <= eps_D < eps_P < 1: the post model routes more task-B inputs through expert A)"
        )
    if not -1 <= cfg.task_cosine <= 1:
        raise GraftlabError(f"moe.task_cosine: {cfg.task_cosine} must lie in [-1, 1]")
    if not 0 < cfg.lr <= 1:
        raise GraftlabError(f"moe.lr: {cfg.lr} must lie in (0, 1]: with s <= 1 each step then shrinks the residual")
    if any(lam < 0 for lam in cfg.lam):
        raise GraftlabError(f"moe.lam: {list(cfg.lam)} must be non-negative")
    if cfg.dim < 2 or cfg.samples < 10 * cfg.dim:
        raise GraftlabError(
            f"moe.samples: {cfg.samples} must be at least 10 x moe.dim = {10 * cfg.dim} (moe.dim >= 2) "
            "for the simulation's sampled losses to estimate the expected ones"
        )


# --- the model, exact ---------------------------------------------------------------------------------


def gate(eps: float) -> np.ndarray:
    """Weights of experts A and B on a task-B input."""
    return np.array([eps, 1.0 - eps])


def tasks(cfg: MoeConfig) -> tuple[np.ndarray, np.ndarray]:
    """Targets T (rows w_A*, w_B*: unit vectors at cosine `task_cosine`) and the initial experts W0."""
    rng = np.random.default_rng(cfg.seed)
    q, _ = np.linalg.qr(rng.standard_normal((cfg.dim, 2)))  # a random orthonormal pair
    sine = np.sqrt(max(0.0, 1.0 - cfg.task_cosine**2))
    targets = np.stack([q[:, 0], cfg.task_cosine * q[:, 0] + sine * q[:, 1]])
    # Expert A has learned task A (post-training); expert B knows nothing of task B yet.
    return targets, np.stack([targets[0], np.zeros(cfg.dim)])


def losses(experts: np.ndarray, targets: np.ndarray, eps: float) -> tuple[float, float]:
    """(L_A, L_B) = 1/2 E[(f(x) - y)^2] per task, exact for x ~ N(0, I): E[(v.x)^2] = ||v||^2."""
    err_a = experts[0] - targets[0]
    err_b = gate(eps) @ experts - targets[1]
    return 0.5 * float(err_a @ err_a), 0.5 * float(err_b @ err_b)


def progress(eps: float, lr: float, steps: int | float) -> float:
    """c: the fraction of the initial task-B residual removed by `steps` GD steps (1 - (1 - lr s)^k)."""
    s = gate(eps) @ gate(eps)
    return 1.0 - (1.0 - lr * s) ** steps


def sft_delta(experts: np.ndarray, targets: np.ndarray, eps: float, c: float) -> np.ndarray:
    """Closed-form update of fine-tuning on task B under routing eps to progress c (GD or gradient flow,
    c = 1 - exp(-s t)): -(c / s) (eps, 1 - eps) (x) r0. Its rows: the change of expert A and of B."""
    g = gate(eps)
    residual = g @ experts - targets[1]
    return -(c / (g @ g)) * np.outer(g, residual)


def sft_task_a_at(task_b: float, experts: np.ndarray, targets: np.ndarray, eps: float) -> float:
    """Task-A loss of the post model's own fine-tuning when it reaches task-B loss `task_b` (its trade-off
    curve; NaN above the post model's task-B loss, which fine-tuning never climbs back to)."""
    r0 = np.linalg.norm(gate(eps) @ experts - targets[1])
    # Along the run the residual is (1 - c) r0, so its norm sqrt(2 L_B) fixes c.
    c = 1.0 - np.sqrt(2.0 * task_b) / r0
    if not 0.0 <= c <= 1.0 + 1e-12:
        return float("nan")
    return losses(experts + sft_delta(experts, targets, eps, c), targets, eps)[0]


def best_lam(post: np.ndarray, donor_delta: np.ndarray, targets: np.ndarray, eps_post: float) -> float:
    """The scale at which the graft's task-B loss is lowest: L_B is quadratic in lam."""
    g = gate(eps_post)
    residual, step = g @ post - targets[1], g @ donor_delta
    return float(-(residual @ step) / (step @ step))


def graft_condition(experts: np.ndarray, targets: np.ndarray, eps_d: float, eps_p: float) -> dict:
    """When the graft beats SFT of post at equal task-B loss, with expert A at w_A* (docs/fidelity.md).

    The graft moves task-A error by eps_D per unit of task-B residual along the donor's residual u; SFT
    of post by eps_P / s_P along its own v. With k = eps_D s_P / (eps_P m), m = g_P . g_D (k < 1 iff
    eps_D < eps_P) and theta the angle between u and v: lower task-A loss for small lam iff
    cos theta > k, and at every task-B loss the graft reaches (lam up to `best_lam`) iff
    cos theta >= 2k / (1 + k^2).
    """
    g_d, g_p = gate(eps_d), gate(eps_p)
    u, v = g_d @ experts - targets[1], g_p @ experts - targets[1]
    cosine = float(u @ v / (np.linalg.norm(u) * np.linalg.norm(v)))
    k = float(eps_d * (g_p @ g_p) / (eps_p * (g_p @ g_d)))
    return {"cos_theta": cosine, "k": k, "wins_small": cosine > k, "wins_to_best": cosine >= 2 * k / (1 + k * k)}


# --- the model, simulated: sampled inputs, explicit per-input forward, gradient descent --------------


def predict(experts: np.ndarray, x: np.ndarray, eps: float | None) -> np.ndarray:
    """The mixture's output per input row: expert A alone (task A, eps=None) or the gated mixture."""
    if eps is None:
        return x @ experts[0]
    return eps * (x @ experts[0]) + (1.0 - eps) * (x @ experts[1])


def gradient(experts: np.ndarray, x: np.ndarray, y: np.ndarray, eps: float) -> np.ndarray:
    """Gradient of the sampled task-B loss mean(1/2 (f(x) - y)^2) by the chain rule through `predict`
    (tests/test_moe.py checks it against torch autograd)."""
    err = predict(experts, x, eps) - y
    return np.stack([eps * (x.T @ err), (1.0 - eps) * (x.T @ err)]) / len(y)


def simulate_sft(experts, targets, eps, lr, steps, x) -> list[np.ndarray]:
    """Full-batch GD on task-B data x (rows ~ N(0, I)), the experts after every step (step 0 first)."""
    y = x @ targets[1]
    path = [experts]
    for _ in range(steps):
        path.append(path[-1] - lr * gradient(path[-1], x, y, eps))
    return path


def sampled_losses(experts, targets, eps, x) -> tuple[float, float]:
    """Monte-Carlo (L_A, L_B) on held-out inputs x: the simulation's counterpart of `losses`."""
    err_a = predict(experts, x, None) - x @ targets[0]
    err_b = predict(experts, x, eps) - x @ targets[1]
    return 0.5 * float(np.mean(err_a**2)), 0.5 * float(np.mean(err_b**2))


# --- the study: every stage, exact and simulated, as one table --------------------------------------


def _row(method, cfg, eps_p, step, lam, experts, sim_experts, targets, x_eval) -> dict:
    loss_a, loss_b = losses(experts, targets, eps_p)
    sim_a, sim_b = sampled_losses(sim_experts, targets, eps_p, x_eval)
    return {
        "method": method,
        "eps_donor": cfg.eps_donor,
        "eps_post": eps_p,
        "gap": eps_p - cfg.eps_donor,
        "step": step,
        "lam": lam,
        "loss_a": loss_a,
        "loss_b": loss_b,
        "sim_loss_a": sim_a,
        "sim_loss_b": sim_b,
    }


def _gap_rows(cfg, eps_p, targets, post, donor_delta, sim_donor_delta, x_train, x_eval) -> list[dict]:
    """SFT of post at every step (its trade-off curve: step 0 is the post model), then the graft of the
    donor's update at every lam and at the lam of its lowest task-B loss, all under the post's routing."""
    sim_path = simulate_sft(post, targets, eps_p, cfg.lr, cfg.steps, x_train)
    rows = []
    for step, sim in enumerate(sim_path):
        exact = post + sft_delta(post, targets, eps_p, progress(eps_p, cfg.lr, step))
        rows.append(_row("sft", cfg, eps_p, step, None, exact, sim, targets, x_eval))
    best = best_lam(post, donor_delta, targets, eps_p)
    for method, lam in [("graft", lam) for lam in cfg.lam] + [("graft_best", best)]:
        exact, sim = post + lam * donor_delta, post + lam * sim_donor_delta
        rows.append(_row(method, cfg, eps_p, cfg.steps, lam, exact, sim, targets, x_eval))
    condition = graft_condition(post, targets, cfg.eps_donor, eps_p)
    for row in rows:
        # The comparison at equal task-B loss: SFT of post's own curve, read at this row's task-B loss.
        matched = sft_task_a_at(row["loss_b"], post, targets, eps_p) if row["method"] != "sft" else None
        row |= {"sft_loss_a_matched": matched} | condition
    return rows


def moe_table(cfg: MoeConfig) -> pl.DataFrame:
    """One row per model: SFT of post per step and graft per lam, for every eps_P; closed-form losses
    (`loss_a`, `loss_b`) beside the simulation's (`sim_loss_a`, `sim_loss_b`: GD on `samples` sampled
    task-B inputs, losses on as many fresh ones), and per graft SFT's task-A loss at its task-B loss."""
    targets, post = tasks(cfg)
    rng = np.random.default_rng([cfg.seed, 1])  # data apart from the task vectors' stream
    x_train, x_eval = rng.standard_normal((2, cfg.samples, cfg.dim))
    # The donor holds the same experts as the post model; only its routing differs. One run serves all gaps.
    donor_delta = sft_delta(post, targets, cfg.eps_donor, progress(cfg.eps_donor, cfg.lr, cfg.steps))
    sim_donor_delta = simulate_sft(post, targets, cfg.eps_donor, cfg.lr, cfg.steps, x_train)[-1] - post
    rows = []
    for eps_p in cfg.eps_post:
        rows += _gap_rows(cfg, eps_p, targets, post, donor_delta, sim_donor_delta, x_train, x_eval)
    return pl.DataFrame(rows, schema_overrides={"lam": pl.Float64, "sft_loss_a_matched": pl.Float64})


# --- the figure ----------------------------------------------------------------------------------------


def _sqrt_axes(ax: "Axes", table: pl.DataFrame) -> None:
    """Square-root axes, limited to the grafts and post models: SFT of post's lines run on out of view."""
    from matplotlib.ticker import FixedLocator

    # On square-root axes SFT of post is a straight line (sqrt(L_A) falls linearly in sqrt(L_B)), and the
    # small task-A losses of grafts are spread out instead of pressed onto the axis.
    functions = (lambda v: np.sqrt(np.clip(v, 0, None)), np.square)
    fine = [0, 0.01, 0.03, 0.05, 0.1, 0.2, 0.3, 0.4, 0.6, 0.8, 1, 1.5, 2, 3]
    coarse = [0, 0.02, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1, 1.5, 2, 3]  # x labels are wider
    for axis, scale, ticks in ((ax.xaxis, ax.set_xscale, coarse), (ax.yaxis, ax.set_yscale, fine)):
        scale("function", functions=functions)
        axis.set_major_locator(FixedLocator(ticks))
    shown = table.filter(pl.col("method") != "sft")
    ax.set_xlim(0, 1.08 * shown["loss_b"].max())
    ax.set_ylim(0, 1.25 * max(shown["loss_a"].max(), 1e-3))


def _pareto_panel(ax: "Axes", cfg: MoeConfig, table: pl.DataFrame) -> None:
    """Task-A against task-B loss per eps_P: SFT of post (dashed, every c) and the graft (solid, lam from
    0 to the largest configured, dotted on to its best lam), configured lams as dots, the best as a star."""
    from matplotlib import colormaps

    targets, post = tasks(cfg)
    donor_delta = sft_delta(post, targets, cfg.eps_donor, progress(cfg.eps_donor, cfg.lr, cfg.steps))
    colours = colormaps["viridis"](np.linspace(0.0, 0.9, len(cfg.eps_post)))
    for eps_p, colour in zip(cfg.eps_post, colours):
        rows = table.filter(pl.col("eps_post") == eps_p)
        dots, best = rows.filter(pl.col("method") == "graft"), rows.filter(pl.col("method") == "graft_best")
        sft = [post + sft_delta(post, targets, eps_p, c) for c in np.linspace(0, 1, 101)]
        sft = np.array([losses(experts, targets, eps_p) for experts in sft])
        ax.plot(sft[:, 1], sft[:, 0], "--", color=colour, lw=1.2)
        top = max(cfg.lam)
        for lams, style in ((np.linspace(0, top, 101), "-"), (np.linspace(top, max(top, best["lam"][0]), 51), ":")):
            graft = np.array([losses(post + lam * donor_delta, targets, eps_p) for lam in lams])
            label = f"eps_P - eps_D = {eps_p - cfg.eps_donor:.2g}" if style == "-" else None
            ax.plot(graft[:, 1], graft[:, 0], style, color=colour, lw=1.8 if style == "-" else 1.0, label=label)
        ax.scatter(dots["loss_b"], dots["loss_a"], color=colour, s=18, zorder=3)
        ax.scatter(best["loss_b"], best["loss_a"], color=colour, marker="*", s=110, edgecolors="black", zorder=4)
    ax.plot([], [], "--", color="0.4", label="SFT of post (any lr, steps)")
    ax.plot([], [], "-", color="0.4", label=f"graft, lam 0..{max(cfg.lam):g} (dots: configured)")
    ax.scatter([], [], marker="*", color="0.4", edgecolors="black", s=110, label="graft at its best lam")
    _sqrt_axes(ax, table)
    ax.set_xlabel("task-B (new) loss, square-root scale")
    ax.set_ylabel("task-A (old) loss, square-root scale")
    ax.set_title(f"Old vs new task loss from the post model (task-A loss 0), eps_D = {cfg.eps_donor:g}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper right", framealpha=0.9)


def _matched_panel(ax: "Axes", table: pl.DataFrame) -> None:
    """Graft's task-A loss over SFT of post's at the same task-B loss, against the routing gap."""
    from matplotlib import colormaps

    grafts = table.filter(pl.col("method").is_in(["graft", "graft_best"]) & (pl.col("lam") > 0))
    grafts = grafts.with_columns(ratio=pl.col("loss_a") / pl.col("sft_loss_a_matched")).sort("gap")
    lams = sorted(set(grafts.filter(pl.col("method") == "graft")["lam"]))
    for lam, colour in zip(lams, colormaps["plasma"](np.linspace(0.0, 0.8, max(len(lams), 1)))):
        pts = grafts.filter((pl.col("method") == "graft") & (pl.col("lam") == lam))
        ax.plot(pts["gap"], pts["ratio"], "o-", color=colour, lw=1, ms=4, label=f"graft, lam = {lam:g}")
    best = grafts.filter(pl.col("method") == "graft_best")
    ax.plot(best["gap"], best["ratio"], "*-", color="black", lw=2, ms=10, label="graft at its best lam")
    ax.axhline(1.0, color="tab:red", lw=1.2, label="SFT of post (= 1)")
    if (grafts["ratio"].drop_nans().drop_nulls() > 0).all():
        ax.set_yscale("log")
    ax.set_xlabel("routing gap eps_P - eps_D")
    ax.set_ylabel("task-A loss, graft / SFT of post, at equal task-B loss")
    ax.set_title("Below 1: the graft forgets less for the same new-task loss")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="best", framealpha=0.9)


def moe_figure(cfg: MoeConfig, table: pl.DataFrame) -> "Figure":
    """Two panels: the old/new trade-off of SFT of post and of the graft per routing gap, and the graft's
    task-A loss relative to SFT's at equal task-B loss against the gap."""
    # A bare Figure renders through Agg without pyplot, as in analysis/pareto.py.
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 5.5))
    left, right = fig.subplots(1, 2)
    _pareto_panel(left, cfg, table)
    _matched_panel(right, table)
    fig.suptitle("Two-task mixture of linear experts (grafting paper §3): closed forms", fontsize=11)
    fig.tight_layout()
    return fig


def write_moe(cfg: MoeConfig, out_parquet: str | Path, out_png: str | Path) -> pl.DataFrame:
    """The table as parquet and the figure as PNG, each written atomically."""
    table = moe_table(cfg)
    with atomic_file(out_parquet) as tmp:
        table.write_parquet(tmp)
    fig = moe_figure(cfg, table)
    with atomic_file(out_png) as tmp:
        fig.savefig(tmp, dpi=150, format="png")
    return table
