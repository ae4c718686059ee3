"""Does an experiment reproduce the grafting paper's result, beyond the bootstrap intervals?

The rule (issue 6): a graft run (method `graft`, masked or not) *reproduces* when

1. it lies on the Pareto frontier of (new, old) over every candidate: post, sft, merge, graft and the
   on-policy methods (opsd, grpo, sdpo, sdpo_cot)
   (donor SFTs left out, as in `pareto_figure`: their old-task score belongs to another model line), and
2. it learned the new task: its new-task lower bound exceeds the post model's new-task upper bound
   (the post model's point where it has no interval), and
3. at least one SFT-of-post point (method `sft`) has new-task accuracy <= the graft's, and
4. for every such SFT point, the graft's old-task lower bound exceeds (strictly) that point's old-task
   upper bound: its margin, `old_lo(graft) - max old_hi(compared SFT points)`, is > 0.

Condition 2 is the issue's rule made to mean what it says. Without it, in a world where SFT of the post
model forgets before it learns (an SFT checkpoint at the post model's new-task accuracy and far below its
old one), a graft that learned nothing, or the post model itself, would beat that checkpoint and
"reproduce": the first fidelity runs did exactly that. Condition 3 refuses the other vacuous win. The claim
is that grafting keeps more old-task accuracy than SFT
*at no less new-task accuracy*; a graft that learned less of the new task than every SFT checkpoint has
no SFT point to be compared with, and a graft barely moved from the post model (small lambda) would
otherwise "reproduce" by forgetting nothing because it learned nothing. Such a graft is reported with
no margin and does not qualify; a sweep that wants it judged needs an earlier or gentler SFT point.

The same yardstick (conditions 3-4) also holds each frontier graft to the other baselines a reader compares
it with, OPSD and the merge (`BASELINES`): `margin_opsd` and `margin_merge` over their points of no more
new-task accuracy, and `beats_opsd`, `beats_merge` when it learned and that margin is > 0. Only the
comparison with SFT decides `reproduces`: it is the paper's claim.

Under adaptive sweeps (`eval.adaptive`) a screened-out baseline point has no test scores, only its screening
interval (`results/{exp}/screened.parquet`, graftlab.analysis.screen); left out, it could have been the binding
point, and the margin would loosen. So each enters the yardstick as what it may be (`screened`): it binds when
it *may* have new-task accuracy <= the graft's (its interval's lower bound), at its interval's upper old-task
bound, and counts for condition 3 only when it *must* (its upper bound). Wherever a screened point's
full-scoring interval would lie within its screening interval (the screening's, on a share of the validation
problems, is the wider), conditions 2-4 are then at least as strict as with full scoring (tests/test_verdict.py,
a property over any summary). Condition 1 needs no such point: one screened out lies wholly below a kept run of
its own group (graftlab.analysis.screen), so wherever the screened runs' intervals would hold so, that kept run
dominates whatever it would have.
"""

import polars as pl

from graftlab.analysis.summary import INGREDIENTS, ROLE_COLUMNS, VALIDATION_COLUMNS, pareto_front
from graftlab.methods import METHODS
from graftlab.planning.layout import parse_run

# Every method a single-domain summary holds that is not an ingredient of grafts.
CANDIDATES = tuple(m.name for m in METHODS.values() if not (m.ingredient or m.chain_only))
NEEDED = ("run", "method", "new", "old", "old_lo", "old_hi", "new_lo", "new_hi")
# The methods a graft is held to, each beyond the intervals: SFT of the post model (the rule), then the
# on-policy baseline and the post model's own update (grafting from the post model itself).
BASELINES = ("sft", "opsd", "merge")


