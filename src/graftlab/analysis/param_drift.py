"""Parameter drift of a model W' against a base W, weight matrix by weight matrix (issue 17).

Every 2-D floating tensor of the two model directories is compared in float64, one tensor at a time, so
no model is ever held whole in memory. With sigma the singular values (descending) and U_k the top-k left
singular vectors:

    spectral_shift   ||sigma(W') - sigma(W)||_2 / ||sigma(W)||_2
                     how much the spectrum moved; 0 for any rotation W' = QW
    subspace_angle   the largest principal angle, in degrees, between span(U_k) and span(U'_k), with
                     k = min(k, numerical rank of W, numerical rank of W'):
                     arccos of the smallest singular value of U_k^T U'_k (clamped to [0, 1]); below
                     45 degrees the same angle as arcsin of the largest singular value of
                     U'_k - U_k U_k^T U'_k, which resolves small angles that arccos rounds away
    mask_overlap     |A & A'| / |A | A'| (IoU), A the top-`share` entries of |W| by magnitude,
                     count = max(1, round(share * numel)), ties broken by torch.topk
    update_sparsity  share of entries with W' == W exactly
    rel_update_norm  ||W' - W||_F / ||W||_F

A value with a zero denominator (W = 0, or no non-zero singular value to span a subspace) is NaN:
undefined, not zero.

Light at import: torch, tqdm and matplotlib load inside the functions that need them.
"""

from __future__ import annotations

import math
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING

import polars as pl

from graftlab.errors import GraftlabError
from graftlab.io.atomic import atomic_file
from graftlab.io.gates import model_dir, number
from graftlab.io.safetensors_io import open_tensors, spec_differences, tensor_index, tensor_specs

if TYPE_CHECKING:
    import torch

METRICS = ("spectral_shift", "subspace_angle", "mask_overlap", "update_sparsity", "rel_update_norm")
SCHEMA = {"tensor": pl.String, "rows": pl.Int64, "cols": pl.Int64} | dict.fromkeys(METRICS, pl.Float64)
PLOTTED = ("spectral_shift", "subspace_angle", "mask_overlap", "rel_update_norm")


def _ratio(num: float, den: float) -> float:
    return num / den if den > 0 else math.nan


def _numerical_rank(s: torch.Tensor, shape: tuple[int, ...]) -> int:
    # numpy's matrix_rank tolerance: singular values below it are rounding noise, and their vectors
    # span an arbitrary part of the null space that would make the angle meaningless.
    if s.numel() == 0 or s[0] == 0:
        return 0
    tol = s[0] * max(shape) * sys.float_info.epsilon
    return int((s > tol).sum())


def _largest_angle(u, s, u2, s2, shape, k: int) -> float:
    """Largest principal angle (degrees) between the top-k left singular subspaces, k clipped to both ranks."""
    import torch

    k = min(k, _numerical_rank(s, shape), _numerical_rank(s2, shape))
    if k == 0:
        return math.nan
    uk, uk2 = u[:, :k], u2[:, :k]
    overlap = uk.T @ uk2
    angle = math.acos(float(torch.linalg.svdvals(overlap).min().clamp(0.0, 1.0)))
    if angle < math.pi / 4:
        # A cosine within eps of 1 leaves acos ~sqrt(eps) rad (1e-6 degrees) of noise, so W' = W would not
        # read 0: small angles come from their sine, the largest singular value of U'_k's part outside U_k.
        angle = math.asin(min(1.0, float(torch.linalg.svdvals(uk2 - uk @ overlap).max())))
    return math.degrees(angle)


def _top_mask(w: torch.Tensor, count: int) -> torch.Tensor:
    import torch

    flat = w.abs().flatten()
    mask = torch.zeros(flat.numel(), dtype=torch.bool)
    mask[torch.topk(flat, count, sorted=False).indices] = True
    return mask


def _check_options(k: int, share: float) -> None:
    number(k, "drift: k", low=1, integer=True)
    number(share, "drift: share", above=0, high=1)


def matrix_drift(w, w2, k: int = 16, share: float = 0.01) -> dict[str, float]:
    """The five drift values of matrix `w2` (W') against `w` (W); anything torch.as_tensor takes, in float64."""
    import torch

    _check_options(k, share)
    w, w2 = torch.as_tensor(w, dtype=torch.float64), torch.as_tensor(w2, dtype=torch.float64)
    if w.ndim != 2 or w.shape != w2.shape:
        raise GraftlabError(f"drift: needs two matrices of one shape, got {list(w.shape)} and {list(w2.shape)}")
    u, s, _ = torch.linalg.svd(w, full_matrices=False)
    u2, s2, _ = torch.linalg.svd(w2, full_matrices=False)
    count = max(1, round(share * w.numel()))
    a, a2 = _top_mask(w, count), _top_mask(w2, count)
    inter = int((a & a2).sum())
    base_norm = float(torch.linalg.vector_norm(w))
    return {
        "spectral_shift": _ratio(float(torch.linalg.vector_norm(s2 - s)), float(torch.linalg.vector_norm(s))),
        "subspace_angle": _largest_angle(u, s, u2, s2, tuple(w.shape), k),
        "mask_overlap": inter / (2 * count - inter),
        "update_sparsity": float((w == w2).sum()) / w.numel(),
        "rel_update_norm": _ratio(float(torch.linalg.vector_norm(w2 - w)), base_norm),
    }


