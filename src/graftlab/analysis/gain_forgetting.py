"""Single-domain gain and forgetting, as *Denser ≠ Better* (Wang et al., arXiv 2607.01763) defines them.

For each run of an experiment and each benchmark, against the starting model (the summary's `post` row,
accuracy acc₀):

    Δ = acc − acc₀,   δ = Δ / acc₀,   gain G = max(δ, 0),   forgetting F = max(−δ, 0)

so G and F are never both positive, and F = 1 is a benchmark forgotten entirely. Where acc₀ = 0 (typical
of the new task: its problems were mined as ones the post model fails) δ, G and F are undefined: the
table keeps Δ, leaves them null and says so in `note`.

Rows are runs that update the post model (sft, graft, merge, opsd, and any newer method); the post
model itself (Δ = 0 by definition) and the ingredients of grafts (`donor`, `donor_sft`: another model
line, `graftlab.analysis.summary.INGREDIENTS`) are left out. A run not scored on a benchmark has no row
for it.

The summary does not record which benchmarks are old and which new (only their means, `old` and `new`):
the workflow passes the roles from the experiment's layout; without them they are inferred from `new`.
"""

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import polars as pl

from graftlab.analysis.summary import INGREDIENTS
from graftlab.io.atomic import atomic_file
from graftlab.methods import METHODS

if TYPE_CHECKING:
    from matplotlib.figure import Figure

EXCLUDED = ("post", *INGREDIENTS)
# String columns of the summary that are not keys: the run's own ids (first in the table) and the data
# the experiment learned from (the same on every row).
NOT_KEYS = ("exp", "run", "method", "data")
ZERO_BASE = "acc0 = 0: delta is absolute; rel_delta, gain, forgetting undefined"
NO_BASE = "post model not scored on this benchmark"
# Heatmap rows in this order; a method not listed follows, alphabetically.
METHOD_ORDER = tuple(m.name for m in METHODS.values() if m.updates)
SCORES = ("acc", "acc_lo", "acc_hi")
MEASURES = ("base_acc", "delta", "rel_delta", "gain", "forgetting", "note")
# The table's columns that are not a run's keys.
FIXED = ("exp", "run", "method", "benchmark", "role", *SCORES, *MEASURES)


def benchmarks(summary: pl.DataFrame) -> list[str]:
    """Benchmark names, from the `{bench}_acc` columns in summary order (not `_acc_lo`, `pass@k`, old/new)."""
    return [c.removesuffix("_acc") for c in summary.columns if c.endswith("_acc") and len(c) > 4]


def infer_roles(summary: pl.DataFrame) -> dict[str, str]:
    """{bench: "old" | "new"}: the one benchmark whose accuracy equals the summary's `new` on every run
    is new, the others old. The workflow's experiments have exactly one new benchmark; any other case
    (none or several matching) needs the roles given."""
    benches = benchmarks(summary)
    if "new" not in summary.columns:
        raise ValueError("gain_forgetting: no `new` column to infer benchmark roles from; pass roles")

    def is_new(bench: str) -> bool:
        gap = summary.select((pl.col(f"{bench}_acc") - pl.col("new")).abs()).to_series().drop_nulls()
        return gap.len() > 0 and bool((gap <= 1e-12).all())

    new = [b for b in benches if is_new(b)]
    if len(new) != 1:
        raise ValueError(f"gain_forgetting: cannot tell the new benchmark among {benches} (matches: {new}); pass roles")
    return {b: "new" if b == new[0] else "old" for b in benches}


def key_columns(summary: pl.DataFrame) -> list[str]:
    """The summary's id and key columns after exp/run/method: donor, lr, epoch, ..., alpha, teacher,
    step, whatever its runs' paths carried (all strings, as written in the config)."""
    return [c for c, t in summary.schema.items() if t == pl.String and c not in NOT_KEYS]


def _base(summary: pl.DataFrame, benches: list[str]) -> dict[str, float | None]:
    """acc₀ per benchmark: the accuracy of the summary's one `post` run."""
    post = summary.filter(pl.col("method") == "post")
    if post.height != 1:
        raise ValueError(f"gain_forgetting: need exactly one `post` run as the starting model, found {post.height}")
    return {b: post[f"{b}_acc"].item() for b in benches}


