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


rule world_benchmarks:
    output:
        expand(f"{WORLD}/benchmarks/{{task}}.parquet", task=OLD_TASKS),
    log:
        "logs/world/benchmarks.log",
    conda:
        "../envs/cpu.yaml"
    params:
        tasks=OLD_TASKS,
        size=config["world"]["benchmark_size"],
        seed=config["seed"],
    script:
        "../workflow_scripts/world_benchmarks.py"


rule world_candidates:
    output:
        f"{WORLD}/candidates.parquet",
    log:
        "logs/world/candidates.log",
    conda:
        "../envs/cpu.yaml"
    params:
        task=NEW_TASK,
        size=config["world"]["candidates"],
        seed=config["seed"],
    script:
        "../workflow_scripts/world_candidates.py"


rule world_corpus:
    output:
        f"{WORLD}/corpus.parquet",
    log:
        "logs/world/corpus.log",
    conda:
        "../envs/cpu.yaml"
    params:
        tasks=OLD_TASKS + [NEW_TASK],
        documents=config["world"]["corpus"]["documents"],
        lines_per_doc=config["world"]["corpus"]["lines_per_doc"],
        chat_share=config["world"]["corpus"]["chat_share"],
        chat_tasks=OLD_TASKS,
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
        base=f"{WORLD}/ladder/{LADDER[-1]}",  # the base model: the ladder ends at the last step
        benchmarks=rules.world_benchmarks.output,
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
