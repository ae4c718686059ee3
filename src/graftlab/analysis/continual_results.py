"""A continual experiment's results, from every stage's evaluation and training log (`graftlab.planning.chains`):

    results/{exp}/continual.parquet          method x stage x benchmark: acc with its interval, base_acc,
                                             delta, rel_delta, gain, forgetting (graftlab.analysis.continual)
    results/{exp}/summary.parquet            method x stage: average accuracy (all, and the benchmarks seen
                                             so far), average forgetting, and collapse (`collapsed`,
                                             `collapse_reason`, `collapse_stage`, `collapse_step`,
                                             `repeated_share`; graftlab.analysis.collapse)
    results/{exp}/continual_accuracy.png     accuracy against stage per benchmark, a line per method
    results/{exp}/continual_heatmap.png      a stage x benchmark heatmap per method

A method is named by its chain's label (`sdpo:ema:0.05`); where two chains share one (a swept lr) by the
chain's whole key, so no two chains ever merge in a table.
"""

from pathlib import Path

import polars as pl

from graftlab.analysis.collapse import detect_stages
from graftlab.analysis.continual import continual_table, plot_accuracy, plot_heatmaps, stage_averages
from graftlab.io.atomic import atomic_file


def method_names(chains: list[dict]) -> list[str]:
    """Each chain's name in the tables: its label, or its key where labels repeat."""
    labels = [c["label"] for c in chains]
    return [c["label"] if labels.count(c["label"]) == 1 else c["chain"] for c in chains]


def collapse_frame(chains: list[dict], names: list[str], domains: list[str]) -> pl.DataFrame:
    """One row per method and stage: the chain's first collapse up to that stage, and the model's share of
    looping responses on its own domain."""
    rows = []
    for chain, name in zip(chains, names):
        stages = chain["stages"]
        records = detect_stages(
            [s["eval_dir"] for s in stages],
            [domains[s["stage"] - 1] for s in stages],
            [s["log"] for s in stages],
            stages=[s["stage"] for s in stages],
        )
        rows += [{"method": name, "chain": chain["chain"]} | r for r in records]
    return pl.DataFrame(rows, infer_schema_length=None)


def write_continual_results(chains: list[dict], base_metrics, domains: list[str], out: dict) -> None:
    """`chains`: [{label, chain, stages: [{stage, eval_dir, log}]}] (log: the stage's steps.jsonl, or None
    for SFT and grafts); `domains`: stage k's domain at k-1; `out`: paths `table`, `summary`, `accuracy`,
    `heatmap`."""
    names = method_names(chains)
    models = [
        {
            "method": name,
            "stage": s["stage"],
            "domain": domains[s["stage"] - 1],
            "metrics": f"{s['eval_dir']}/metrics.json",
        }
        for chain, name in zip(chains, names)
        for s in chain["stages"]
    ]
    table = continual_table(models, base_metrics)
    summary = stage_averages(table).join(collapse_frame(chains, names, domains), on=["method", "stage"], how="left")
    summary = summary.with_columns(
        domain=pl.col("stage").map_elements(lambda k: domains[k - 1], return_dtype=pl.String)
    )
    for frame, key in ((table, "table"), (summary, "summary")):
        with atomic_file(Path(out[key])) as tmp:
            frame.write_parquet(tmp)
    plot_accuracy(table, out["accuracy"])
    plot_heatmaps(table, out["heatmap"])
