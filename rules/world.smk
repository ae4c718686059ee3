# The tiny world: a character tokenizer, arithmetic benchmarks, a pretraining corpus, a Qwen3-style model
# pretrained from scratch (its checkpoints are the donor ladder) and post-trained on the old tasks (with
# checkpoints of its own, `post~N`, where posttrain.ladder asks).
# `{world}` is the world's directory under results/: `world` (the main section) or `worlds/{name}`
# (a variant); each rule reads its settings and seed from that world's section.


rule world_tokenizer:
    output:
        directory("results/{world}/tokenizer"),
    log:
        "logs/{world}/tokenizer.log",
    benchmark:
        "benchmarks/jobs/{world}/tokenizer.tsv"
    conda:
        "../envs/cpu.yaml"
    script:
        "../workflow_scripts/world_tokenizer.py"


# One job per old task: the tasks, and so the files, differ between worlds, and a rule's outputs cannot.
rule world_benchmarks:
    output:
        "results/{world}/benchmarks/{task}.parquet",
    log:
        "logs/{world}/benchmarks/{task}.log",
    benchmark:
        "benchmarks/jobs/{world}/benchmarks/{task}.tsv"
    wildcard_constraints:
        task="|".join(sorted({t for w in WORLDS.values() for t in w["old_tasks"]})),
    conda:
        "../envs/cpu.yaml"
    params:
        tasks=lambda w: [w.task],
        size=lambda w: wcfg(w, "benchmark_size"),
        seed=lambda w: wcfg(w, "seed"),
    script:
        "../workflow_scripts/world_benchmarks.py"


rule world_candidates:
    output:
        "results/{world}/candidates.parquet",
    log:
        "logs/{world}/candidates.log",
    benchmark:
        "benchmarks/jobs/{world}/candidates.tsv"
    conda:
        "../envs/cpu.yaml"
    params:
        task=lambda w: wcfg(w, "new_task"),
        size=lambda w: wcfg(w, "candidates"),
        seed=lambda w: wcfg(w, "seed"),
    script:
        "../workflow_scripts/world_candidates.py"


rule world_corpus:
    input:
        # The new task's solved problems (corpus.new_task_share) are drawn outside the mining candidates.
        candidates=lambda w: (
            f"results/{w.world}/candidates.parquet"
            if wcfg(w, "corpus", "new_task_share") > 0
            else []
        ),
    output:
        "results/{world}/corpus.parquet",
    log:
        "logs/{world}/corpus.log",
    benchmark:
        "benchmarks/jobs/{world}/corpus.tsv"
    conda:
        "../envs/cpu.yaml"
    params:
        tasks=lambda w: wcfg(w, "old_tasks") + [wcfg(w, "new_task")],
        documents=lambda w: wcfg(w, "corpus", "documents"),
        lines_per_doc=lambda w: wcfg(w, "corpus", "lines_per_doc"),
        chat_share=lambda w: wcfg(w, "corpus", "chat_share"),
        chat_tasks=lambda w: wcfg(w, "old_tasks"),
        families=lambda w: wcfg(w, "corpus", "families"),
        new_task=lambda w: wcfg(w, "new_task"),
        new_task_share=lambda w: wcfg(w, "corpus", "new_task_share"),
        new_task_problems=lambda w: wcfg(w, "corpus", "new_task_problems"),
        seed=lambda w: wcfg(w, "seed"),
    script:
        "../workflow_scripts/world_corpus.py"


rule world_pretrain:
    input:
        tokenizer="results/{world}/tokenizer",
        corpus="results/{world}/corpus.parquet",
    output:
        # The ladder's length differs between worlds: one directory holds its checkpoints `step~N`.
        ladder=directory("results/{world}/ladder"),
        init=directory("results/{world}/init"),
    log:
        "logs/{world}/pretrain.log",
    benchmark:
        "benchmarks/jobs/{world}/pretrain.tsv"
    conda:
        "../envs/gpu.yaml"
    threads: config["threads"]["train"]
    resources:
        **sized("world_pretrain"),
    params:
        arch=lambda w: wcfg(w, "model"),
        pretrain=lambda w: wcfg(w, "pretrain") | {"block": wcfg(w, "corpus", "block")},
        seed=lambda w: wcfg(w, "seed"),
        precision=config["precision"],
    script:
        "../workflow_scripts/world_pretrain.py"


rule world_posttrain:
    input:
        ladder="results/{world}/ladder",
        benchmarks=lambda w: expand(
            "results/{world}/benchmarks/{task}.parquet",
            world=w.world,
            task=wcfg(w, "old_tasks"),
        ),
    output:
        post=directory("results/{world}/post"),
        # Its checkpoints `post~N` at posttrain.ladder's steps (none by default), donors from within
        # post-training.
        ladder=directory("results/{world}/post_ladder"),
    log:
        "logs/{world}/posttrain.log",
    benchmark:
        "benchmarks/jobs/{world}/posttrain.tsv"
    conda:
        "../envs/gpu.yaml"
    threads: config["threads"]["train"]
    resources:
        **sized("world_posttrain"),
    params:
        # The base model: the ladder ends at the last pretraining step (validated).
        base=lambda w: f"results/{w.world}/ladder/step~{wcfg(w, 'pretrain', 'steps')}",
        tasks=lambda w: wcfg(w, "old_tasks"),
        posttrain=lambda w: wcfg(w, "posttrain"),
        seed=lambda w: wcfg(w, "seed"),
        precision=config["precision"],
    script:
        "../workflow_scripts/world_posttrain.py"
