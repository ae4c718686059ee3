"""The Pareto figure: old- against new-task accuracy of every evaluated model of an experiment.

Colour says the method; for grafts and merges the marker also says the Fisher mask, masked runs drawn
hollow in their method's colour, so a masked graft sits visibly beside its unmasked twin. Every point
with bootstrap intervals (`new_lo`, `new_hi`, `old_lo`, `old_hi` in the summary) carries them as thin,
pale error bars on both axes.
"""

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import polars as pl

from graftlab.analysis.summary import INGREDIENTS, pareto_front
from graftlab.evaluate.metrics import INTERVAL
from graftlab.io.atomic import atomic_file
from graftlab.methods import METHODS

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

# One look per method (`graftlab.methods`); donors and their SFTs are drawn faint: ingredients of grafts,
# not candidates.
STYLES = {m.name: m.style | {"label": m.label} for m in METHODS.values() if m.style}
# Hollow markers per mask kind; a kind not listed here (a new one) takes the next spare marker.
MASK_MARKERS = {"diag": "D", "kfac": "P"}
SPARE_MARKERS = ("v", "<", ">", "h", "p")
MAX_FRONT_LABELS = 12
# Thin and pale, below the markers: with ~60 points the bars must not hide where the points are.
ERRORBAR = {"fmt": "none", "elinewidth": 0.6, "alpha": 0.3, "capsize": 0, "zorder": 2}


def _front_label(row: dict) -> str:
    """A compact name of a frontier point, e.g. `step~400 lr=1e-3 e2 lam=0.5 diag@0.01`."""
    method = METHODS[row["method"]]
    if method.on_policy:  # e.g. `OPSD alpha=0.5 lr=1e-4 s60`
        keys = [f"{k}={row.get(k)}" for k in method.spec.keys]
        return " ".join([method.short, *keys, f"s{row.get('step')}"])
    parts = [row["donor"]] if row["method"] == "graft" else []
    parts += [f"lr={row['lr']}", f"e{row['epoch']}"]
    if method.grafts:
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


def _series(df: pl.DataFrame) -> list[tuple[pl.DataFrame, dict]]:
    """(points, scatter keywords) per method, and per mask kind within a method."""
    mask = pl.col("mask").fill_null("none") if "mask" in df.columns else pl.lit("none")
    df = df.with_columns(mask.alias("_mask"))
    kinds = sorted(set(df["_mask"].to_list()) - {"none"})
    spare = iter(SPARE_MARKERS * len(kinds))
    markers = {k: MASK_MARKERS[k] if k in MASK_MARKERS else next(spare) for k in kinds}
    series = []
    for method, style in STYLES.items():
        pts = df.filter(pl.col("method") == method)
        plain = pts.filter(pl.col("_mask") == "none")
        if plain.height:
            series.append((plain, {"s": 40, "alpha": 0.85, "zorder": 3} | style))
        for kind in kinds:
            masked = pts.filter(pl.col("_mask") == kind)
            if masked.height:
                hollow = {"facecolors": "none", "edgecolors": style["color"], "linewidths": 1.3}
                label = f"{method} + {kind} mask"
                series.append(
                    (masked, {"s": 40, "alpha": 0.9, "zorder": 3, "marker": markers[kind], "label": label} | hollow)
                )
    return series


def _error_bars(ax: "Axes", pts: pl.DataFrame, style: dict) -> bool:
    """Both axes' intervals of the points that have them, in the series' colour; whether any were drawn."""
    bounds = ("new_lo", "new_hi", "old_lo", "old_hi")
    if not set(bounds) <= set(pts.columns):
        return False  # a summary written before intervals existed
    pts = pts.drop_nulls(list(bounds))
    if pts.height == 0:
        return False
    x, y = pts["new"].to_numpy(), pts["old"].to_numpy()
    # Clipped at zero: matplotlib refuses a negative extent, which a bound rounded past its point
    # would give; a bar never needs to point the wrong way.
    xerr = np.clip([x - pts["new_lo"].to_numpy(), pts["new_hi"].to_numpy() - x], 0, None)
    yerr = np.clip([y - pts["old_lo"].to_numpy(), pts["old_hi"].to_numpy() - y], 0, None)
    # Hollow (masked) series carry their colour as the edge colour.
    ax.errorbar(x, y, xerr=xerr, yerr=yerr, ecolor=style.get("color", style.get("edgecolors")), **ERRORBAR)
    return True


def pareto_figure(summary: str | Path | pl.DataFrame, title: str | None = None) -> "Figure":
    """Scatter new-task (x) against old-task (y) accuracy per method and mask; the frontier as a step line.

    The frontier is taken over every candidate (post, sft, merge, graft, masked or not); donors and their
    SFTs are left out of it, since their old-task score belongs to another model line.
    """
    # A bare Figure renders through Agg without pyplot: no global backend is switched and no figure
    # is left registered in a notebook or a long-lived process.
    from matplotlib.figure import Figure

    df = summary if isinstance(summary, pl.DataFrame) else pl.read_parquet(summary)
    unknown = sorted(set(df["method"].to_list()) - set(STYLES))
    if unknown:
        raise ValueError(f"plot_pareto: unknown method(s) {unknown}")
    df = df.filter(pl.col("new").is_not_null() & pl.col("old").is_not_null())
    cands = pareto_front(df.filter(~pl.col("method").is_in(INGREDIENTS)))
    if cands.height == 0:
        raise ValueError("plot_pareto: no run with both old and new scores to plot")
    front = cands.filter("on_front").sort("new", -pl.col("old"))

    fig = Figure(figsize=(7, 5.5))
    ax = fig.add_subplot()
    ax.step(
        front["new"], front["old"], where="pre", color="tab:red", lw=1.5, alpha=0.8, label="Pareto frontier", zorder=4
    )
    barred = False
    for pts, style in _series(df):
        barred |= _error_bars(ax, pts, style)
        ax.scatter(pts["new"], pts["old"], **style)
    if barred:  # one legend entry says what the bars are; an empty line draws nothing
        ax.plot([], [], color="0.4", lw=ERRORBAR["elinewidth"], label=f"{INTERVAL['level']:.0%} bootstrap interval")
    _label_front(ax, front)
    ax.set_xlabel("new-task accuracy (Acc@n)")
    ax.set_ylabel("old-task accuracy (mean Acc@n over old benchmarks)")
    ax.set_title(title or "Old vs new task accuracy")
    ax.grid(alpha=0.3)
    ax.margins(0.06)
    ax.legend(loc="best", fontsize=8, framealpha=0.9)
    fig.tight_layout()
    return fig


def data_title(exp: str, summary: pl.DataFrame) -> str:
    """`{exp} ({data}): N traces of M problems`, with the skipped counts when any were skipped."""
    if "data" not in summary.columns:
        return f"{exp}: grafting vs SFT vs merging"
    row = summary.row(0, named=True)
    title = f"{exp} ({row['data']}): {row['data_traces']} traces of {row['data_problems']} problems"
    skipped = [f"{row['data_skipped']} without a trace"] if row["data_skipped"] else []
    skipped += [f"{row['data_rows_skipped']} data rows skipped"] if row["data_rows_skipped"] else []
    return title + (f" ({', '.join(skipped)})" if skipped else "")


def plot_pareto(summary: str | Path | pl.DataFrame, out_png: str | Path, title: str | None = None) -> None:
    """`pareto_figure` written as a PNG, atomically."""
    fig = pareto_figure(summary, title)
    with atomic_file(out_png) as tmp:
        fig.savefig(tmp, dpi=150, format="png")
