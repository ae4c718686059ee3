# One table and one Pareto plot per experiment, over every evaluated model, each run's gain and forgetting
# per benchmark (Denser ≠ Better), and what each method's models cost to train (sampling vs weight update,
# grafting paper §7); the weight-space drift of each tiny world's experiment and how often its models
# answer old tasks with the new task's procedure, and the study table over all experiments (issue 6's
# fidelity study).


rule summary:
    input:
        metrics=lambda w: layout(w).eval_metrics(),
        data="results/{exp}/data/sft.json",
        source=lambda w: (
            source_file(xcfg(w, "problems"), ".json") if xcfg(w, "problems") else []
        ),
        # SDPO's step logs: how much of each response was answer (graftlab.analysis.summary).
        sdpo=lambda w: [
            f"{layout(w).root}/{r.key}"
            for r in layout(w).on_policy_runs()
            if r.kind in ("sdpo", "sdpo_cot")
        ],
    output:
        "results/{exp}/summary.parquet",
    log:
        "logs/{exp}/summary.log",
    benchmark:
        "benchmarks/jobs/{exp}/summary.tsv"
    wildcard_constraints:
        # A continual experiment's summary is rules/continual.smk's.
        exp="|".join(EXPERIMENTS) or "(?!)",
    conda:
        "../envs/cpu.yaml"
    params:
        data=lambda w: xcfg(w, "data"),
        root=lambda w: layout(w).root,
    script:
        "../workflow_scripts/summary.py"


rule pareto:
    input:
        "results/{exp}/summary.parquet",
    output:
        report(
            "results/{exp}/pareto.png",
            caption="../report/pareto.rst",
            category="{exp}",
            subcategory="Figures",
            labels={"figure": "Pareto front"},
        ),
    log:
        "logs/{exp}/pareto.log",
    benchmark:
        "benchmarks/jobs/{exp}/pareto.tsv"
    conda:
        "../envs/cpu.yaml"
    script:
        "../workflow_scripts/pareto.py"


# Single-domain gain and forgetting (Denser ≠ Better): each run's relative change against the post model
# on every benchmark, and a heatmap of each method's best new-task run.
rule gain_forgetting:
    input:
        "results/{exp}/summary.parquet",
    output:
        table="results/{exp}/gain_forgetting.parquet",
        png=report(
            "results/{exp}/gain_forgetting.png",
            caption="../report/gain_forgetting.rst",
            category="{exp}",
            subcategory="Figures",
            labels={"figure": "gain and forgetting"},
        ),
    log:
        "logs/{exp}/gain_forgetting.log",
    benchmark:
        "benchmarks/jobs/{exp}/gain_forgetting.tsv"
    conda:
        "../envs/cpu.yaml"
    params:
        # The summary keeps only the role means: each benchmark's role (old or new) from the layout.
        roles=lambda w: {b[0]: b[2] for b in layout(w).eval_benchmarks()},
    script:
        "../workflow_scripts/gain_forgetting.py"


rule latency:
    input:
        summary="results/{exp}/summary.parquet",
        records=lambda w: layout(w).latency_records(),
    output:
        runs="results/{exp}/latency.parquet",
        steps="results/{exp}/latency_steps.parquet",
        png=report(
            "results/{exp}/latency.png",
            caption="../report/latency.rst",
            category="{exp}",
            subcategory="Figures",
            labels={"figure": "latency"},
        ),
    log:
        "logs/{exp}/latency.log",
    benchmark:
        "benchmarks/jobs/{exp}/latency.tsv"
    conda:
        "../envs/cpu.yaml"
    params:
        # The retention Fishers the masked grafts rank by, which charge them (in results/fisher/, shared): only
        # those in use, so switching EKFAC on where no graft uses KFAC re-runs nothing.
        fishers=lambda w: {k: layout(w).fisher_dir(k) for k in layout(w).mask_kinds()},
    script:
        "../workflow_scripts/latency.py"


rule drift:
    input:
        init=lambda w: f"{layout(w).world_dir}/init",
        # The ladders the base model and the donors lie in: pretraining's, and post-training's (`post~N`).
        ladders=lambda w: sorted(
            {f"{layout(w).world_dir}/ladder"}
            | {layout(w).model_input(d) for d in xcfg(w, "donors")}
        ),
        post=post_dir,
        sft=lambda w: layout(w).sft_dirs(),
    output:
        "results/{exp}/drift.parquet",
    log:
        "logs/{exp}/drift.log",
    benchmark:
        "benchmarks/jobs/{exp}/drift.tsv"
    conda:
        "../envs/cpu.yaml"
    params:
        # The base model is the last ladder checkpoint, the one post-training started from.
        base=lambda w: layout(w).model_dir(
            f"step~{layout(w).world['pretrain']['steps']}"
        ),
        updates=lambda w: layout(w).drift_updates(),
    script:
        "../workflow_scripts/drift.py"


rule takeover:
    input:
        # Each evaluation writes its per-benchmark records beside its metrics.json, last: the records of
        # every run are there once these are (their names differ between experiments, so no rule can
        # declare them as outputs).
        metrics=lambda w: layout(w).eval_metrics(),
    output:
        "results/{exp}/takeover.parquet",
    log:
        "logs/{exp}/takeover.log",
    benchmark:
        "benchmarks/jobs/{exp}/takeover.tsv"
    conda:
        "../envs/cpu.yaml"
    params:
        runs=lambda w: layout(w).runs(),
        old=lambda w: list(layout(w).old_benchmarks()),
        new_task=lambda w: layout(w).new_benchmark()[0],
    script:
        "../workflow_scripts/takeover.py"


STUDY = study_experiments(config)


rule study:
    input:
        [e["summary"] for e in STUDY],
        [e["drift"] for e in STUDY if e["drift"]],
        [e["takeover"] for e in STUDY if e["takeover"]],
        [e["screened"] for e in STUDY if e["screened"]],
    output:
        runs="results/study/study.parquet",
        groups="results/study/groups.parquet",
        png=report(
            "results/study/study.png",
            caption="../report/study.rst",
            category="study",
            subcategory="Figures",
            labels={"figure": "fidelity study"},
        ),
    log:
        "logs/study.log",
    benchmark:
        "benchmarks/jobs/study.tsv"
    conda:
        "../envs/cpu.yaml"
    params:
        experiments=STUDY,
        moe=config["moe"],
        seed=config["seed"],
    script:
        "../workflow_scripts/study.py"


# The tables above as HTML pages for `snakemake --report` (it shows HTML inline, a parquet or CSV only
# as a download): one job for the whole run, so the report costs the DAG one job.
rule report_tables:
    input:
        [t["path"] for t in report_tables()],
    output:
        report(
            directory("results/tables"),
            patterns=["{category}/{table}.html"],
            caption="../report/tables.rst",
            category="{category}",
            subcategory="Tables",
            labels={"table": "{table}"},
        ),
    log:
        "logs/report_tables.log",
    benchmark:
        "benchmarks/jobs/report_tables.tsv"
    conda:
        "../envs/cpu.yaml"
    params:
        tables=report_tables(),
        # The caption tells a continual experiment's summary from a single-domain one.
        continual=CONTINUAL,
    script:
        "../workflow_scripts/report_tables.py"
