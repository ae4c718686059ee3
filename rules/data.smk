# New-task data: real data sets read once per experiment, hard problems mined on the post model, and the
# knowledge world. The traces each method learns from are written in rules/synth.smk.


# A hub data set downloads where Snakemake runs (a login node with internet), like rules/models.smk.
localrules:
    dataset,


rule dataset:
    input:
        # A local file is an input: edited, or built by another rule, it is read again.
        lambda w: local_source(layout(w).dataset(w.source)["source"]),
    output:
        problems="results/{exp}/data/sources/{source}.parquet",
        stats="results/{exp}/data/sources/{source}.json",
    log:
        "logs/{exp}/data/sources/{source}.log",
    benchmark:
        "benchmarks/jobs/{exp}/data/sources/{source}.tsv"
    wildcard_constraints:
        # A continual experiment's stage data sets: stage~<domain>~problems, stage~<domain>~benchmark.
        source="problems|retention|benchmark~[A-Za-z0-9_-]+|stage~[A-Za-z0-9_]+~(problems|benchmark)",
    conda:
        "../envs/cpu.yaml"
    resources:
        **sized("dataset"),
    params:
        source=lambda w: layout(w).dataset(w.source),
    script:
        "../workflow_scripts/dataset.py"


rule mine:
    input:
        model=post_dir,
        candidates=lambda w: layout(w).candidates(),
        # Checked for leaks: a candidate that an old-task benchmark holds (mining.leaks).
        benchmarks=lambda w: [f for f, _ in layout(w).old_benchmarks().values()],
    output:
        train="results/{exp}/data/train.parquet",
        heldout="results/{exp}/data/heldout.parquet",
    log:
        "logs/{exp}/mine.log",
    benchmark:
        "benchmarks/jobs/{exp}/mine.tsv"
    wildcard_constraints:
        exp=experiments_with(*MINED),
    conda:
        "../envs/gpu.yaml"
    threads: config["threads"]["sample"]
    resources:
        **sized("mine"),
    params:
        mining=lambda w: xcfg(w, "mining"),
        task=lambda w: layout(w).new_task,
        seed=lambda w: xcfg(w, "seed"),
        backend={"backend": config["sampling_backend"], **config["vllm"]},
    script:
        "../workflow_scripts/mine.py"


rule knowledge:
    input:
        # Replay draws fresh old-task problems: the benchmarks are excluded.
        benchmarks=lambda w: (
            [f for f, _ in layout(w).old_benchmarks().values()]
            if xcfg(w, "knowledge", "replay")
            else []
        ),
    output:
        sft="results/{exp}/data/sft.parquet",
        heldout="results/{exp}/data/heldout.parquet",
        facts="results/{exp}/data/facts.parquet",
        stats="results/{exp}/data/sft.json",
    log:
        "logs/{exp}/knowledge.log",
    benchmark:
        "benchmarks/jobs/{exp}/knowledge.tsv"
    wildcard_constraints:
        exp=experiments_with("knowledge"),
    conda:
        "../envs/cpu.yaml"
    params:
        knowledge=lambda w: xcfg(w, "knowledge"),
        old_tasks=lambda w: layout(w).world["old_tasks"],
        seed=lambda w: xcfg(w, "seed"),
    script:
        "../workflow_scripts/knowledge.py"
