# New-task data: real data sets read once per experiment, hard problems mined on the post model, and the
# knowledge world. The traces each method learns from are written in rules/synth.smk.


# A hub data set downloads where Snakemake runs (a login node with internet), like rules/models.smk. Each data
# set is read once, under its source and a digest of its settings (graftlab.planning.layout.source_id),
# whichever experiments read it: their jobs keyed by its file (a retention home's, say) are shared too.
localrules:
    dataset,


rule dataset:
    input:
        # A local file is an input: edited, or built by another rule, it is read again.
        lambda w: local_source(SOURCES[w.source][1]["source"]),
    output:
        problems="results/sources/{source}.parquet",
        stats="results/sources/{source}.json",
    log:
        "logs/sources/{source}.log",
    benchmark:
        "benchmarks/jobs/sources/{source}.tsv"
    wildcard_constraints:
        source="|".join(re.escape(s) for s in SOURCES) or "(?!)",
    conda:
        "../envs/cpu.yaml"
    resources:
        **sized("dataset"),
    params:
        # The config key of its first reader, which its errors name.
        name=lambda w: SOURCES[w.source][0],
        source=lambda w: SOURCES[w.source][1],
    script:
        "../workflow_scripts/dataset.py"


# Mined once for every experiment that mines alike: its mining home, results/mined/<model>-<digest>/, keyed by
# all it is mined from (graftlab.planning.layout.Experiment.mining_home); the first such experiment's settings.
rule mine:
    input:
        model=lambda w: mining_layout(w).post_dir,
        candidates=lambda w: mining_layout(w).candidates(),
        # Checked for leaks: a candidate that an old-task benchmark holds (mining.leaks).
        benchmarks=lambda w: [f for f, _ in mining_layout(w).old_benchmarks().values()],
    output:
        train="results/mined/{mined}/train.parquet",
        heldout="results/mined/{mined}/heldout.parquet",
    log:
        "logs/mined/{mined}.log",
    benchmark:
        "benchmarks/jobs/mined/{mined}.tsv"
    wildcard_constraints:
        mined="|".join(re.escape(home) for home in MINING) or "(?!)",
    conda:
        "../envs/gpu.yaml"
    threads: config["threads"]["sample"]
    resources:
        **sized("mine"),
    params:
        mining=lambda w: mining_layout(w).x["mining"],
        task=lambda w: mining_layout(w).new_task,
        seed=lambda w: mining_layout(w).x["seed"],
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
