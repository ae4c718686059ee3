# SFT of the post model (the baseline) and of every donor: one run per learning rate, a checkpoint per epoch.


rule sft:
    input:
        model=lambda w: model_dir(w.base, w.exp),
        data="results/{exp}/data/sft.parquet",
    output:
        directory("results/{exp}/sft/{base}/lr~{lr}"),
    log:
        "logs/{exp}/sft/{base}/lr~{lr}.log",
    benchmark:
        "benchmarks/jobs/{exp}/sft/{base}/lr~{lr}.tsv"
    conda:
        "../envs/train.yaml"
    threads: config["threads"]["train"]
    params:
        lr=lambda w: float(w.lr),
        epochs=lambda w: xcfg(w, "sft", "epochs"),
        batch_size=lambda w: xcfg(w, "sft", "batch_size"),
        seed=config["seed"],
    script:
        "../workflow_scripts/sft.py"
