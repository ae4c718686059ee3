# The traces each method learns from, one per solved training problem, by data kind:
# data/sft.parquet, with data/sft.json counting problems, traces and the problems left without one.


rule expert_traces:
    input:
        lambda w: layout(w).new_data("train"),
    output:
        sft="results/{exp}/data/sft.parquet",
        stats="results/{exp}/data/sft.json",
    log:
        "logs/{exp}/traces.log",
    benchmark:
        "benchmarks/jobs/{exp}/traces.tsv"
    wildcard_constraints:
        exp=experiments_with("expert"),
    conda:
        "../envs/cpu.yaml"
    script:
        "../workflow_scripts/expert_traces.py"


rule teacher_traces:
    input:
        model=lambda w: layout(w).model_input(xcfg(w, "teacher", "model")),
        problems=lambda w: layout(w).new_data("train"),
    output:
        sft="results/{exp}/data/sft.parquet",
        stats="results/{exp}/data/sft.json",
    log:
        "logs/{exp}/traces.log",
    benchmark:
        "benchmarks/jobs/{exp}/traces.tsv"
    wildcard_constraints:
        exp=experiments_with("teacher"),
    conda:
        "../envs/gpu.yaml"
    threads: config["threads"]["sample"]
    resources:
        **sized("teacher_traces"),
    params:
        model=lambda w: layout(w).model_dir(xcfg(w, "teacher", "model")),
        # STaR's sampling without rationalization: the first verified of up to `attempts` samples.
        sampling=lambda w: {k: v for k, v in xcfg(w, "teacher").items() if k != "model"},
        task=lambda w: layout(w).new_task,
        seed=lambda w: xcfg(w, "seed"),
        backend={"backend": config["sampling_backend"], **config["vllm"]},
    script:
        "../workflow_scripts/star.py"


rule star:
    input:
        model=post_dir,
        problems=lambda w: layout(w).new_data("train"),
    output:
        sft="results/{exp}/data/sft.parquet",
        stats="results/{exp}/data/sft.json",
    log:
        "logs/{exp}/traces.log",
    benchmark:
        "benchmarks/jobs/{exp}/traces.tsv"
    wildcard_constraints:
        exp=experiments_with("star"),
    conda:
        "../envs/gpu.yaml"
    threads: config["threads"]["sample"]
    resources:
        **sized("star"),
    params:
        model=post_dir,
        sampling=lambda w: xcfg(w, "star"),
        task=lambda w: layout(w).new_task,
        seed=lambda w: xcfg(w, "seed"),
        backend={"backend": config["sampling_backend"], **config["vllm"]},
    script:
        "../workflow_scripts/star.py"


rule pedagogical_teacher:
    input:
        post=post_dir,
        problems=lambda w: layout(w).new_data("train"),
    output:
        teacher=directory("results/{exp}/pedagogical/teacher"),
        steps="results/{exp}/pedagogical/steps.jsonl",
        curves=report(
            "results/{exp}/pedagogical/training.png",
            caption="../report/training.rst",
            category="{exp}",
            subcategory="Training curves",
            labels={"method": "pedagogical teacher", "run": "-", "stage": "-"},
        ),
    log:
        "logs/{exp}/pedagogical/teacher.log",
    benchmark:
        "benchmarks/jobs/{exp}/pedagogical/teacher.tsv"
    wildcard_constraints:
        exp=experiments_with("pedagogical"),
    # GRPO samples its groups with TRL's colocated vLLM, inside the training process.
    conda:
        "../envs/gpu.yaml"
    threads: config["threads"]["train"]
    resources:
        **sized("pedagogical_teacher"),
    params:
        # Only what training uses: the trace-writing attempts must not retrain the teacher.
        training=lambda w: {
            k: v
            for k, v in xcfg(w, "pedagogical").items()
            if k not in ("attempts", "attempts_per_round")
        },
        task=lambda w: layout(w).new_task,
        seed=lambda w: xcfg(w, "seed"),
        precision=config["precision"],
        gradient_checkpointing=config["gradient_checkpointing"],
        save_dtype=config["save_dtype"],
        resume_minutes=config["resume_minutes"],
        backend={"backend": config["sampling_backend"], **config["vllm"]},
    script:
        "../workflow_scripts/pedagogical_teacher.py"


rule pedagogical_traces:
    input:
        model="results/{exp}/pedagogical/teacher",
        problems=lambda w: layout(w).new_data("train"),
    output:
        sft="results/{exp}/data/sft.parquet",
        stats="results/{exp}/data/sft.json",
    log:
        "logs/{exp}/traces.log",
    benchmark:
        "benchmarks/jobs/{exp}/traces.tsv"
    wildcard_constraints:
        exp=experiments_with("pedagogical"),
    conda:
        "../envs/gpu.yaml"
    threads: config["threads"]["sample"]
    resources:
        **sized("pedagogical_traces"),
    params:
        sampling=lambda w: {
            k: xcfg(w, "pedagogical", k)
            for k in (
                "attempts",
                "attempts_per_round",
                "temperature",
                "max_new_tokens",
            )
        },
        # The teacher is sampled on the prompts it was trained on.
        template=lambda w: xcfg(w, "pedagogical", "template"),
        task=lambda w: layout(w).new_task,
        seed=lambda w: xcfg(w, "seed"),
        backend={"backend": config["sampling_backend"], **config["vllm"]},
    script:
        "../workflow_scripts/pedagogical_traces.py"
