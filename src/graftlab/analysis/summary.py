"""The summary table of an experiment: one row per evaluated model, and its Pareto frontier.

Each row's method, donor and keys are parsed from its run's key path (`graftlab.planning.layout.parse_run`).

Scores come with their bootstrap intervals (`old_lo`, `old_hi`, `new_lo`, `new_hi`, `{bench}_acc_lo`,
`{bench}_acc_hi`; see `graftlab.evaluate.metrics`), null where a metrics.json predates them. An experiment
evaluated with a validation share adds `old_val`, `new_val` and their bounds: the scores on the validation
problems, which `old` and `new` then leave out (`graftlab.evaluate.run`).
"""

import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import polars as pl

from graftlab.io.atomic import atomic_file
from graftlab.methods import METHODS, on_policy
from graftlab.methods.sdpo import SdpoSpec
from graftlab.planning.layout import KEY_COLUMNS, ROLE_COLUMNS, VALIDATION_COLUMNS, parse_run

ID_COLUMNS = ("exp", "run", "method", "donor", *KEY_COLUMNS)
# Runs that are ingredients of grafts, not candidates for the frontier: their old-task scores belong to
# another model line (a donor before and after its SFT).
INGREDIENTS = tuple(m.name for m in METHODS.values() if m.ingredient)

Ids = dict[str, str | None]
Scores = dict[str, float | None]


def _summary_row(path: Path, exp: str) -> tuple[Ids, Scores] | None:
    """The string columns (ids and keys) and the score columns of one metrics.json; None for an adaptive
    sweep's screened-out graft, which holds validation scores only: results/{exp}/screened.parquet lists it
    (graftlab.analysis.screen), and no frontier or choice could take it."""
    try:
        record = json.loads(path.read_text())
        if "screened_out" in record:
            return None
        run, benchmarks = record["run"], record["benchmarks"]
        scores: Scores = {c: record.get(c) for c in ROLE_COLUMNS}
        scores |= {c: record[c] for c in VALIDATION_COLUMNS if c in record}
        for bench, m in benchmarks.items():
            scores[f"{bench}_acc"] = m["acc@n"]
            scores[f"{bench}_acc_lo"], scores[f"{bench}_acc_hi"] = m.get("acc@n_lo"), m.get("acc@n_hi")
            scores |= {f"{bench}_{k}": v for k, v in m.items() if k.startswith("pass@")}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"{path}: not a readable metrics.json ({err!r})") from err
    return {"exp": exp, "run": run} | parse_run(run), scores


def summarize(metrics_files: Iterable[str | Path], exp: str) -> pl.DataFrame:
    """One row per evaluated model: ids, hyperparameters, old/new scores and per-benchmark metrics.

    Runs may differ in benchmarks or ks; a metric a run lacks is null. Rows are sorted by run.
    """
    rows = [row for p in metrics_files if (row := _summary_row(Path(p), exp)) is not None]
    if not rows:
        raise ValueError(f"experiment {exp!r}: no metrics files to summarise")
    runs = [ids["run"] for ids, _ in rows]
    dupes = sorted({r for r in runs if runs.count(r) > 1})
    if dupes:
        raise ValueError(f"experiment {exp!r}: runs evaluated twice: {dupes}")
    # Ids and keys first (extra keys after the standard ones), then scores in the order first met.
    id_cols, score_cols = list(ID_COLUMNS), list(ROLE_COLUMNS)
    for ids, scores in rows:
        id_cols += [c for c in ids if c not in id_cols]
        score_cols += [c for c in scores if c not in score_cols]
    data = {c: pl.Series(c, [ids.get(c) for ids, _ in rows], pl.String) for c in id_cols}
    data |= {c: pl.Series(c, [s.get(c) for _, s in rows], pl.Float64) for c in score_cols}
    return pl.DataFrame(list(data.values())).sort("run")


def data_columns(kind: str, sft_stats: str | Path, source_stats: str | Path | None = None) -> dict:
    """What the experiment learned from, the same on every row: the data kind, the training problems,
    the traces made of them and the problems left without one (unsolved, or no solution), and the rows
    of a configured data set skipped as ungradable, empty or duplicate. Skips are never silent: they
    are counted here as well as logged by the job that made them."""
    sft = json.loads(Path(sft_stats).read_text())
    rows_skipped = 0
    if source_stats is not None:
        rows_skipped = sum(json.loads(Path(source_stats).read_text())["skipped"].values())
    return {
        "data": kind,
        "data_problems": sft["problems"],
        "data_traces": sft["traces"],
        "data_skipped": sft["skipped"],
        "data_rows_skipped": rows_skipped,
    }


