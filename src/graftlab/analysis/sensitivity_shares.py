"""Sensitive-weight shares (grafting paper §7, docs/methods.md#sensitive-weights): how much of an update lands
on the coordinates the post model's retention is most sensitive to. The experiment's table and figure are
graftlab.analysis.sensitivity's.

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

No torch: the workflow runs this once per update (75 jobs in the default run), and importing torch was
most of each job's time (benchmarks/README.md). Tensors are read as fp32 numpy arrays (bf16 widened
exactly, graftlab.io.fp32_numpy); every elementwise step is the fp32 operation torch's version made, and
sums are fp64, so results agree with it to the rounding of those sums.
"""

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import polars as pl

from graftlab.errors import GraftlabError
from graftlab.fisher.diag_numpy import load_diag_fisher_numpy
from graftlab.io.atomic import atomic_file
from graftlab.io.fp32_numpy import Fp32Reader
from graftlab.io.safetensors_io import TensorSpec, spec_differences, tensor_specs
from graftlab.planning.layout import parse_run

KINDS = ("attention", "mlp", "embedding", "norm", "other")
_POS_INF_BITS = 0x7F800000  # the int32 bit pattern of +inf: every finite non-negative fp32 lies below
# Elements per comparison in a counting pass: the boolean temporary stays in cache (1.0 against 1.4 ns an
# element for whole tensors here).
_COUNT_BLOCK = 1 << 16


def tensor_kind(name: str) -> str:
    """The kind of a parameter by its (Qwen/Llama-style) name; q_norm/k_norm count as norms."""
    if "embed" in name or "lm_head" in name:
        return "embedding"
    if "norm" in name:
        return "norm"
    if "attn" in name or "attention" in name:
        return "attention"
    return "mlp" if "mlp" in name else "other"


def _count_at_least(fisher: Mapping[str, np.ndarray], bits: int) -> int:
    count = 0
    for f in fisher.values():
        patterns = f.reshape(-1).view(np.int32)
        for start in range(0, patterns.size, _COUNT_BLOCK):
            count += int(np.count_nonzero(patterns[start : start + _COUNT_BLOCK] >= bits))
    return count


def top_threshold(fisher: Mapping[str, np.ndarray], k: int) -> tuple[float, int, int]:
    """The k-th largest value over all (fp32, non-negative, contiguous) tensors, and how many values lie
    above it and at it.

    Non-negative fp32 numbers order like their int32 bit patterns, so a bisection over the patterns
    finds the exact k-th largest in 31 counting passes with no copy of F: a concatenation plus a
    partition would need one to two more model-sized fp32 buffers, too much beside a held Fisher.
    """
    if k < 1:
        return float("inf"), 0, 0
    lo, hi = 0, _POS_INF_BITS  # invariant: at least k values have a pattern >= lo
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if _count_at_least(fisher, mid) >= k else (lo, mid - 1)
    threshold = float(np.array(lo, dtype=np.int32).view(np.float32))
    above = _count_at_least(fisher, lo + 1)
    return threshold, above, _count_at_least(fisher, lo) - above


def _checked_fisher(fisher_dir, post_dir, post_specs) -> dict[str, np.ndarray]:
    fisher = load_diag_fisher_numpy(fisher_dir, post_dir, post_specs)  # refuses negative values
    for f in fisher.values():
        np.abs(f, out=f)  # -0.0 to +0.0: its bit pattern would otherwise sort below every positive value
    return fisher


def _check_matches(run: str, model_dir, post_dir, post_specs) -> dict[str, TensorSpec]:
    specs = tensor_specs(model_dir)
    missing, extra, shapes = spec_differences(post_specs, specs)
    if missing or extra or shapes:
        raise GraftlabError(
            f"update {run!r}: model {model_dir} does not match the post model {post_dir}: "
            f"missing {missing[:3]}, unexpected {extra[:3]}, shapes differ for {shapes[:3]}"
        )
    return specs


def _update_sums(fisher, threshold: float, tie_weight: float, post, updated) -> dict[str, float]:
    """fp64 sums of F u^2 and u^2, over everything and over the top set, for one update, streamed."""
    sums = dict.fromkeys(("fu2", "u2", "fu2_top", "u2_top", *(f"fu2_top_{k}" for k in KINDS)), 0.0)
    for name, f in fisher.items():
        u2 = updated(name)
        np.square(np.subtract(u2, post(name), out=u2), out=u2)
        fu2 = f * u2
        above, tied = f > threshold, f == threshold
        fu2_top = _sum(fu2, above) + tie_weight * _sum(fu2, tied)
        sums["fu2"] += _sum(fu2)
        sums["u2"] += _sum(u2)
        sums["fu2_top"] += fu2_top
        sums["u2_top"] += _sum(u2, above) + tie_weight * _sum(u2, tied)
        sums[f"fu2_top_{tensor_kind(name)}"] += fu2_top
    return sums


def _sum(x: np.ndarray, where: np.ndarray | bool = True) -> float:
    return float(np.sum(x, dtype=np.float64, where=where))  # fp32 sums over a billion terms lose digits


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
    specs = [_check_matches(run, model, post_dir, post_specs) for run, model in updates.items()]
    fisher = _checked_fisher(fisher_dir, post_dir, post_specs)
    total = sum(f.size for f in fisher.values())
    k = max(1, round(top * total))
    threshold, above, tied = top_threshold(fisher, k)
    tie_weight = (k - above) / tied if tied else 0.0
    mass = sum(_sum(f, f > threshold) for f in fisher.values()) + tie_weight * tied * threshold
    fixed = {"top": top, "top_count": k, "fisher_top_mass": _share(mass, sum(_sum(f) for f in fisher.values()))}
    rows = []
    with Fp32Reader.of_model(post_dir, post_specs) as post:
        for model, model_specs in zip(updates.values(), specs):
            with Fp32Reader.of_model(model, model_specs) as updated:
                rows.append(fixed | _measures(_update_sums(fisher, threshold, tie_weight, post, updated)))
    return _frame(ids, rows).sort("run")


def _frame(ids: list[dict], rows: list[dict]) -> pl.DataFrame:
    """Id columns as strings (a key no run has would otherwise be a Null column), measures as floats."""
    id_cols = list(dict.fromkeys(c for i in ids for c in i))
    data = [pl.Series(c, [i.get(c) for i in ids], pl.String) for c in id_cols]
    data += [pl.Series(c, [r[c] for r in rows], pl.Int64 if c == "top_count" else pl.Float64) for c in rows[0]]
    return pl.DataFrame(data)


def write_update_sensitivity(fisher_dir, post_dir, run: str, model_dir, out_parquet, top: float = 0.01) -> None:
    """One update's row, for the workflow: computed while a temporary grafted model still exists, so a new
    run never has to rebuild the grafts that were already analysed."""
    table = sensitivity_table(fisher_dir, post_dir, {run: model_dir}, top)
    with atomic_file(out_parquet) as tmp:
        table.write_parquet(tmp)
