"""A study over many experiments (the fidelity study, issue 6): one row per experiment and one per group.

An experiment belongs to a *group*, the configuration that matters (a world and a sweep), run once per
seed. Per experiment the table holds the world's drift ratio and the donor/post update cosines
(`graftlab.analysis.drift`), the routing and takeover measures (`graftlab.analysis.takeover`), and the
verdict of `graftlab.analysis.verdict` on the validation split and on the test split: whether a graft
reproduces the paper's result, and the best margin of a frontier graft that learned the new task (its
old-task lower bound minus the upper bound of the SFT points it must beat; > 0 reproduces; None when no
frontier graft learned), and the best margin of a merge that learned, judged by the same yardstick
(`merge_margin`: does interpolating toward the post model's own SFT update do what grafting should?), and
the best margin of a learned frontier graft over OPSD's and over the merge's points of no more new-task
accuracy (`margin_opsd`, `margin_merge`: > 0 beats that baseline beyond the intervals).
Beside them, where a `moe` config is given, the prediction of the grafting paper's §3 model
(`graftlab.analysis.moe.graft_condition`) at the experiment's measured routing (eps_D, eps_P): whether a
graft beats SFT of post near the post model (`moe_wins_small`) and at every new-task loss up to its best
scale (`moe_wins_to_best`), so that what the model predicts and what the world does sit on one row.

Per group: how many seeds reproduce on each split and at how many the §3 model predicts a win, and the
means. A world is chosen on the validation columns; the test columns are what gets reported (no result
is tuned on the held-out problems).
"""

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import polars as pl

from graftlab.analysis.moe import MoeConfig, graft_condition, tasks
from graftlab.analysis.verdict import BASELINES, judge_runs, reproduces
from graftlab.io.atomic import atomic_file

if TYPE_CHECKING:
    from matplotlib.figure import Figure

SPLITS = {"validation": "_val", "test": ""}
# The verdict's columns, each once per split (suffixed `_val` for validation).
OVER = tuple(f"margin_{b}" for b in BASELINES if b != "sft")  # a graft's margins over the other baselines
VERDICT_COLUMNS = ("reproduces", "margin", "merge_margin", *OVER)


def _verdict_columns(summary: pl.DataFrame, screened: pl.DataFrame | None = None) -> dict:
    """Verdict and best margin on each split the summary has scores for (None where it has none); `screened`:
    the experiment's screened-out runs (`graftlab.analysis.verdict`)."""
    out = {}
    for split, suffix in SPLITS.items():
        try:
            verdict = reproduces(summary, split=split, screened=screened)
        except ValueError as err:
            if split == "validation" and "no validation scores" in str(err):
                out |= dict.fromkeys(f"{c}{suffix}" for c in VERDICT_COLUMNS)
                continue
            raise
        # Only a graft that learned the new task can win; another's margin (a graft that kept the old
        # tasks by learning nothing, beside SFT points that forgot first) would read as a near miss.
        margins = [g["margin"] for g in verdict["frontier_grafts"] if g["learned"] and g["margin"] is not None]
        judged = judge_runs(summary, "merge", split, screened)
        merges = [m["margin"] for m in judged if m["learned"] and m["margin"] is not None]
        learned = [g for g in verdict["frontier_grafts"] if g["learned"]]
        over = {f"{c}{suffix}": max((g[c] for g in learned if g[c] is not None), default=None) for c in OVER}
        out |= {
            f"reproduces{suffix}": verdict["reproduces"],
            f"margin{suffix}": max(margins, default=None),
            f"merge_margin{suffix}": max(merges, default=None),
        } | over
    return out


def _takeover_columns(takeover: pl.DataFrame | None) -> dict:
    """Mean takeover (`graftlab.analysis.takeover`) of SFT of post, of the donors' SFT and of the unmasked
    grafts: how far each writes the new task into the old tasks' answers; and the share of new-task
    answers the post model and the donors (as they are) write in an old task's procedure, eps_P and
    eps_D (None where not measured)."""
    rows = {
        "sft": pl.col("method") == "sft",
        "donor_sft": pl.col("method") == "donor_sft",
        "graft": (pl.col("method") == "graft") & (pl.col("mask") == "none"),
    }
    if takeover is None:
        return {f"takeover_{m}": None for m in rows} | {"misrouted_post": None, "misrouted_donor": None}
    misrouted = {f"misrouted_{m}": takeover.filter(method=m)["misrouted"].mean() for m in ("post", "donor")}
    return {f"takeover_{m}": takeover.filter(keep)["takeover"].mean() for m, keep in rows.items()} | misrouted


def _moe_columns(eps_p: float | None, eps_d: float | None, moe: MoeConfig | None) -> dict:
    """The §3 model's verdict at the measured routing. Where eps_P is 0 the post model misroutes nothing
    and where eps_D >= eps_P the donor routes no better: the model predicts no gain (k >= 1, or k undefined
    when every input goes one way, reported as None)."""
    none = {"moe_cos_theta": None, "moe_k": None, "moe_wins_small": None, "moe_wins_to_best": None}
    if moe is None or eps_p is None or eps_d is None:
        return none
    targets, experts = tasks(moe)
    with np.errstate(divide="ignore", invalid="ignore"):
        cond = graft_condition(experts, targets, eps_d, eps_p)
    if not (np.isfinite(cond["k"]) and np.isfinite(cond["cos_theta"])):
        return none | {"moe_wins_small": False, "moe_wins_to_best": False}
    # The conditions are derived for k < 1; at k >= 1 the second can hold (2k / (1 + k^2) < 1 again)
    # though the graft is SFT of post's own route or a worse one.
    cond |= {w: bool(cond[w]) and eps_d < eps_p for w in ("wins_small", "wins_to_best")}
    return {f"moe_{k}": v for k, v in cond.items()}