def distillation_columns(summary: pl.DataFrame, root: str | Path) -> pl.DataFrame:
    """`answer_share` of every SDPO row (the mean share of its responses after `</think>`, over the steps
    of its run under `root`, results/{exp}/), null on other rows, and a `note` on an SDPO row whose
    responses were all answer: without a think block SDPO's switches (the answer-only loss, the stripped
    thinking) change nothing, and `sdpo` is `sdpo_cot`."""
    cot = [m.name for m in on_policy() if isinstance(m.spec, SdpoSpec)]  # SDPO's methods
    shares = {}
    for run in summary.filter(pl.col("method").is_in(list(cot)))["run"]:
        path = Path(root) / run.rsplit("/step~", 1)[0] / "steps.jsonl"
        if not path.is_file():
            raise ValueError(f"{path}: missing (the step log of an SDPO run); re-run that run")
        steps = pl.read_ndjson(path)
        upto = steps.filter(pl.col("step") <= int(run.rsplit("~", 1)[1]))
        shares[run] = upto["answer_share"].mean() if "answer_share" in upto.columns else None
    share = pl.col("run").replace_strict(shares, default=None, return_dtype=pl.Float64)
    same = pl.col("method").is_in(cot) & (pl.col("answer_share") >= 1.0)
    note = pl.when(same).then(pl.lit("no think block: sdpo and sdpo_cot are the same"))
    return summary.with_columns(answer_share=share).with_columns(note=note.otherwise(None).cast(pl.String))


def write_summary(
    metrics_files: Iterable[str | Path],
    exp: str,
    out_parquet: str | Path,
    data: dict | None = None,
    root: str | Path | None = None,
) -> pl.DataFrame:
    """Summarise and write the table as parquet, atomically: a killed job leaves no partial file.
    `data` (from `data_columns`) adds its columns to every row; `root` (results/{exp}/, where the runs'
    step logs lie) SDPO's `answer_share` and `note` (`distillation_columns`)."""
    summary = summarize(metrics_files, exp)
    if root is not None:
        summary = distillation_columns(summary, root)
    if data:
        summary = summary.with_columns(pl.lit(v).alias(k) for k, v in data.items())
    with atomic_file(out_parquet) as tmp:
        summary.write_parquet(tmp)
    return summary


def _front_mask(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-dominated points of finite (x, y), both maximised; exact duplicates all stay on it."""
    finite = np.flatnonzero(np.isfinite(x) & np.isfinite(y))
    order = finite[np.lexsort((-y[finite], -x[finite]))]  # x descending, then y descending
    xs, ys = x[order], y[order]
    starts = np.r_[True, xs[1:] != xs[:-1]] if len(xs) else np.zeros(0, dtype=bool)
    group = np.cumsum(starts) - 1
    tops = ys[starts]  # the highest y of each distinct x
    # A point survives when it is the highest of its x and strictly above every point of larger x:
    # a point of larger x and equal y would dominate it.
    above_right = np.r_[-np.inf, np.maximum.accumulate(tops)[:-1]] if len(tops) else tops
    on = np.zeros(len(x), dtype=bool)
    on[order] = (ys == tops[group]) & (tops[group] > above_right[group])
    return on


def pareto_front(df: pl.DataFrame, x: str = "new", y: str = "old") -> pl.DataFrame:
    """`df` with a Boolean column `on_front`: True where no other row is >= in x and y and > in one.

    Rows with a null or NaN coordinate are never on the front and never dominate.
    """
    missing = [c for c in (x, y) if c not in df.columns]
    if missing:
        raise ValueError(f"pareto_front: no column(s) {missing} in {df.columns}")
    xs = df[x].cast(pl.Float64).fill_null(float("nan")).to_numpy()
    ys = df[y].cast(pl.Float64).fill_null(float("nan")).to_numpy()
    return df.with_columns(pl.Series("on_front", _front_mask(xs, ys), pl.Boolean))