def _long(summary: pl.DataFrame, roles: dict[str, str], ids: list[str]) -> pl.DataFrame:
    """One row per run × benchmark with the run's ids, the benchmark, its role and acc with interval."""
    parts = []
    for bench, role in roles.items():
        # A summary written before intervals existed has no `_lo`/`_hi` columns: null bounds.
        scores = [
            (pl.col(f"{bench}_{s}") if f"{bench}_{s}" in summary.columns else pl.lit(None)).cast(pl.Float64).alias(s)
            for s in SCORES
        ]
        parts.append(summary.select(*ids, pl.lit(bench).alias("benchmark"), pl.lit(role).alias("role"), *scores))
    return pl.concat(parts).filter(pl.col("acc").is_not_null())


def gain_forgetting(summary: pl.DataFrame, roles: dict[str, str] | None = None) -> pl.DataFrame:
    """One row per run × benchmark: exp, run, method, every key column, benchmark, role, acc, acc_lo,
    acc_hi, base_acc (acc₀), delta (Δ), rel_delta (δ, a fraction), gain, forgetting, note (module
    docstring). `roles` {bench: "old" | "new"} must name exactly the summary's benchmarks."""
    benches = benchmarks(summary)
    roles = dict(roles) if roles is not None else infer_roles(summary)
    if set(roles) != set(benches):
        raise ValueError(f"gain_forgetting: roles name {sorted(roles)}, the summary scores {sorted(benches)}")
    if bad := {r for r in roles.values()} - {"old", "new"}:
        raise ValueError(f"gain_forgetting: roles must be old or new, got {sorted(bad)}")
    # Old benchmarks first, each role in summary order: the order the figure reads in.
    roles = {b: roles[b] for r in ("old", "new") for b in benches if roles[b] == r}
    base = _base(summary, benches)
    ids = [c for c in ("exp", "run", "method") if c in summary.columns] + key_columns(summary)
    runs = summary.filter(~pl.col("method").is_in(EXCLUDED))
    base_acc = pl.col("benchmark").replace_strict(base, return_dtype=pl.Float64)
    return (
        _long(runs, roles, ids)
        .with_columns(base_acc.alias("base_acc"))
        .pipe(relative_change)
        .with_columns(
            pl.when(pl.col("base_acc").is_null())
            .then(pl.lit(NO_BASE))
            .when(pl.col("base_acc") == 0)
            .then(pl.lit(ZERO_BASE))
            .alias("note"),
        )
    )


def relative_change(frame: pl.DataFrame) -> pl.DataFrame:
    """`frame`, which holds `acc` and `base_acc` (acc₀), with `delta` (Δ), `rel_delta` (δ, null where acc₀
    is 0 or null), `gain` and `forgetting` (null where δ is) added after its columns, in that order: the
    arithmetic of the module docstring, shared with the staged tables of `graftlab.analysis.continual`."""
    rel = pl.col("rel_delta")
    return (
        frame.with_columns((pl.col("acc") - pl.col("base_acc")).alias("delta"))
        .with_columns(pl.when(pl.col("base_acc") > 0).then(pl.col("delta") / pl.col("base_acc")).alias("rel_delta"))
        # when/otherwise, not clip: an exact 0.0 where nothing changed, never a -0.0 forgetting.
        .with_columns(
            pl.when(rel > 0).then(rel).otherwise(pl.when(rel.is_not_null()).then(0.0)).alias("gain"),
            pl.when(rel < 0).then(-rel).otherwise(pl.when(rel.is_not_null()).then(0.0)).alias("forgetting"),
        )
    )


def shown_runs(table: pl.DataFrame) -> pl.DataFrame:
    """The rows of each method's shown run: the one with the highest new-task accuracy (mean over the
    new benchmarks), ties to the higher old-task mean, then to the first run by name. The heatmap asks
    what learning the new task cost each method, so it shows the run that learned it best; with many
    runs tied at zero new-task accuracy, the tie goes to the one that kept most."""
    means = table.group_by("method", "run").agg(
        pl.col("acc").filter(pl.col("role") == r).mean().alias(r) for r in ("new", "old")
    )
    best = (
        means.sort(["new", "old", "run"], descending=[True, True, False], nulls_last=True)
        .group_by("method", maintain_order=True)
        .first()
    )
    return table.join(best.select("run"), on="run", how="semi")


def _method_order(methods: list[str]) -> list[str]:
    return [m for m in METHOD_ORDER if m in methods] + sorted(set(methods) - set(METHOD_ORDER))


def _run_label(row: dict, keys: list[str]) -> str:
    """`method` over its non-null keys, e.g. `graft` / `step~400 lr=3e-3 epoch=6 lam=0.5 ...`."""
    parts = [f"{k}={row[k]}" if k != "donor" else str(row[k]) for k in keys if row.get(k) is not None]
    return f"{row['method']}\n{' '.join(parts)}"


