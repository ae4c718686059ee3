"""The Pareto figure: old- against new-task accuracy of every evaluated model of an experiment."""

import os
from pathlib import Path
from typing import TYPE_CHECKING

import polars as pl

from graftlab.analysis.summary import pareto_front

if TYPE_CHECKING:
    from matplotlib.axes import Axes

# One look per method; donor SFTs are drawn faint: they are ingredients of grafts, not candidates.
STYLES = {
    "graft": {"marker": "o", "color": "tab:blue", "label": "graft"},
    "merge": {"marker": "s", "color": "tab:orange", "label": "merge (donor = post)"},
    "sft": {"marker": "^", "color": "tab:green", "label": "SFT of post"},
    "donor_sft": {
        "marker": "x",
        "color": "0.6",
        "alpha": 0.5,
        "s": 18,
        "label": "donor SFT (faint)",
    },
    "post": {"marker": "*", "color": "black", "s": 220, "zorder": 5, "label": "post (reference)"},
}
MAX_FRONT_LABELS = 12


def _front_label(row: dict) -> str:
    """A compact name of a frontier point, e.g. `step~400 lr=1e-3 e2 lam=0.5 diag@0.01`."""
    parts = [row["donor"]] if row["method"] == "graft" else []
    parts += [f"lr={row['lr']}", f"e{row['epoch']}"]
    if row["method"] in ("graft", "merge"):
        parts.append(f"lam={row['lam']}")
        if row["mask"] not in (None, "none"):
            parts.append(f"{row['mask']}@{row['rho']}")
    return " ".join(parts)


def _label_front(ax: "Axes", front: pl.DataFrame) -> None:
    if front.height > MAX_FRONT_LABELS:
        return  # a crowded frontier reads better without labels; the parquet has the runs
    labelled = front.filter(pl.col("method") != "post").iter_rows(named=True)
    for i, row in enumerate(labelled):
        # Neighbours on a staircase sit close in y; alternating above/below keeps labels apart.
        offset = (5, 4) if i % 2 == 0 else (5, -11)
        ax.annotate(
            _front_label(row),
            (row["new"], row["old"]),
            xytext=offset,
            textcoords="offset points",
            fontsize=7,
            color="0.25",
        )


def plot_pareto(
    summary: str | Path | pl.DataFrame, out_png: str | Path, title: str | None = None
) -> None:
    """Scatter new-task (x) against old-task (y) accuracy per method; the frontier as a step line.

    The frontier is taken over every candidate (post, sft, merge, graft); donor SFTs are left out of
    it, since their old-task score belongs to another model line.
    """
    # A bare Figure renders through Agg without pyplot: no global backend is switched and no figure
    # is left registered in a notebook or a long-lived process.
    from matplotlib.figure import Figure

    df = summary if isinstance(summary, pl.DataFrame) else pl.read_parquet(summary)
    unknown = sorted(set(df["method"].to_list()) - set(STYLES))
    if unknown:
        raise ValueError(f"plot_pareto: unknown method(s) {unknown}")
    df = df.filter(pl.col("new").is_not_null() & pl.col("old").is_not_null())
    cands = pareto_front(df.filter(pl.col("method") != "donor_sft"))
    if cands.height == 0:
        raise ValueError("plot_pareto: no run with both old and new scores to plot")
    front = cands.filter("on_front").sort("new", -pl.col("old"))

    fig = Figure(figsize=(7, 5.5))
    ax = fig.add_subplot()
    ax.step(
        front["new"],
        front["old"],
        where="pre",
        color="tab:red",
        lw=1.5,
        alpha=0.8,
        label="Pareto frontier",
        zorder=4,
    )
    for method, style in STYLES.items():
        pts = df.filter(pl.col("method") == method)
        if pts.height:
            ax.scatter(pts["new"], pts["old"], **({"s": 40, "alpha": 0.85, "zorder": 3} | style))
    _label_front(ax, front)
    ax.set_xlabel("new-task accuracy (Acc@n)")
    ax.set_ylabel("old-task accuracy (mean Acc@n over old benchmarks)")
    ax.set_title(title or "Old vs new task accuracy")
    ax.grid(alpha=0.3)
    ax.margins(0.06)
    ax.legend(loc="best", fontsize=8, framealpha=0.9)
    fig.tight_layout()
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    fig.savefig(tmp, dpi=150, format="png")
    os.replace(tmp, out)
