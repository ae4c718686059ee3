# SFT of the post model (the baseline) and of every donor: one run per learning rate, a checkpoint per epoch.
# `{donor}` names the model an update starts from, here as in rules/graft.smk: `post` or a donor.


rule sft:
    input:
        model=lambda w: layout(w).model_input(w.donor),
        data="results/{exp}/data/sft.parquet",
    output:
        directory("results/{exp}/sft/{donor}/lr~{lr}"),
    log:
        "logs/{exp}/sft/{donor}/lr~{lr}.log",
    benchmark:
        "benchmarks/jobs/{exp}/sft/{donor}/lr~{lr}.tsv"
    conda:
        "../envs/train.yaml"
    threads: config["threads"]["train"]
    resources:
        **sized("sft"),
    params:
        model=lambda w: layout(w).model_dir(w.donor),
        lr=lambda w: float(w.lr),
        epochs=lambda w: xcfg(w, "sft", "epochs"),
        batch_size=lambda w: xcfg(w, "sft", "batch_size"),
        micro_batch_size=lambda w: xcfg(w, "sft", "micro_batch_size"),
        seed=lambda w: xcfg(w, "seed"),
        precision=config["precision"],
        gradient_checkpointing=config["gradient_checkpointing"],
        save_dtype=config["save_dtype"],
        resume_minutes=config["resume_minutes"],
    script:
        "../workflow_scripts/sft.py"


rule opsd:
    input:
        model=post_dir,
        data="results/{exp}/data/sft.parquet",
        # Knowledge questions are conditioned on their person's article, written from the facts.
        facts=lambda w: (
            f"results/{w.exp}/data/facts.parquet"
            if xcfg(w, "data") == "knowledge"
            else []
        ),
    output:
        directory("results/{exp}/opsd/post/alpha~{alpha}/lr~{lr}"),
    log:
        "logs/{exp}/opsd/post/alpha~{alpha}/lr~{lr}.log",
    benchmark:
        "benchmarks/jobs/{exp}/opsd/post/alpha~{alpha}/lr~{lr}.tsv"
    # On-policy: it samples with vLLM inside the training process, so it needs vLLM's environment.
    conda:
        "../envs/sample-vllm.yaml"
    threads: config["threads"]["train"]
    resources:
        **sized("opsd"),
    params:
        alpha=lambda w: float(w.alpha),
        lr=lambda w: float(w.lr),
        opsd=lambda w: {
            k: v for k, v in xcfg(w, "opsd").items() if k not in ("alpha", "lr")
        },
        save_steps=lambda w: opsd_steps(xcfg(w, "opsd")),
        seed=lambda w: xcfg(w, "seed"),
        precision=config["precision"],
        gradient_checkpointing=config["gradient_checkpointing"],
        save_dtype=config["save_dtype"],
        resume_minutes=config["resume_minutes"],
        backend={"backend": config["sampling_backend"], **config["vllm"]},
    script:
        "../workflow_scripts/opsd.py"
