"""Which donor grafts best along training (the grafting paper's §5.3 and its Fig. 3)?

Per experiment (a seed) and arm, the run chosen on the validation split, reported on the test split with its
95% intervals, and held to SFT of post, OPSD and the merge by the verdict's yardstick
(`graftlab.analysis.verdict.judge_runs`) on both splits. The arms: the post model, SFT of post, OPSD, the
merge (the post model's own update: the donor at post-training's end) and one per donor, its grafts. Within
an arm the run with the highest mean of its validation new- and old-task accuracy is chosen, the rule of
docs/fidelity.md's per-seed tables (ties to the first run by name).

    python -m graftlab.analysis.donor_ladder results/ladder-s{0,1,2}/summary.parquet [--out DIR]

prints the table in Markdown and writes `DIR/donor_ladder.parquet` and `DIR/donor_ladder.png`
(`configs/donor-ladder.yaml` runs the experiments).
"""

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import polars as pl

from graftlab.analysis.verdict import BASELINES, judge_runs
from graftlab.io.atomic import atomic_file
from graftlab.methods import METHODS
from graftlab.planning.layout import POST, VALIDATION_COLUMNS, world_checkpoint

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# The arms that are one method each, by their names in tables: the post model and the verdict's baselines.
# Every other arm is a donor's grafts.
ARMS = {m: METHODS[m].short for m in (POST, *BASELINES)}
SPLITS = {"validation": "_val", "test": ""}
JUDGED = tuple(m.name for m in METHODS.values() if m.grafts)  # held to the baselines: the scaled updates


def donor_order(donor: str) -> tuple:
    """Donors along training: pretraining's checkpoints, then post-training's, then named models."""
    c = world_checkpoint(donor)
    return (0, c.section != "pretrain", c.step, "") if c else (1, 0, 0, donor)


def _arm(method: str, donor: str | None) -> str | None:
    return ARMS.get(method, donor if method in JUDGED else None)


def chosen(summary: pl.DataFrame, screened: pl.DataFrame | None = None) -> pl.DataFrame:
    """One row per arm of one experiment's summary: its run chosen on validation, with its validation and
    test scores, and for grafts and the merge, `margin_X{suffix}` and `beats_X{suffix}` against each
    baseline X on each split (suffix `_val` for validation, none for test; X = sft, opsd, merge), screened-out
    baseline runs (`screened`, under adaptive sweeps) held to as the verdict holds them."""
    missing = [c for c in VALIDATION_COLUMNS if c not in summary.columns]
    if missing:
        exp = summary["exp"][0]
        raise ValueError(f"summary of {exp!r} lacks {missing}: evaluate it with eval.validation > 0")
    arms = summary.with_columns(
        arm=pl.struct("method", "donor").map_elements(lambda r: _arm(r["method"], r["donor"]), return_dtype=pl.String),
        score_val=(pl.col("new_val") + pl.col("old_val")) / 2,
    ).filter(pl.col("arm").is_not_null() & pl.col("score_val").is_not_null())
    picked = arms.sort(["score_val", "run"], descending=[True, False]).group_by("arm", maintain_order=True).first()
    verdicts = {
        (method, split): {v["run"]: v for v in judge_runs(summary, method, split, screened)}
        for method in JUDGED
        for split in SPLITS
    }
    rows = []
    for r in picked.iter_rows(named=True):
        row = {k: r[k] for k in ("exp", "arm", "run", "method", "donor", "new_val", "old_val")}
        row |= {k: r[k] for k in ("new", "new_lo", "new_hi", "old", "old_lo", "old_hi")}
        for split, suffix in SPLITS.items():
            v = verdicts[(r["method"], split)].get(r["run"]) if r["method"] in JUDGED else None
            for b in BASELINES:
                own = r["method"] == b  # the merge against the merge is itself
                margin = "margin" if b == "sft" else f"margin_{b}"
                beats = "reproduces" if b == "sft" else f"beats_{b}"
                row[f"margin_{b}{suffix}"] = None if v is None or own else v[margin]
                row[f"beats_{b}{suffix}"] = None if v is None or own else v[beats]
        rows.append(row)
    order = [*ARMS.values(), *sorted({r["arm"] for r in rows} - set(ARMS.values()), key=donor_order)]
    return pl.DataFrame(rows).sort(pl.col("arm").replace_strict(order, list(range(len(order)))))


