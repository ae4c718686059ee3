# SFT of the post model (the baseline) and of every donor: one run per learning rate, a checkpoint per epoch.
# `{donor}` names the model an update starts from, here as in rules/graft.smk: `post` or a donor.


rule sft:
    input:
        model=lambda w: layout(w).model_input(w.donor),
        data="results/{exp}/data/sft.parquet",
        post=post_dir,
    output:
        report(
            directory("results/{exp}/sft/{donor}/lr~{lr}"),
            patterns=["{curves,training}.png"],
            caption="../report/training.rst",
            category="{exp}",
            subcategory="Training curves",
            labels={"method": "sft", "run": "{donor} lr~{lr}", "stage": "-"},
        ),
    log:
        "logs/{exp}/sft/{donor}/lr~{lr}.log",
    benchmark:
        "benchmarks/jobs/{exp}/sft/{donor}/lr~{lr}.tsv"
    conda:
        "../envs/gpu.yaml"
    threads: config["threads"]["train"]
    resources:
        **sized("sft"),
    params:
        model=lambda w: layout(w).model_dir(w.donor),
        # The donor learns the post model's chat format (a pre-training checkpoint may have none).
        template=post_dir,
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
        report(
            directory("results/{exp}/opsd/post/alpha~{alpha}/lr~{lr}"),
            patterns=["{curves,training}.png"],
            caption="../report/training.rst",
            category="{exp}",
            subcategory="Training curves",
            labels={"method": "opsd", "run": "alpha~{alpha} lr~{lr}", "stage": "-"},
        ),
    log:
        "logs/{exp}/opsd/post/alpha~{alpha}/lr~{lr}.log",
    benchmark:
        "benchmarks/jobs/{exp}/opsd/post/alpha~{alpha}/lr~{lr}.tsv"
    # On-policy: it samples with vLLM inside the training process, so it needs vLLM's environment.
    conda:
        "../envs/gpu.yaml"
    threads: config["threads"]["on_policy"]
    resources:
        **sized("opsd"),
    params:
        alpha=lambda w: float(w.alpha),
        lr=lambda w: float(w.lr),
        opsd=lambda w: {
            k: v for k, v in xcfg(w, "opsd").items() if k not in ("alpha", "lr")
        },
        save_steps=lambda w: kept_steps(xcfg(w, "opsd")),
        seed=lambda w: xcfg(w, "seed"),
        precision=config["precision"],
        gradient_checkpointing=config["gradient_checkpointing"],
        save_dtype=config["save_dtype"],
        resume_minutes=config["resume_minutes"],
        backend={"backend": config["sampling_backend"], **config["vllm"]},
    script:
        "../workflow_scripts/opsd.py"


# GRPO (TRL's trainer) and SDPO of the post model: on-policy like OPSD, rewarded by the task's verifier.
# `sdpo` and `sdpo_cot` (every response token distilled) are one rule, both configured in `sdpo:`.
rule grpo:
    input:
        model=post_dir,
        data="results/{exp}/data/sft.parquet",
    output:
        report(
            directory("results/{exp}/grpo/post/lr~{lr}"),
            patterns=["{curves,training}.png"],
            caption="../report/training.rst",
            category="{exp}",
            subcategory="Training curves",
            labels={"method": "grpo", "run": "lr~{lr}", "stage": "-"},
        ),
    log:
        "logs/{exp}/grpo/post/lr~{lr}.log",
    benchmark:
        "benchmarks/jobs/{exp}/grpo/post/lr~{lr}.tsv"
    conda:
        "../envs/gpu.yaml"
    threads: config["threads"]["on_policy"]
    resources:
        **sized("grpo"),
    params:
        lr=lambda w: float(w.lr),
        grpo=lambda w: {
            k: v for k, v in xcfg(w, "grpo").items() if k not in ("lr", "checkpoints")
        },
        save_steps=lambda w: kept_steps(xcfg(w, "grpo")),
        seed=lambda w: xcfg(w, "seed"),
        precision=config["precision"],
        gradient_checkpointing=config["gradient_checkpointing"],
        save_dtype=config["save_dtype"],
        resume_minutes=config["resume_minutes"],
        backend={"backend": config["sampling_backend"], **config["vllm"]},
    script:
        "../workflow_scripts/grpo.py"


rule sdpo:
    input:
        model=post_dir,
        data="results/{exp}/data/sft.parquet",
    output:
        report(
            directory("results/{exp}/{sdpo}/post/teacher~{teacher}/lr~{lr}"),
            patterns=["{curves,training}.png"],
            caption="../report/training.rst",
            category="{exp}",
            subcategory="Training curves",
            labels={
                "method": "{sdpo}",
                "run": "teacher~{teacher} lr~{lr}",
                "stage": "-",
            },
        ),
    log:
        "logs/{exp}/{sdpo}/post/teacher~{teacher}/lr~{lr}.log",
    benchmark:
        "benchmarks/jobs/{exp}/{sdpo}/post/teacher~{teacher}/lr~{lr}.tsv"
    conda:
        "../envs/gpu.yaml"
    threads: config["threads"]["on_policy"]
    resources:
        **sized("sdpo"),
    params:
        cot=lambda w: w.sdpo == "sdpo_cot",
        teacher=lambda w: w.teacher,
        lr=lambda w: float(w.lr),
        sdpo=lambda w: {
            k: v
            for k, v in xcfg(w, "sdpo").items()
            if k not in ("lr", "checkpoints", "teachers", "cot_teachers")
        },
        save_steps=lambda w: kept_steps(xcfg(w, "sdpo")),
        seed=lambda w: xcfg(w, "seed"),
        precision=config["precision"],
        gradient_checkpointing=config["gradient_checkpointing"],
        save_dtype=config["save_dtype"],
        resume_minutes=config["resume_minutes"],
        backend={"backend": config["sampling_backend"], **config["vllm"]},
    script:
        "../workflow_scripts/sdpo.py"
