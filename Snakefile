# graftlab: continual learning by grafting. This file is the table of contents; each stage lives in rules/.
from snakemake.utils import min_version

# The version pyproject.toml requires: an older Snakemake stops here, not somewhere in a rule.
min_version("9.0")


include: "rules/common.smk"
include: "rules/world.smk"
include: "rules/models.smk"
include: "rules/data.smk"
include: "rules/synth.smk"
include: "rules/train.smk"
include: "rules/fisher.smk"
include: "rules/graft.smk"
include: "rules/evaluate.smk"
include: "rules/analysis.smk"
include: "rules/continual.smk"
include: "rules/sensitivity.smk"
include: "rules/moe.smk"


rule all:
    default_target: True
    input:
        expand("results/{exp}/pareto.png", exp=EXPERIMENTS),
        expand("results/{exp}/summary.parquet", exp=EXPERIMENTS),
        expand("results/{exp}/sensitivity.png", exp=EXPERIMENTS),
        "results/moe/moe.png",
        # Every summary table as a report page (`snakemake --report`).
        "results/tables",
        expand("results/{exp}/latency.png", exp=EXPERIMENTS),
        expand("results/{exp}/gain_forgetting.png", exp=EXPERIMENTS),
        expand("results/{exp}/gain_forgetting.parquet", exp=EXPERIMENTS),
        # The study spans the single-domain experiments: none, no study.
        "results/study/study.png" if STUDY else [],
        expand("results/{exp}/continual.parquet", exp=CONTINUAL),
        expand("results/{exp}/continual_accuracy.png", exp=CONTINUAL),
        expand("results/{exp}/param_drift.png", exp=CONTINUAL),
        expand("results/{exp}/response_drift.png", exp=CONTINUAL),


# A local run forks its jobs from one process that has done their imports (`warm_jobs`, rules/common.smk).
onstart:
    start_warm_jobs()


# After a successful run: the disk each rule's outputs use and the grafts' peak, in results/disk.tsv.
onsuccess:
    report_disk()
    stop_warm_jobs()


onerror:
    stop_warm_jobs()
