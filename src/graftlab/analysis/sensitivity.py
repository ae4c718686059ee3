"""Sensitive-weight analysis (grafting paper §7, docs/methods.md#sensitive-weights): how much of an update lands on the
coordinates the post model's retention is most sensitive to.

For an update `u` (an SFT checkpoint minus post, or a grafted model minus post, i.e. `lam * P(delta)`)
and the post model's diagonal retention Fisher `F`, the top set T holds the `round(top * N)` coordinates
of largest `F`, ranked globally over all N float parameters. Per update the table reports

    fisher_share   sum_T F u^2 / sum F u^2      share of the predicted retention-loss rise written to T
    sq_share       sum_T u^2 / sum u^2          the same for the plain squared norm (uniform placement: top)
    predicted_rise 1/2 u^T F u                  the predicted rise of the retention loss
    update_norm    ||u||_2
    fisher_top_mass sum_T F / sum F             what fisher_share would be for an update of equal
                                                magnitude everywhere (a property of F, equal on every row)
    fisher_share_{kind}                         sum over T and one kind of tensor, over sum F u^2;
                                                the kinds add up to fisher_share

Ties at the threshold are counted fractionally (each tied coordinate weighs the share of the ties that
fits into T), which is the expectation over random tie-breaking and keeps the result independent of
tensor order; a Fisher with many exact zeros makes such ties common.

Memory: the Fisher is held (fp32, the size of one model); the threshold is found without a second copy
(bisection on the bit pattern, below); models are streamed one tensor at a time, never two whole.
"""

from collections.abc import Iterator, Mapping
from pathlib import Path

import polars as pl
import torch

from graftlab.analysis.pareto import STYLES
from graftlab.atomic import atomic_file
from graftlab.errors import GraftlabError
from graftlab.fisher.masks import load_diag_fisher
from graftlab.layout import parse_run
from graftlab.safetensors_io import open_tensors, spec_differences, tensor_specs

KINDS = ("attention", "mlp", "embedding", "norm", "other")
# The plot's groups left to right: the baselines (SFT, the on-policy methods) first, then merging, then
# grafting from donors.
METHODS = ("sft", "opsd", "grpo", "sdpo", "sdpo_cot", "donor_sft", "merge", "graft", "post")
_POS_INF_BITS = 0x7F800000  # the int32 bit pattern of +inf: every finite non-negative fp32 lies below


def tensor_kind(name: str) -> str:
    """The kind of a parameter by its (Qwen/Llama-style) name; q_norm/k_norm count as norms."""
    if "embed" in name or "lm_head" in name:
        return "embedding"
    if "norm" in name:
        return "norm"
    if "attn" in name or "attention" in name:
        return "attention"
    return "mlp" if "mlp" in name else "other"


def _count_at_least(fisher: Mapping[str, torch.Tensor], bits: int) -> int:
    return sum(int((f.view(torch.int32) >= bits).sum()) for f in fisher.values())


def top_threshold(fisher: Mapping[str, torch.Tensor], k: int) -> tuple[float, int, int]:
    """The k-th largest Fisher value over all tensors, and how many values lie above it and at it.

    Non-negative fp32 numbers order like their int32 bit patterns, so a bisection over the patterns
    finds the exact k-th largest in 31 counting passes with no copy of F: a concatenation plus
    kthvalue would need two to three more model-sized fp32 buffers, too much beside a held Fisher.
    """
    if k < 1:
        return float("inf"), 0, 0
    lo, hi = 0, _POS_INF_BITS  # invariant: at least k values have a pattern >= lo
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if _count_at_least(fisher, mid) >= k else (lo, mid - 1)
    threshold = torch.tensor(lo, dtype=torch.int32).view(torch.float32).item()
    above = _count_at_least(fisher, lo + 1)
    return threshold, above, _count_at_least(fisher, lo) - above


def _checked_fisher(fisher_dir, post_dir) -> dict[str, torch.Tensor]:
    fisher = load_diag_fisher(fisher_dir, post_dir)
    for name, f in fisher.items():
        if (f < 0).any():
            raise GraftlabError(f"Fisher {fisher_dir} holds negative values in {name}: not a diagonal Fisher")
        f.abs_()  # -0.0 to +0.0: its bit pattern would otherwise sort below every positive value
    return fisher


def _check_matches(run: str, model_dir, post_dir, post_specs) -> None:
    missing, extra, shapes = spec_differences(post_specs, tensor_specs(model_dir))
    if missing or extra or shapes:
        raise GraftlabError(
            f"update {run!r}: model {model_dir} does not match the post model {post_dir}: "
            f"missing {missing[:3]}, unexpected {extra[:3]}, shapes differ for {shapes[:3]}"
        )