def _scored(summary: pl.DataFrame) -> pl.DataFrame:
    missing = [c for c in NEEDED if c not in summary.columns]
    if missing:
        hint = " (a summary written before bootstrap intervals: re-run the evaluations)" if "old_lo" in missing else ""
        raise ValueError(f"reproduces: summary lacks column(s) {missing}{hint}")
    # A method unknown here could dominate a graft; leaving it out would put the graft on a false frontier.
    unknown = sorted(set(summary["method"].to_list()) - {*CANDIDATES, *INGREDIENTS})
    if unknown:
        raise ValueError(f"reproduces: unknown method(s) {unknown}; known: {[*CANDIDATES, *INGREDIENTS]}")
    scored = summary.filter(
        pl.col("method").is_in(CANDIDATES) & pl.col("new").is_not_null() & pl.col("old").is_not_null()
    )
    # Without intervals a graft or SFT point cannot be judged "beyond the intervals"; calling it a
    # loss would hide the missing evaluation, so it is refused by name.
    judged = scored.filter(pl.col("method").is_in(["graft", *BASELINES]))
    blind = judged.filter(pl.col("old_lo").is_null() | pl.col("old_hi").is_null())["run"].to_list()
    blind += judged.filter((pl.col("method") == "graft") & pl.col("new_lo").is_null())["run"].to_list()
    if blind:
        raise ValueError(f"reproduces: run(s) without intervals (re-evaluate them): {sorted(set(blind))}")
    if scored.filter(method="post").height != 1:
        raise ValueError("reproduces: the summary needs the post model's row: a graft must learn beyond it")
    return scored


def _post_new_bound(scored: pl.DataFrame) -> float:
    """What a graft's new-task lower bound must exceed: the post model's upper bound, or its point."""
    post = scored.filter(method="post").row(0, named=True)
    return post["new_hi"] if post["new_hi"] is not None else post["new"]


# A baseline point of the yardstick: the least and the most new-task accuracy it may have (its score twice
# where it was scored) and its old-task upper bound.
YARDSTICK = {"run": pl.Utf8, "new_min": pl.Float64, "new_max": pl.Float64, "old_hi": pl.Float64}
SCREENED = ("run", "new_val_lo", "new_val_hi", "old_val_hi")  # what a screened point enters with


def _yardsticks(scored: pl.DataFrame, screened: pl.DataFrame | None) -> dict[str, pl.DataFrame]:
    """Each baseline's points (`YARDSTICK`), by method: its scored runs, then its screened-out ones (module
    docstring) from `screened`, a `screened.parquet` table."""
    points = {
        name: scored.filter(method=name).select(
            "run", pl.col("new").alias("new_min"), pl.col("new").alias("new_max"), "old_hi"
        )
        for name in BASELINES
    }
    if screened is None or screened.height == 0:
        return points
    missing = [c for c in SCREENED if c not in screened.columns]
    if missing:
        raise ValueError(f"reproduces: the screened table lacks column(s) {missing}")
    # A run the summary scores was not screened out (a screened-out run has no test scores, so no row): its
    # row is an earlier screening's, left beside the summary of an experiment that screens no more (the
    # donor ladder reads the table beside each summary). Held to, it could only make the verdict stricter.
    screened = screened.filter(~pl.col("run").is_in(scored["run"].to_list()))
    methods = [parse_run(run)["method"] for run in screened["run"]]
    out = screened.with_columns(method=pl.Series(methods, dtype=pl.Utf8)).select(
        "method", "run", new_min="new_val_lo", new_max="new_val_hi", old_hi="old_val_hi"
    )
    return {
        name: pl.concat([frame.cast(YARDSTICK), out.filter(method=name).drop("method").cast(YARDSTICK)])
        for name, frame in points.items()
    }


def _versus(graft: dict, points: pl.DataFrame) -> tuple[int, dict | None, float | None]:
    """(how many of `points` (`YARDSTICK`) must have new-task accuracy <= the graft's, the binding one, the
    graft's margin over it): of those that may, the point with the highest old-task upper bound binds, as
    beating it beats them all. None binds where none must (condition 3)."""
    compared = points.filter(pl.col("new_max") <= graft["new"]).height
    if compared == 0:
        return 0, None, None
    may = points.filter(pl.col("new_min") <= graft["new"])
    closest = may.sort("old_hi", descending=True).row(0, named=True)
    return compared, closest, graft["old_lo"] - closest["old_hi"]


def _judge(graft: dict, baselines: dict[str, pl.DataFrame], post_new: float) -> dict:
    """The graft's verdict: did it learn beyond the post model, and against each baseline's points of
    new-task accuracy <= its own (`baselines`, by method: SFT's decide), by how much does it keep more of
    the old tasks."""
    learned = graft["new_lo"] > post_new
    out = {k: graft[k] for k in ("run", "new", "old", "old_lo", "old_hi")} | {"learned": learned}
    count, closest, margin = _versus(graft, baselines["sft"])
    out |= {
        "sft_compared": count,
        "closest_sft": closest and closest["run"],
        "sft_old_hi": closest and closest["old_hi"],
        "margin": margin,
        "reproduces": learned and margin is not None and margin > 0,
    }
    for name, points in baselines.items():
        if name != "sft":
            _, closest, margin = _versus(graft, points)
            beats = learned and margin is not None and margin > 0
            out |= {f"closest_{name}": closest and closest["run"], f"margin_{name}": margin, f"beats_{name}": beats}
    return out


