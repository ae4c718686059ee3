"""Staged continual post-training (issue 17): every method's chain of models, one per stage (stage s trained
on domain s, starting from the stage s − 1 model), each scored on every domain's benchmark and the old
tasks, against the starting model (stage 0).

For each method, stage and benchmark the table gives the accuracy (`acc@n` of the stage's metrics.json,
with its bootstrap interval) and its change against the starting model's accuracy acc₀ on that benchmark,
with the arithmetic of single-domain gain and forgetting (`graftlab.analysis.gain_forgetting`):

    Δ = acc − acc₀,   δ = Δ / acc₀,   gain G = max(δ, 0),   forgetting F = max(−δ, 0)

δ, G and F are null where acc₀ = 0 (a domain the starting model never solves) or where the starting model
was not scored on the benchmark; Δ is null only in the latter case.

Stage averages: per method and stage, the mean accuracy over every benchmark, the mean forgetting over
the benchmarks where it is defined, and the mean accuracy over the benchmarks *seen* by then (the old
tasks and the domains of stages 1..s): what the model should still know.

Light at import: matplotlib loads inside the plotting functions.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import polars as pl

from graftlab.analysis.gain_forgetting import relative_change
from graftlab.io.atomic import atomic_file

# The table's columns, in order: the leading ones the issue fixes, then the stage's domain and the
# benchmark's role (as its metrics.json gives it: `old` for the retained tasks).
COLUMNS = (
    "method",
    "stage",
    "benchmark",
    "acc",
    "acc_lo",
    "acc_hi",
    "base_acc",
    "delta",
    "rel_delta",
    "gain",
    "forgetting",
    "domain",
    "role",
)
SCHEMA = {
    "method": pl.String,
    "stage": pl.Int64,
    "benchmark": pl.String,
    "acc": pl.Float64,
    "acc_lo": pl.Float64,
    "acc_hi": pl.Float64,
    "base_acc": pl.Float64,
    "domain": pl.String,
    "role": pl.String,
}
AVERAGE_COLUMNS = ("method", "stage", "avg_acc", "avg_forgetting", "avg_acc_seen")
OLD_ROLE = "old"


def _metrics(source: str | Path | Mapping) -> Mapping:
    """A metrics.json, from its path or already loaded."""
    if isinstance(source, Mapping):
        return source
    return json.loads(Path(source).read_text())


def _benchmarks(metrics: Mapping, where: str) -> Mapping[str, Mapping]:
    benches = metrics.get("benchmarks")
    if not isinstance(benches, Mapping) or not benches:
        raise ValueError(f"continual: {where} has no benchmarks in its metrics.json")
    return benches


def continual_table(models: Sequence[Mapping], base_metrics: str | Path | Mapping) -> pl.DataFrame:
    """One row per method × stage × benchmark scored, with the columns `COLUMNS` (module docstring).

    `models`: `{"method", "stage", "domain", "metrics"}` each, `metrics` the path of the stage model's
    metrics.json (or the loaded dict); `base_metrics` the starting model's. Rows keep the order of
    `models`, benchmarks within a model the order of its metrics.json."""
    base = {b: m.get("acc@n") for b, m in _benchmarks(_metrics(base_metrics), "the starting model").items()}
    rows, seen = [], set()
    for model in models:
        method, stage, domain = model["method"], model["stage"], model["domain"]
        if isinstance(stage, bool) or not isinstance(stage, int):
            raise ValueError(f"continual: {method} has a stage that is not an integer: {stage!r}")
        if (method, stage) in seen:
            raise ValueError(f"continual: {method} stage {stage} given twice")
        seen.add((method, stage))
        for bench, scores in _benchmarks(_metrics(model["metrics"]), f"{method} stage {stage}").items():
            rows.append(
                {
                    "method": method,
                    "stage": stage,
                    "benchmark": bench,
                    "acc": scores["acc@n"],
                    # Metrics written before intervals existed have no bounds: null.
                    "acc_lo": scores.get("acc@n_lo"),
                    "acc_hi": scores.get("acc@n_hi"),
                    "base_acc": base.get(bench),
                    "domain": domain,
                    "role": scores.get("role"),
                }
            )
    return pl.DataFrame(rows, schema=SCHEMA).pipe(relative_change).select(COLUMNS)


def stage_domains(table: pl.DataFrame) -> dict[int, str]:
    """{stage: domain}, the same for every method of the table (refused where two methods disagree)."""
    pairs = table.select("stage", "domain").unique()
    domains = {}
    for stage, domain in pairs.sort("stage", "domain").iter_rows():
        if stage in domains:
            raise ValueError(f"continual: stage {stage} trains on {domains[stage]!r} and on {domain!r}")
        domains[stage] = domain
    return domains


def stage_averages(table: pl.DataFrame) -> pl.DataFrame:
    """Per method and stage (`AVERAGE_COLUMNS`): `avg_acc`, the mean accuracy over the stage's benchmarks;
    `avg_forgetting`, the mean forgetting over those where it is defined (null if none is); `avg_acc_seen`,
    the mean accuracy over the benchmarks seen by then: those whose role is `old` or whose name is the
    domain of a stage ≤ this one (null if none is scored). Methods in table order, stages ascending."""
    domains = stage_domains(table)
    # (stage, benchmark) for every domain trained by a stage up to this one.
    trained = pl.DataFrame(
        [(s, d, True) for s in domains for t, d in domains.items() if t <= s],
        schema={"stage": pl.Int64, "benchmark": pl.String, "trained": pl.Boolean},
        orient="row",
    ).unique()  # a domain trained at two stages is one benchmark seen
    marked = table.join(trained, on=["stage", "benchmark"], how="left").with_columns(
        (pl.col("trained").fill_null(False) | (pl.col("role") == OLD_ROLE).fill_null(False)).alias("is_seen")
    )
    return (
        marked.group_by("method", "stage", maintain_order=True)
        .agg(
            pl.col("acc").mean().alias("avg_acc"),
            pl.col("forgetting").mean().alias("avg_forgetting"),
            pl.col("acc").filter(pl.col("is_seen")).mean().alias("avg_acc_seen"),
        )
        .with_columns(pl.col("method").cast(pl.Enum(_methods(table))).alias("_order"))
        .sort("_order", "stage")
        .select(AVERAGE_COLUMNS)
    )


def write_continual(
    models: Sequence[Mapping],
    base_metrics: str | Path | Mapping,
    out_table: str | Path,
    out_averages: str | Path,
) -> tuple[pl.DataFrame, pl.DataFrame]:
    """`continual_table` and its `stage_averages` as parquet, each atomically; returns both."""
    table = continual_table(models, base_metrics)
    averages = stage_averages(table)
    with atomic_file(out_table) as tmp:
        table.write_parquet(tmp)
    with atomic_file(out_averages) as tmp:
        averages.write_parquet(tmp)
    return table, averages


def _methods(table: pl.DataFrame) -> list[str]:
    return table["method"].unique(maintain_order=True).to_list()


def _benches(table: pl.DataFrame) -> list[tuple[str, str | None, float | None]]:
    """(benchmark, role, acc₀) in table order."""
    return table.unique("benchmark", maintain_order=True).select("benchmark", "role", "base_acc").rows()


def _stage_label(stage: int, domains: Mapping[int, str]) -> str:
    return "0\nbase" if stage == 0 else f"{stage}\n{domains.get(stage, '')}"


def _save(fig, png: str | Path) -> None:
    with atomic_file(png) as tmp:
        fig.savefig(tmp, dpi=120, format="png")


def _colours(n: int) -> list:
    from matplotlib import colormaps

    cmap = colormaps["tab10" if n <= 10 else "tab20"]
    return [cmap(i % cmap.N) for i in range(n)]


def plot_accuracy(table: pl.DataFrame, out_png: str | Path) -> None:
    """One panel per benchmark: accuracy against stage, one line per method with its 95% interval as
    error bars (methods spread a little along the stage axis so bars do not hide one another), all lines
    starting from the starting model's accuracy at stage 0. The stage whose domain the benchmark is is
    shaded. Written as a PNG, atomically."""
    from matplotlib.figure import Figure

    methods, benches, domains = _methods(table), _benches(table), stage_domains(table)
    if not benches:
        raise ValueError("plot_accuracy: the table has no rows")
    stages = sorted(domains)
    cols = min(3, len(benches))
    rows = math.ceil(len(benches) / cols)
    fig = Figure(figsize=(4.2 * cols + 1.8, 3.0 * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    colours = _colours(len(methods))
    spread = 0.3 / max(len(methods) - 1, 1)
    for ax, (bench, role, base) in zip(axes, benches):
        for stage, domain in domains.items():
            if domain == bench:
                ax.axvspan(stage - 0.45, stage + 0.45, color="0.92", zorder=0)
        for i, method in enumerate(methods):
            part = table.filter(method=method, benchmark=bench).sort("stage")
            offset = (i - (len(methods) - 1) / 2) * spread if len(methods) > 1 else 0.0
            x = [s + offset for s in part["stage"]]
            acc = part["acc"].to_list()
            lo = [a - v if v is not None else 0.0 for a, v in zip(acc, part["acc_lo"])]
            hi = [v - a if v is not None else 0.0 for a, v in zip(acc, part["acc_hi"])]
            if base is not None:
                ax.plot([0, x[0]] if x else [], [base, acc[0]] if acc else [], color=colours[i], lw=1)
            ax.errorbar(x, acc, yerr=[lo, hi], color=colours[i], lw=1, marker=".", capsize=2, label=method)
        if base is not None:
            ax.plot([0], [base], marker="*", color="k", ms=8, ls="none", zorder=3)
        ax.set_title(f"{bench} ({role})" if role else bench, fontsize=9)
        ax.set_xticks([0, *stages], [_stage_label(s, domains) for s in [0, *stages]], fontsize=7)
        ax.set_ylim(-0.03, 1.03)
        ax.set_ylabel("acc@n", fontsize=8)
        ax.tick_params(labelsize=7)
    for ax in axes[len(benches) :]:
        ax.axis("off")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside right upper", fontsize=7, title="method (★ start)", title_fontsize=7)
    fig.suptitle("Accuracy after each stage (shaded: the stage that trains on the benchmark's domain)", fontsize=10)
    _save(fig, out_png)


def plot_heatmaps(table: pl.DataFrame, out_png: str | Path) -> None:
    """One stage × benchmark heatmap of accuracy per method (small multiples on one colour scale, 0 to 1),
    each cell annotated with its value; row 0 is the starting model, the same in every panel. Cells a
    method has no score for are grey. Written as a PNG, atomically."""
    import numpy as np
    from matplotlib import colormaps
    from matplotlib.colors import Normalize
    from matplotlib.figure import Figure

    methods, benches, domains = _methods(table), _benches(table), stage_domains(table)
    if not methods:
        raise ValueError("plot_heatmaps: the table has no rows")
    stages = [0, *sorted(domains)]
    names = [b for b, _, _ in benches]
    cols = min(3, len(methods))
    rows = math.ceil(len(methods) / cols)
    fig = Figure(
        figsize=(1.0 + (0.9 * len(names) + 1.2) * cols, (0.45 * len(stages) + 1.4) * rows), layout="constrained"
    )
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    cmap, norm = colormaps["viridis"].with_extremes(bad="0.85"), Normalize(0.0, 1.0)
    image = None
    for ax, method in zip(axes, methods):
        cells = {(s, b): a for s, b, a in table.filter(method=method).select("stage", "benchmark", "acc").iter_rows()}
        cells |= {(0, b): base for b, _, base in benches}
        grid = np.array([[cells.get((s, b)) for b in names] for s in stages], dtype=float)  # None -> nan
        image = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, norm=norm, aspect="auto")
        for (i, j), value in np.ndenumerate(grid):
            if np.isfinite(value):
                ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=7, color="k" if value > 0.6 else "w")
        ax.axhline(0.5, color="w", lw=1.5)  # the starting model apart from the stages
        ax.set_title(method, fontsize=9)
        ax.set_xticks(range(len(names)), names, fontsize=7, rotation=30, ha="right")
        ax.set_yticks(range(len(stages)), [_stage_label(s, domains).replace("\n", " ") for s in stages], fontsize=7)
    for ax in axes[len(methods) :]:
        ax.axis("off")
    fig.colorbar(image, ax=axes.tolist(), label="acc@n", shrink=0.8)
    fig.suptitle("Accuracy per stage (rows) and benchmark (columns), one panel per method", fontsize=10)
    _save(fig, out_png)