def _update_sums(fisher, threshold: float, tie_weight: float, post, updated) -> dict[str, float]:
    """fp64 sums of F u^2 and u^2, over everything and over the top set, for one update, streamed."""
    sums = dict.fromkeys(("fu2", "u2", "fu2_top", "u2_top", *(f"fu2_top_{k}" for k in KINDS)), 0.0)
    for name, f in fisher.items():
        u2 = (updated(name).float() - post(name).float()).square_()
        fu2 = f * u2
        above, tied = f > threshold, f == threshold
        fu2_top = _sum(fu2[above]) + tie_weight * _sum(fu2[tied])
        sums["fu2"] += _sum(fu2)
        sums["u2"] += _sum(u2)
        sums["fu2_top"] += fu2_top
        sums["u2_top"] += _sum(u2[above]) + tie_weight * _sum(u2[tied])
        sums[f"fu2_top_{tensor_kind(name)}"] += fu2_top
    return sums


def _sum(x: torch.Tensor) -> float:
    return x.sum(dtype=torch.float64).item()  # fp32 sums over a billion terms lose digits


def _share(part: float, whole: float) -> float | None:
    return part / whole if whole > 0 else None  # a zero update (lam = 0) has no share anywhere


def _measures(sums: dict[str, float]) -> dict[str, float | None]:
    fu2 = sums["fu2"]
    return {
        "fisher_share": _share(sums["fu2_top"], fu2),
        "sq_share": _share(sums["u2_top"], sums["u2"]),
        "predicted_rise": 0.5 * fu2,
        "update_norm": sums["u2"] ** 0.5,
    } | {f"fisher_share_{k}": _share(sums[f"fu2_top_{k}"], fu2) for k in KINDS}


def _run_ids(run: str) -> dict[str, str | None]:
    try:
        return {"run": run} | parse_run(run)
    except ValueError as err:
        raise GraftlabError(f"update key: {err}") from None


def sensitivity_table(fisher_dir, post_dir, updates: Mapping[str, str | Path], top: float = 0.01) -> pl.DataFrame:
    """One row per update (run key -> directory of the updated model): ids parsed from the key, then
    the shares and norms of the module docstring. Every model is checked against the post model
    (headers only) before any tensor is read."""
    if not 0 < top <= 1:
        raise GraftlabError(f"top must be in (0, 1], got {top}")
    if not updates:
        raise GraftlabError("sensitivity: no updates to analyse")
    ids = [_run_ids(run) for run in updates]
    post_specs = tensor_specs(post_dir)
    for run, model in updates.items():
        _check_matches(run, model, post_dir, post_specs)
    fisher = _checked_fisher(fisher_dir, post_dir)
    total = sum(f.numel() for f in fisher.values())
    k = max(1, round(top * total))
    threshold, above, tied = top_threshold(fisher, k)
    tie_weight = (k - above) / tied if tied else 0.0
    mass = sum(_sum(f[f > threshold]) for f in fisher.values()) + tie_weight * tied * threshold
    fixed = {"top": top, "top_count": k, "fisher_top_mass": _share(mass, sum(_sum(f) for f in fisher.values()))}
    rows = []
    with open_tensors(post_dir) as post:
        for model in updates.values():
            with open_tensors(model) as updated:
                rows.append(fixed | _measures(_update_sums(fisher, threshold, tie_weight, post, updated)))
    return _frame(ids, rows).sort("run")


def _frame(ids: list[dict], rows: list[dict]) -> pl.DataFrame:
    """Id columns as strings (a key no run has would otherwise be a Null column), measures as floats."""
    id_cols = list(dict.fromkeys(c for i in ids for c in i))
    data = [pl.Series(c, [i.get(c) for i in ids], pl.String) for c in id_cols]
    data += [pl.Series(c, [r[c] for r in rows], pl.Int64 if c == "top_count" else pl.Float64) for c in rows[0]]
    return pl.DataFrame(data)


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


def write_update_sensitivity(fisher_dir, post_dir, run: str, model_dir, out_parquet, top: float = 0.01) -> None:
    """One update's row, for the workflow: computed while a temporary grafted model still exists, so a new
    run never has to rebuild the grafts that were already analysed."""
    table = sensitivity_table(fisher_dir, post_dir, {run: model_dir}, top)
    with atomic_file(out_parquet) as tmp:
        table.write_parquet(tmp)


def collect_sensitivity(rows: list[str | Path], out_parquet, out_png, title: str | None = None) -> pl.DataFrame:
    """The rows of `write_update_sensitivity` as one table (parquet) and its figure (PNG)."""
    if not rows:
        raise GraftlabError("sensitivity: no updates to collect")
    table = pl.concat([pl.read_parquet(r) for r in rows], how="diagonal_relaxed").sort("run")
    with atomic_file(out_parquet) as tmp:
        table.write_parquet(tmp)
    plot_sensitivity(table, out_png, title)
    return table
