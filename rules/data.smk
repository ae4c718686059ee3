# New-task data: mine the problems the post model cannot solve, then write training traces for them.


rule mine:
    input:
        model=model_dir("post"),
        candidates=f"{WORLD}/candidates.parquet",
    output:
        train="results/{exp}/data/train.parquet",
        heldout="results/{exp}/data/heldout.parquet",
    params:
        mining=lambda w: xcfg(w, "mining"),
        seed=config["seed"],
        backend=config["sampling_backend"],
    threads: config["threads"]["sample"]
    log:
        "logs/{exp}/mine.log",
    script:
        "../workflow_scripts/mine.py"


rule traces:
    input:
        "results/{exp}/data/train.parquet",
    output:
        "results/{exp}/data/sft.parquet",
    params:
        data=lambda w: xcfg(w, "data"),
    log:
        "logs/{exp}/traces.log",
    script:
        "../workflow_scripts/traces.py"