def experiment_row(
    exp: str,
    group: str,
    seed: int,
    summary: pl.DataFrame,
    drift: pl.DataFrame | None,
    takeover: pl.DataFrame | None = None,
    moe: MoeConfig | None = None,
    screened: pl.DataFrame | None = None,
) -> dict:
    """One experiment's line of the study; `screened`: its adaptive sweeps' screened-out runs."""
    sft = summary.filter(method="sft")
    row = {
        "exp": exp,
        "group": group,
        "seed": seed,
        "post_old": summary.filter(method="post")["old"].max(),
        "sft_best_new": sft["new"].max(),
        "graft_best_new": summary.filter(method="graft")["new"].max(),
    }
    if drift is not None and drift.height:
        row |= {"drift_ratio": drift["drift_ratio"][0], "cos": drift["cos"].mean(), "cos_mlp": drift["cos_mlp"].mean()}
    else:
        row |= {"drift_ratio": None, "cos": None, "cos_mlp": None}
    routing = _takeover_columns(takeover)
    moe_columns = _moe_columns(routing["misrouted_post"], routing["misrouted_donor"], moe)
    return row | routing | moe_columns | _verdict_columns(summary, screened)


def study_tables(experiments: list[dict], moe: MoeConfig | None = None) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(per experiment, per group) from dicts with `exp`, `group`, `seed`, `summary` (parquet path),
    `drift`, `takeover` and `screened` (parquet paths or None); the §3 model's columns from `moe`."""
    rows = []
    for e in experiments:
        drift, takeover, screened = (
            pl.read_parquet(e[k]) if e.get(k) else None for k in ("drift", "takeover", "screened")
        )
        summary = pl.read_parquet(e["summary"])
        rows.append(experiment_row(e["exp"], e["group"], e["seed"], summary, drift, takeover, moe, screened))
    per_exp = pl.DataFrame(rows, infer_schema_length=None).sort("group", "seed")
    counts = [pl.col(c).fill_null(False).sum().alias(c) for c in ("reproduces_val", "reproduces", "moe_wins_to_best")]
    means = [
        pl.col(c).mean().alias(c)
        for c in (
            "drift_ratio",
            "cos",
            "misrouted_post",
            "misrouted_donor",
            "takeover_sft",
            "takeover_donor_sft",
            "takeover_graft",
            "margin_val",
            "margin",
            "merge_margin_val",
            "merge_margin",
            *(f"{c}{suffix}" for c in OVER for suffix in ("_val", "")),
            "sft_best_new",
            "graft_best_new",
        )
    ]
    per_group = per_exp.group_by("group", maintain_order=True).agg(pl.len().alias("seeds"), *counts, *means)
    return per_exp, per_group


def study_figure(per_exp: pl.DataFrame) -> "Figure":
    """Left: each seed's best graft margin per group, validation and test (> 0: reproduces). Middle: the
    weight-space view per experiment, drift ratio against donor/post update cosine. Right: the behaviour,
    drift ratio against takeover of SFT of post, of donor SFT and of unmasked grafts."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(16, 4.8))
    left, middle, right = fig.subplots(1, 3)
    groups = per_exp["group"].unique(maintain_order=True).to_list()
    for offset, (split, suffix, color) in zip(
        (-0.12, 0.12), (("validation", "_val", "tab:gray"), ("test", "", "tab:blue"))
    ):
        pts = per_exp.filter(pl.col(f"margin{suffix}").is_not_null())
        xs = [groups.index(g) + offset for g in pts["group"]]
        left.scatter(xs, pts[f"margin{suffix}"], color=color, label=f"{split} split", s=25)
    left.axhline(0, color="tab:red", lw=1)
    left.set_xticks(range(len(groups)), groups, rotation=20, ha="right", fontsize=8)
    left.set_ylabel("best graft margin over SFT (old-task accuracy)")
    left.set_title("Does a graft beat SFT beyond the intervals? (> 0: yes)")
    left.legend(fontsize=8)
    for g in groups:
        pts = per_exp.filter(group=g).filter(pl.col("drift_ratio").is_not_null())
        middle.scatter(pts["drift_ratio"], pts["cos"], label=g, s=25)
    middle.set_xlabel("drift ratio |post - base| / |base - init|")
    middle.set_ylabel("cosine(donor update, post SFT update)")
    middle.set_title("Weight space per world")
    middle.legend(fontsize=7)
    for column, label, marker in (
        ("takeover_sft", "SFT of post", "o"),
        ("takeover_donor_sft", "donor SFT", "s"),
        ("takeover_graft", "unmasked grafts", "^"),
    ):
        pts = per_exp.filter(pl.col(column).is_not_null() & pl.col("drift_ratio").is_not_null())
        right.scatter(pts["drift_ratio"], pts[column], marker=marker, label=label, s=30, alpha=0.7)
    right.set_xlabel("drift ratio |post - base| / |base - init|")
    right.set_ylabel("old-task answers in the new task's procedure")
    right.set_title("Takeover (implicit task inference), mean per method")
    right.set_ylim(-0.03, 1.03)
    right.legend(fontsize=7)
    for ax in (left, middle, right):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def write_study(
    experiments: list[dict], out_parquet, out_groups, out_png, moe: MoeConfig | None = None
) -> pl.DataFrame:
    """`study_tables` as two parquets and `study_figure` as PNG, each atomic."""
    per_exp, per_group = study_tables(experiments, moe)
    print(per_group)
    for frame, out in ((per_exp, out_parquet), (per_group, out_groups)):
        with atomic_file(out) as tmp:
            frame.write_parquet(tmp)
    with atomic_file(Path(out_png)) as tmp:
        study_figure(per_exp).savefig(tmp, dpi=150, format="png")
    return per_group
