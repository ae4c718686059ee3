"""The sensitive-weight table of an experiment (one row per update, docs/formats.md) and its figure
(docs/methods.md#sensitive-weights). Each row is computed by its own workflow job, torch-free, in
graftlab.analysis.sensitivity_shares, which also defines the measures.
"""

from collections.abc import Iterator
from pathlib import Path

import polars as pl

from graftlab.analysis.pareto import STYLES
from graftlab.analysis.sensitivity_shares import KINDS, tensor_kind
from graftlab.errors import GraftlabError
from graftlab.io.atomic import atomic_file
from graftlab.methods import METHODS as REGISTRY
from graftlab.planning.layout import POST

# KINDS and tensor_kind are read from here by graftlab.analysis.drift too.
__all__ = ["KINDS", "METHODS", "collect_sensitivity", "plot_sensitivity", "tensor_kind"]

# The plot's groups left to right: the baselines (SFT of post, the on-policy methods), the donors' SFT,
# merging, grafting from donors (the registry lists the graft before the merge), then the post model.
_ALL = [m for m in REGISTRY.values() if not m.chain_only]
_GRAFTS = [m for m in _ALL if m.grafts]
_BASELINES = [m for m in _ALL if m.updates and m not in _GRAFTS]
_DONOR_SFT = [m for m in _ALL if m.ingredient and m.keys]
METHODS = (*(m.name for m in _BASELINES + _DONOR_SFT + _GRAFTS[::-1]), POST)


def _style(method: str, masked: bool) -> dict:
    style = {"s": 36, "alpha": 0.85} | {k: v for k, v in STYLES[method].items() if k != "label"}
    if masked and style["marker"] != "x":  # hollow: a Fisher-masked graft, next to its unmasked peers
        style |= {"facecolors": "none", "edgecolors": style.pop("color")}
    return style


def _groups(df: pl.DataFrame) -> Iterator[tuple[int, str, pl.DataFrame]]:
    """(x position, method, its rows) for every method present, in a fixed order."""
    present = [m for m in METHODS if m in set(df["method"].to_list())]
    for x, method in enumerate(present):
        yield x, method, df.filter(pl.col("method") == method)


def _strip(ax, df: pl.DataFrame, column: str, label: str, baseline: float, baseline_label: str) -> None:
    """One column of points per method, spread sideways so equal shares stay visible."""
    from matplotlib.ticker import PercentFormatter

    names = []
    for x, method, rows in _groups(df):
        names.append(STYLES[method]["label"])
        spread = [x + 0.3 * (i / max(1, rows.height - 1) - 0.5) for i in range(rows.height)]
        masked = rows["mask"].fill_null("none") != "none"
        for hollow in (False, True):
            pick = masked == hollow
            ax.scatter([s for s, p in zip(spread, pick) if p], rows[column].filter(pick), **_style(method, hollow))
    ax.axhline(baseline, color="tab:red", ls="--", lw=1.2, label=baseline_label)
    ax.set_xticks(range(len(names)), names, fontsize=8)
    ax.set_xlim(-0.6, len(names) - 0.4)
    ax.set_ylim(-0.03 * ax.get_ylim()[1], ax.get_ylim()[1])  # a masked run's share of 0 stays whole
    ax.set_ylabel(label)
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.grid(axis="y", alpha=0.3)
    ax.legend(loc="best", fontsize=8, framealpha=0.9)


def _rise_vs_share(ax, df: pl.DataFrame) -> None:
    from matplotlib.ticker import PercentFormatter

    for _, method, rows in _groups(df):
        masked = rows["mask"].fill_null("none") != "none"
        for hollow in (False, True):
            pts = rows.filter(masked == hollow)
            ax.scatter(pts["fisher_share"], pts["predicted_rise"], **_style(method, hollow))
    if (df["predicted_rise"] > 0).all():
        ax.set_yscale("log")
    ax.xaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_xlabel("Fisher-weighted share in the top set (left panel)")
    ax.set_ylabel("predicted retention-loss rise  ½ uᵀFu")
    ax.grid(alpha=0.3)


def _method_legend(fig, df: pl.DataFrame) -> None:
    """One legend for all panels, below them, where it hides no point."""
    from matplotlib.lines import Line2D

    handles = [
        Line2D([], [], ls="", marker=STYLES[m]["marker"], color=STYLES[m]["color"], label=STYLES[m]["label"])
        for _, m, _ in _groups(df)
    ]
    handles.append(Line2D([], [], ls="", marker="o", mfc="none", color="0.3", label="Fisher-masked (hollow)"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=9, frameon=False)


def plot_sensitivity(table: str | Path | pl.DataFrame, out_png: str | Path, title: str | None = None) -> None:
    """Three panels: the Fisher-weighted and the plain share in the top set per run, grouped by method,
    each against its no-preference baseline; and the predicted retention-loss rise against the share."""
    # A bare Figure renders through Agg without pyplot (as plot_pareto): no global backend switched.
    from matplotlib.figure import Figure

    df = table if isinstance(table, pl.DataFrame) else pl.read_parquet(table)
    unknown = sorted(set(df["method"].to_list()) - set(STYLES))
    if unknown:
        raise ValueError(f"plot_sensitivity: unknown method(s) {unknown}")
    df = df.filter(pl.col("fisher_share").is_not_null())
    if df.height == 0:
        raise ValueError("plot_sensitivity: no run with a non-zero update to plot")
    top = f"{100 * df['top'][0]:g}%"
    fig = Figure(figsize=(16, 5.5))
    ax_f, ax_sq, ax_rise = fig.subplots(1, 3)
    _strip(ax_f, df, "fisher_share", "share of  uᵀFu", df["fisher_top_mass"][0], "update of equal magnitude everywhere")
    ax_f.set_title(f"Fisher-weighted update in the top {top} of F", fontsize=10)
    _strip(ax_sq, df, "sq_share", "share of  ||u||²", df["top"][0], f"uniform placement ({top})")
    ax_sq.set_title(f"plain squared update in the top {top} of F", fontsize=10)
    _rise_vs_share(ax_rise, df)
    ax_rise.set_title("predicted forgetting against the sensitive share", fontsize=10)
    _method_legend(fig, df)
    fig.suptitle(title or "Update written to the most Fisher-sensitive weights")
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    with atomic_file(out_png) as tmp:
        fig.savefig(tmp, dpi=150, format="png")


def collect_sensitivity(rows: list[str | Path], out_parquet, out_png, title: str | None = None) -> pl.DataFrame:
    """The rows of `write_update_sensitivity` as one table (parquet) and its figure (PNG)."""
    if not rows:
        raise GraftlabError("sensitivity: no updates to collect")
    table = pl.concat([pl.read_parquet(r) for r in rows], how="diagonal_relaxed").sort("run")
    with atomic_file(out_parquet) as tmp:
        table.write_parquet(tmp)
    plot_sensitivity(table, out_png, title)
    return table