def donor_table(summaries: list[pl.DataFrame], screened: list[pl.DataFrame | None] | None = None) -> pl.DataFrame:
    """`chosen` of every experiment, one after the other; `screened`: each one's screened-out runs, or None."""
    screened = screened or [None] * len(summaries)
    return pl.concat([chosen(s, x) for s, x in zip(summaries, screened, strict=True)], how="diagonal_relaxed")


def _interval(row: dict, role: str) -> str:
    return f"{row[role]:.2f} [{row[f'{role}_lo']:.2f}, {row[f'{role}_hi']:.2f}]"


def _beats(row: dict, suffix: str) -> str:
    marks = [
        ("yes" if row[f"beats_{b}{suffix}"] else "no") if row[f"beats_{b}{suffix}"] is not None else "-"
        for b in BASELINES
    ]
    return " / ".join(marks)


def markdown(table: pl.DataFrame) -> str:
    """The table as docs/fidelity.md shows it: beats SFT / OPSD / merge on validation, then on test."""
    lines = [
        "| seed | arm | run | validation: new / old | test: new | test: old "
        "| beats SFT / OPSD / merge: validation | test |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in table.iter_rows(named=True):
        run = "" if r["method"] == "post" else f"`{r['run']}`"
        lines.append(
            f"| {r['exp']} | {r['arm']} | {run} | {r['new_val']:.2f} / {r['old_val']:.2f} | {_interval(r, 'new')} "
            f"| {_interval(r, 'old')} | {_beats(r, '_val')} | {_beats(r, '')} |"
        )
    return "\n".join(lines) + "\n"


def figure(table: pl.DataFrame) -> "Figure":
    """Test accuracy of each arm's chosen run, new task left and old tasks right, one mark per seed."""
    from matplotlib.figure import Figure

    arms = table["arm"].unique(maintain_order=True).to_list()
    fig = Figure(figsize=(12, 4.2))
    for ax, role, title in zip(fig.subplots(1, 2), ("new", "old"), ("new task", "old tasks")):
        for i, exp in enumerate(table["exp"].unique(maintain_order=True).to_list()):
            rows = table.filter(exp=exp)
            xs = [arms.index(a) + (i - 1) * 0.12 for a in rows["arm"]]
            lo, hi = rows[role] - rows[f"{role}_lo"], rows[f"{role}_hi"] - rows[role]
            ax.errorbar(xs, rows[role], yerr=[lo, hi], fmt="o", ms=4, capsize=2, label=exp)
        ax.set_xticks(range(len(arms)), arms, rotation=25, ha="right", fontsize=8)
        ax.set_ylabel(f"{title} accuracy, test split (95% interval)")
        ax.set_title(f"{title}: the run chosen on validation")
        ax.set_ylim(-0.03, 1.03)
        ax.grid(alpha=0.3)
    fig.axes[0].legend(fontsize=8)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> int:
    doc = __doc__.split("\n")[0]
    parser = argparse.ArgumentParser(prog="python -m graftlab.analysis.donor_ladder", description=doc)
    parser.add_argument("summaries", nargs="+", type=Path, help="an experiment's summary.parquet, one per seed")
    parser.add_argument("--out", type=Path, default=Path("results/donor_ladder"), help="where the table and figure go")
    args = parser.parse_args(argv)
    absent = [str(p) for p in args.summaries if not p.is_file()]
    if absent:
        parser.error(f"no summary at {', '.join(absent)}")
    try:
        # An adaptive experiment's screened-out runs lie beside its summary (graftlab.analysis.screen).
        beside = [p.with_name("screened.parquet") for p in args.summaries]
        screened = [pl.read_parquet(x) if x.is_file() else None for x in beside]
        table = donor_table([pl.read_parquet(p) for p in args.summaries], screened)
    except ValueError as err:
        print(f"donor_ladder: {err}", file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    with atomic_file(args.out / "donor_ladder.parquet") as tmp:
        table.write_parquet(tmp)
    with atomic_file(args.out / "donor_ladder.png") as tmp:
        figure(table).savefig(tmp, dpi=150, format="png")
    print(markdown(table), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
