# Sampling-based evaluation of every model: the old benchmarks of the world and the held-out mined problems.

BENCHMARKS = OLD_TASKS + [NEW_TASK]


rule evaluate:
    input:
        model=lambda w: eval_model(w)[0],
        old=expand(f"{WORLD}/benchmarks/{{task}}.parquet", task=OLD_TASKS),
        new="results/{exp}/data/heldout.parquet",
    output:
        records=expand("results/{{exp}}/eval/{{run}}/{bench}.parquet", bench=BENCHMARKS),
        metrics="results/{exp}/eval/{run}/metrics.json",
    log:
        "logs/{exp}/eval/{run}.log",
    conda:
        "../envs/sample-vllm.yaml"
    threads: config["threads"]["sample"]
    params:
        model=lambda w: eval_model(w)[1],
        names=BENCHMARKS,
        # Only what sampling uses: switching donor_sft on or off must not re-run evaluations.
        sampling=lambda w: {
            k: v for k, v in xcfg(w, "eval").items() if k != "donor_sft"
        },
        seed=config["seed"],
        backend=config["sampling_backend"],
    script:
        "../workflow_scripts/evaluate.py"
