"""Adaptive sweeps against full scoring (eval.adaptive), seed by seed, from a finished run of
configs/adaptive.yaml: whether the frontier (test split) and the graft chosen on the validation split are the
same as full scoring's, how many grafts were screened out, and the answers each way sampled for the sweep.

    snakemake --configfile configs/adaptive.yaml --cores all
    python benchmarks/adaptive_bench.py results

An answer is one sample of one problem: a row of a benchmark's records (`results/{exp}/eval/{run}/*.parquet`,
`results/{exp}/screen/{run}/*.parquet`), so the count is what the sweep's engines sampled.
"""

import sys
from pathlib import Path

import polars as pl

from graftlab.analysis.summary import pareto_front
from graftlab.methods import METHODS

GRAFTS = tuple(m.name for m in METHODS.values() if m.grafts)


def answers(root: Path, kind: str) -> int:
    """Rows of every graft's records under `root/kind/` (kind `eval` or `screen`)."""
    return sum(pl.scan_parquet(p).select(pl.len()).collect().item() for p in (root / kind / "graft").rglob("*.parquet"))


def chosen(summary: pl.DataFrame) -> str:
    """The graft or merge with the highest mean of its validation new- and old-task accuracy."""
    grafts = summary.filter(pl.col("method").is_in(GRAFTS))
    return grafts.sort((pl.col("new_val") + pl.col("old_val")) / 2, "run", descending=[True, False])["run"][0]


def front(summary: pl.DataFrame) -> list[str]:
    return sorted(pareto_front(summary).filter("on_front")["run"].to_list())


def compare(results: Path, seed: int) -> dict:
    full, adaptive = results / f"full-s{seed}", results / f"adaptive-s{seed}"
    a, f = pl.read_parquet(adaptive / "summary.parquet"), pl.read_parquet(full / "summary.parquet")
    screened = pl.read_parquet(adaptive / "screened.parquet")
    sampled = answers(adaptive, "eval") + answers(adaptive, "screen")
    return {
        "seed": seed,
        "grafts": f.filter(pl.col("method").is_in(GRAFTS)).height,
        "screened_out": screened.height,
        "same_front": front(a) == front(f),
        "same_choice": chosen(a) == chosen(f),
        "answers_full": answers(full, "eval"),
        "answers_adaptive": sampled,
    }


def main(argv: list[str]) -> int:
    results = Path(argv[0] if argv else "results")
    table = pl.DataFrame([compare(results, seed) for seed in (0, 1, 2)])
    table = table.with_columns(share=pl.col("answers_adaptive") / pl.col("answers_full"))
    with pl.Config(tbl_formatting="MARKDOWN", tbl_hide_dataframe_shape=True, tbl_hide_column_data_types=True):
        print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
