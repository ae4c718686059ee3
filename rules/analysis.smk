# One table and one Pareto plot per experiment, over every evaluated model, and what each method's
# models cost to train (sampling vs weight update, grafting paper §7); the weight-space drift of each
# tiny world's experiment and how often its models answer old tasks with the new task's procedure, and
# the study table over all experiments (issue 6's fidelity study).


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


rule drift:
    input:
        init=lambda w: f"{world_of(w.exp)[0]}/init",
        ladder=lambda w: f"{world_of(w.exp)[0]}/ladder",
        post=post_dir,
        sft=lambda w: [
            f"results/{w.exp}/sft/{b}/lr~{lr}"
            for b in ["post"] + xcfg(w, "donors")
            for lr in xcfg(w, "sft", "lr")
        ],
    output:
        "results/{exp}/drift.parquet",
    log:
        "logs/{exp}/drift.log",
    conda:
        "../envs/cpu.yaml"
    params:
        # The base model is the last ladder checkpoint, the one post-training started from.
        base=lambda w: f"{world_of(w.exp)[0]}/ladder/step~{world_of(w.exp)[1]['pretrain']['steps']}",
        updates=drift_updates,
    script:
        "../workflow_scripts/drift.py"


rule takeover:
    input:
        lambda w: [f"results/{w.exp}/eval/{run}/metrics.json" for run in runs(w.exp)],
    output:
        "results/{exp}/takeover.parquet",
    log:
        "logs/{exp}/takeover.log",
    conda:
        "../envs/cpu.yaml"
    params:
        eval_dir=lambda w: f"results/{w.exp}/eval",
        runs=lambda w: runs(w.exp),
        old=lambda w: list(old_benchmarks(w.exp)),
        new_task=lambda w: new_benchmark(w.exp)[0],
    script:
        "../workflow_scripts/takeover.py"


rule study:
    input:
        [e["summary"] for e in study_experiments()],
        [e["drift"] for e in study_experiments() if e["drift"]],
        [e["takeover"] for e in study_experiments() if e["takeover"]],
    output:
        runs="results/study/study.parquet",
        groups="results/study/groups.parquet",
        png=report(
            "results/study/study.png",
            caption="../report/study.rst",
            category="Fidelity study",
        ),
    log:
        "logs/study.log",
    conda:
        "../envs/cpu.yaml"
    params:
        experiments=study_experiments(),
    script:
        "../workflow_scripts/study.py"