def _matrices(base: Path, model: Path) -> list[tuple[str, tuple[int, int]]]:
    """The 2-D floating tensors both models hold, in the base's file order; any difference in names or
    shapes is an error naming the tensors and both directories."""
    index = tensor_index(base)
    specs, specs2 = tensor_specs(base, index), tensor_specs(model)
    missing, extra, shapes = spec_differences(specs, specs2)
    if missing or extra or shapes:
        parts = [f"{label} {names[:3]}" for label, names in (("missing", missing), ("extra", extra)) if names]
        parts += [f"{n} is {list(specs[n].shape)} against {list(specs2[n].shape)}" for n in shapes[:3]]
        raise GraftlabError(f"{model} and {base} are not one architecture: {'; '.join(parts)}")
    # File order, which is also the order that reads each shard front to back.
    order = sorted(specs, key=lambda n: (str(index[n]), specs[n].offset))
    return [
        (n, specs[n].shape)
        for n in order
        if len(specs[n].shape) == 2 and specs[n].is_floating_point and specs2[n].is_floating_point
    ]


def model_drift(base, model, k: int = 16, share: float = 0.01) -> pl.DataFrame:
    """One row per 2-D floating tensor of `model` against `base` (model directories), in file order."""
    from tqdm import tqdm

    _check_options(k, share)
    base, model = Path(base), Path(model)
    for path, role in ((base, "base"), (model, "model")):
        model_dir(path, role, finite=True)  # a NaN weight would reach the SVDs as a linear-algebra traceback
    matrices = _matrices(base, model)
    rows = []
    with ExitStack() as stack:
        get, get2 = stack.enter_context(open_tensors(base)), stack.enter_context(open_tensors(model))
        for name, (m, n) in tqdm(matrices, desc="drift", unit="tensor"):
            rows.append({"tensor": name, "rows": m, "cols": n} | matrix_drift(get(name), get2(name), k, share))
    return pl.DataFrame(rows, schema=SCHEMA)


def write_model_drift(base, model, out_dir, k: int = 16, share: float = 0.01) -> Path:
    """`model_drift` as `out_dir/drift.parquet`, written atomically: an error leaves no file behind."""
    table = model_drift(base, model, k, share)
    out = Path(out_dir) / "drift.parquet"
    with atomic_file(out) as tmp:
        table.write_parquet(tmp)
    return out


def _stage_means(table: pl.DataFrame) -> pl.DataFrame:
    """Mean of each plotted value over tensors, per (against, method, stage); NaN (undefined) skipped."""
    need = {"method", "stage", "against", *PLOTTED}
    missing = sorted(need - set(table.columns))
    if missing:
        raise GraftlabError(f"plot_drift: the table lacks columns {missing}")
    if table.height == 0:
        raise GraftlabError("plot_drift: the table has no rows")
    means = [pl.col(c).cast(pl.Float64).fill_nan(None).mean() for c in PLOTTED]
    return table.group_by("against", "method", "stage").agg(means).sort("method", "stage")


def plot_drift(table, out_png) -> None:
    """Mean drift over tensors against stage, one line per method: a column of panels per value in
    PLOTTED, a row per value of `against`. `table` is a frame or a parquet path."""
    # A bare Figure renders through Agg without pyplot (as the other analysis figures): no global backend.
    from matplotlib import colormaps
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    table = table if isinstance(table, pl.DataFrame) else pl.read_parquet(table)
    df = _stage_means(table)
    # Rows of panels in the order the table first names each reference (e.g. stage_start, then post).
    againsts, methods = table["against"].unique(maintain_order=True).to_list(), sorted(df["method"].unique())
    # One colour per method in every panel, by its place in the sorted list.
    colors = {m: colormaps["tab10"](i % 10) for i, m in enumerate(methods)}
    fig = Figure(figsize=(4 * len(PLOTTED), 3.2 * len(againsts) + 0.6))
    axes = fig.subplots(len(againsts), len(PLOTTED), squeeze=False)
    for row, against in zip(axes, againsts):
        part = df.filter(pl.col("against") == against)
        for ax, value in zip(row, PLOTTED):
            for method in methods:
                line = part.filter(pl.col("method") == method)
                if line.height:
                    ax.plot(line["stage"], line[value], marker="o", color=colors[method], label=method)
            ax.set_title(f"{value} against {against}", fontsize=10)
            ax.set_xlabel("stage")
            ax.xaxis.get_major_locator().set_params(integer=True)
    handles = [Line2D([], [], marker="o", color=colors[m], label=m) for m in methods]
    fig.legend(handles=handles, loc="lower center", ncol=min(len(methods), 6), frameon=False)
    fig.suptitle("Parameter drift per stage (mean over weight matrices)")
    fig.tight_layout(rect=(0, 0.6 / fig.get_figheight(), 1, 1))
    with atomic_file(out_png) as tmp:
        fig.savefig(tmp, dpi=150, format="png")


def write_pairs_drift(pairs: list[dict], out_table, k: int = 16, share: float = 0.01) -> pl.DataFrame:
    """Drift of models of a continual experiment against their bases (pairs of `graftlab.planning.chains.
    Continual.drift_pairs`: one job's, a chain's model after a stage), tensor by tensor, each row with its
    pair's method, chain, stage and reference (`against`), written atomically."""
    keys = ("method", "chain", "stage", "against")
    drift = [model_drift(p["base"], p["model"], k, share) for p in pairs]
    frames = [d.with_columns(**{c: pl.lit(p[c]) for c in keys}) for d, p in zip(drift, pairs, strict=True)]
    table = pl.concat(frames)
    with atomic_file(Path(out_table)) as tmp:
        table.write_parquet(tmp)
    return table


def write_chain_drift(tables: list, out_table, out_png) -> pl.DataFrame:
    """Every job's table (`write_pairs_drift`) in one, and its figure."""
    table = pl.concat([pl.read_parquet(path) for path in tables])
    with atomic_file(Path(out_table)) as tmp:
        table.write_parquet(tmp)
    plot_drift(table, out_png)
    return table