def _cell_text(cell: dict) -> str:
    """δ in percent; where acc₀ = 0 the absolute Δ in points, marked as such."""
    if cell["rel_delta"] is not None:
        return f"δ {100 * cell['rel_delta']:+.0f}%\nacc {cell['acc']:.2f}"
    if cell["delta"] is not None:
        return f"Δ {100 * cell['delta']:+.1f} pp\n(abs., acc₀=0)"
    return "no acc₀"


def heatmap_figure(table: pl.DataFrame, title: str | None = None) -> "Figure":
    """Method × benchmark heatmap of δ (percent) for each method's shown run (`shown_runs`): blue is
    gain, red forgetting, grey where δ is undefined (acc₀ = 0: the cell gives Δ in points instead). Red
    saturates at -100% (all forgotten), blue at +100% or the largest gain shown, whichever is larger:
    one gain of +900% from a tiny acc₀ must not wash every forgetting out to white."""
    from matplotlib.colors import TwoSlopeNorm
    from matplotlib.figure import Figure

    shown = shown_runs(table)
    if shown.height == 0:
        raise ValueError("plot_heatmap: no run to show (the table has no sft, graft, merge, opsd, ... rows)")
    methods = _method_order(shown["method"].unique().to_list())
    benches = table.unique("benchmark", maintain_order=True).select("benchmark", "role", "base_acc").rows()
    cells = {(r["method"], r["benchmark"]): r for r in shown.iter_rows(named=True)}
    grid = [[cells.get((m, b)) for b, _, _ in benches] for m in methods]
    pct = np.array(
        [[np.nan if c is None or c["rel_delta"] is None else 100 * c["rel_delta"] for c in row] for row in grid]
    )
    norm = TwoSlopeNorm(vmin=-100, vcenter=0, vmax=max(100.0, np.nanmax(pct, initial=0.0)))
    # Constrained layout makes room for the long run labels on the left and the colour bar's label.
    fig = Figure(figsize=(4.0 + 1.5 * len(benches), 1.6 + 0.75 * len(methods)), layout="constrained")
    ax = fig.add_subplot()
    image = ax.imshow(np.ma.masked_invalid(pct), cmap=_colormap(), norm=norm, aspect="auto")
    for (i, j), cell in np.ndenumerate(np.array(grid, dtype=object)):
        if cell is not None:
            # White text where the colour is deep, black elsewhere (grey cells included).
            dark = np.isfinite(pct[i, j]) and abs(norm(pct[i, j]) - 0.5) > 0.35
            ax.text(j, i, _cell_text(cell), ha="center", va="center", fontsize=7, color="w" if dark else "k")
    keys = [c for c in table.columns if c not in FIXED]
    labels = {r["method"]: _run_label(r, keys) for r in shown.unique("method").iter_rows(named=True)}
    ax.set_yticks(range(len(methods)), [labels[m] for m in methods], fontsize=7)
    ax.set_xticks(range(len(benches)), [_bench_label(*b) for b in benches], fontsize=8)
    fig.colorbar(image, ax=ax, label="δ = Δ / acc₀ (%): forgetting < 0 < gain")
    ax.set_title(title or "Gain and forgetting against the post model", fontsize=10)
    return fig


def _bench_label(bench: str, role: str, base: float | None) -> str:
    return f"{bench} ({role})\nacc₀ = {'—' if base is None else f'{base:.2f}'}"


def _colormap():
    """Red (forgetting) to blue (gain); undefined cells light grey, apart from every colour of the map."""
    from matplotlib import colormaps

    return colormaps["RdBu"].with_extremes(bad="0.85")


def plot_heatmap(table: pl.DataFrame, png: str | Path, title: str | None = None) -> None:
    """`heatmap_figure` written as a PNG, atomically."""
    fig = heatmap_figure(table, title)
    with atomic_file(png) as tmp:
        fig.savefig(tmp, dpi=150, format="png")


def write_gain_forgetting(
    summary_path: str | Path,
    parquet_out: str | Path,
    png_out: str | Path,
    roles: dict[str, str] | None = None,
    title: str | None = None,
) -> pl.DataFrame:
    """The table of `gain_forgetting` as parquet and its heatmap as PNG, both atomically."""
    summary = pl.read_parquet(summary_path)
    table = gain_forgetting(summary, roles)
    with atomic_file(parquet_out) as tmp:
        table.write_parquet(tmp)
    if title is None and "exp" in summary.columns and summary.height:
        title = f"{summary['exp'][0]}: gain and forgetting against the post model (best new-task run per method)"
    plot_heatmap(table, png_out, title)
    return table