def on_split(summary: pl.DataFrame, split: str) -> pl.DataFrame:
    """The summary scored on `split`: `test` as it is, `validation` with `old_val`, `new_val` and their
    bounds in place of `old`, `new` (an experiment evaluated with a validation share)."""
    if split == "test":
        return summary
    if split != "validation":
        raise ValueError(f"reproduces: split must be 'test' or 'validation', got {split!r}")
    missing = [c for c in VALIDATION_COLUMNS if c not in summary.columns]
    if missing:
        raise ValueError(f"reproduces: no validation scores {missing}: evaluate with eval.validation > 0")
    return summary.drop([c for c in ROLE_COLUMNS if c in summary.columns]).rename(
        dict(zip(VALIDATION_COLUMNS, ROLE_COLUMNS))
    )


def reproduces(summary: pl.DataFrame, split: str = "test", screened: pl.DataFrame | None = None) -> dict:
    """The verdict of one experiment's summary (module docstring: the rule).

    Returns `reproduces` (whether any graft qualifies), `qualifying` (their runs, by margin, largest
    first), `beats` (per other baseline, the frontier grafts beyond it) and `frontier_grafts`: per graft on
    the frontier, its run, `new`, `old`, `old_lo`, `old_hi`, whether it `learned` the new task beyond the
    post model, how many SFT points it was compared with (`sft_compared`), the binding one
    (`closest_sft`, its `sft_old_hi`), `margin` (`old_lo - sft_old_hi`, None without a comparable SFT
    point; > 0 qualifies) and its own `reproduces`, so a near miss shows how near it was; and against
    OPSD and the merge, `closest_X`, `margin_X` and `beats_X`. `split`: `test` (the reported
    scores) or `validation` (the scores a choice of world or setting may be made on; `on_split`). `screened`:
    the experiment's screened-out runs (`screened.parquet`), held to as the module docstring says.
    """
    if not isinstance(summary, pl.DataFrame):
        raise TypeError(f"reproduces: expected a polars DataFrame, got {type(summary).__name__}")
    scored = _scored(on_split(summary, split))
    front = pareto_front(scored).filter("on_front")
    baselines = _yardsticks(scored, screened)
    grafts = front.filter(method="graft").sort("new", "run")
    post_new = _post_new_bound(scored)
    verdicts = [_judge(g, baselines, post_new) for g in grafts.iter_rows(named=True)]
    winners = sorted((v for v in verdicts if v["reproduces"]), key=lambda v: -v["margin"])
    beats = {name: [v["run"] for v in verdicts if v[f"beats_{name}"]] for name in BASELINES if name != "sft"}
    return {
        "reproduces": bool(winners),
        "qualifying": [v["run"] for v in winners],
        "beats": beats,
        "frontier_grafts": verdicts,
    }


def judge_runs(
    summary: pl.DataFrame, method: str, split: str = "test", screened: pl.DataFrame | None = None
) -> list[dict]:
    """Every run of `method` (a baseline such as `merge`, or `graft` off the frontier too) judged by the
    rule's conditions 2-4, without condition 1: did it learn beyond the post model, and by what margin does
    it keep more of the old tasks than the SFT-of-post points of no more new-task accuracy. The grafts'
    own yardstick, held to another method: each dict as in `reproduces`' `frontier_grafts`; `screened` as
    there."""
    if method not in CANDIDATES:
        raise ValueError(f"judge_runs: method {method!r} is not a candidate; known: {list(CANDIDATES)}")
    scored = _scored(on_split(summary, split))
    runs = scored.filter(method=method).sort("new", "run")
    blind = runs.filter(pl.col("old_lo").is_null() | pl.col("new_lo").is_null())["run"].to_list()
    if blind:
        raise ValueError(f"judge_runs: run(s) without intervals (re-evaluate them): {blind}")
    baselines, post_new = _yardsticks(scored, screened), _post_new_bound(scored)
    return [_judge(r, baselines, post_new) for r in runs.iter_rows(named=True)]
