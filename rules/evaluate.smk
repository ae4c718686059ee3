# Sampling-based evaluation of every model: the old benchmarks of the world and the held-out mined problems.

BENCHMARKS = OLD_TASKS + [NEW_TASK]


def eval_model(wildcards):
    """The input directory of the model behind an evaluation key, and the model inside it."""
    run = wildcards.run
    if run == "post":
        return model_dir("post"), model_dir("post")
    if run.startswith("sft/"):
        run_dir, epoch = run.rsplit("/", 1)
        return f"results/{wildcards.exp}/{run_dir}", f"results/{wildcards.exp}/{run}"
    if run.startswith("graft/"):
        path = f"results/{wildcards.exp}/{run}/model"
        return path, path
    raise WorkflowError(f"no model for evaluation key {run!r}: expected post, sft/... or graft/...")


rule evaluate:
    input:
        model=lambda w: eval_model(w)[0],
        old=expand(f"{WORLD}/benchmarks/{{task}}.parquet", task=OLD_TASKS),
        new="results/{exp}/data/heldout.parquet",
    output:
        records=expand("results/{{exp}}/eval/{{run}}/{bench}.parquet", bench=BENCHMARKS),
        metrics="results/{exp}/eval/{run}/metrics.json",
    params:
        model=lambda w: eval_model(w)[1],
        names=BENCHMARKS,
        sampling=lambda w: xcfg(w, "eval"),
        seed=config["seed"],
        backend=config["sampling_backend"],
    threads: config["threads"]["sample"]
    log:
        "logs/{exp}/eval/{run}.log",
    script:
        "../workflow_scripts/evaluate.py"
