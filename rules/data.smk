# New-task data: mine the problems the post model cannot solve, then write training traces for them.


rule mine:
    input:
        model=model_dir("post"),
        candidates=f"{WORLD}/candidates.parquet",
    output:
        train="results/{exp}/data/train.parquet",
        heldout="results/{exp}/data/heldout.parquet",
    log:
        "logs/{exp}/mine.log",
    conda:
        "../envs/sample-vllm.yaml"
    threads: config["threads"]["sample"]
    params:
        mining=lambda w: xcfg(w, "mining"),
        seed=config["seed"],
        backend=config["sampling_backend"],
    script:
        "../workflow_scripts/mine.py"


rule traces:
    input:
        "results/{exp}/data/train.parquet",
    output:
        "results/{exp}/data/sft.parquet",
    log:
        "logs/{exp}/traces.log",
    conda:
        "../envs/cpu.yaml"
    params:
        data=lambda w: xcfg(w, "data"),
    script:
        "../workflow_scripts/traces.py"
