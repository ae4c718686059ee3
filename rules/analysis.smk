# One table and one Pareto plot per experiment, over every evaluated model, and what each method's
# models cost to train (sampling vs weight update, grafting paper §7).


rule summary:
    input:
        metrics=lambda w: [
            f"results/{w.exp}/eval/{run}/metrics.json" for run in runs(w.exp)
        ],
        data="results/{exp}/data/sft.json",
        source=lambda w: (
            f"results/{w.exp}/data/sources/problems.json"
            if xcfg(w, "problems")
            else []
        ),
    output:
        "results/{exp}/summary.parquet",
    log:
        "logs/{exp}/summary.log",
    conda:
        "../envs/cpu.yaml"
    params:
        data=lambda w: xcfg(w, "data"),
    script:
        "../workflow_scripts/summary.py"


rule pareto:
    input:
        "results/{exp}/summary.parquet",
    output:
        report(
            "results/{exp}/pareto.png",
            caption="../report/pareto.rst",
            category="Pareto fronts",
            labels={"experiment": "{exp}"},
        ),
    log:
        "logs/{exp}/pareto.log",
    conda:
        "../envs/cpu.yaml"
    script:
        "../workflow_scripts/pareto.py"


rule latency:
    input:
        summary="results/{exp}/summary.parquet",
        records=latency_records,
    output:
        runs="results/{exp}/latency.parquet",
        steps="results/{exp}/latency_steps.parquet",
        png=report(
            "results/{exp}/latency.png",
            caption="../report/latency.rst",
            category="Latency",
            labels={"experiment": "{exp}"},
        ),
    log:
        "logs/{exp}/latency.log",
    conda:
        "../envs/cpu.yaml"
    script:
        "../workflow_scripts/latency.py"
