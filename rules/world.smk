# The tiny world: a character tokenizer, arithmetic benchmarks, a pretraining corpus, a Qwen3-style model
# pretrained from scratch (its checkpoints are the donor ladder) and post-trained on the old tasks.


rule world_tokenizer:
    output:
        directory(f"{WORLD}/tokenizer"),
    log:
        "logs/world/tokenizer.log",
    conda:
        "../envs/cpu.yaml"
    script:
        "../workflow_scripts/world_tokenizer.py"


rule world_problems:
    output:
        benchmarks=expand(f"{WORLD}/benchmarks/{{task}}.parquet", task=OLD_TASKS),
        candidates=f"{WORLD}/candidates.parquet",
    log:
        "logs/world/problems.log",
    conda:
        "../envs/cpu.yaml"
    params:
        old_tasks=OLD_TASKS,
        new_task=NEW_TASK,
        benchmark_size=config["world"]["benchmark_size"],
        candidates=config["world"]["candidates"],
        seed=config["seed"],
    script:
        "../workflow_scripts/world_problems.py"


rule world_corpus:
    output:
        f"{WORLD}/corpus.parquet",
    log:
        "logs/world/corpus.log",
    conda:
        "../envs/cpu.yaml"
    params:
        tasks=OLD_TASKS + [NEW_TASK],
        corpus=config["world"]["corpus"],
        seed=config["seed"],
    script:
        "../workflow_scripts/world_corpus.py"


rule world_pretrain:
    input:
        tokenizer=f"{WORLD}/tokenizer",
        corpus=f"{WORLD}/corpus.parquet",
    output:
        [directory(f"{WORLD}/ladder/{step}") for step in LADDER],
    log:
        "logs/world/pretrain.log",
    benchmark:
        "benchmarks/jobs/world/pretrain.tsv"
    conda:
        "../envs/train.yaml"
    threads: config["threads"]["train"]
    params:
        arch=config["world"]["model"],
        pretrain=config["world"]["pretrain"]
        | {"block": config["world"]["corpus"]["block"]},
        seed=config["seed"],
    script:
        "../workflow_scripts/world_pretrain.py"


rule world_posttrain:
    input:
        base=f"{WORLD}/ladder/{LADDER[-1]}",
        benchmarks=rules.world_problems.output.benchmarks,
    output:
        directory(f"{WORLD}/post"),
    log:
        "logs/world/posttrain.log",
    benchmark:
        "benchmarks/jobs/world/posttrain.tsv"
    conda:
        "../envs/train.yaml"
    threads: config["threads"]["train"]
    params:
        tasks=OLD_TASKS,
        posttrain=config["world"]["posttrain"],
        seed=config["seed"],
    script:
        "../workflow_scripts/world_posttrain.py"
