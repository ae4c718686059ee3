# Sensitive-weight analysis (grafting paper §7): the share of each update (SFT of post, and every graft
# or merge, as grafted model - post) written to the top 1% of coordinates by the post model's retention
# Fisher. Grafted models are temp(): as inputs here they are kept until this rule has run.

from graftlab.analysis.summary import parse_run


def sensitivity_updates(wildcards):
    """Run key -> directory of the updated model, for every SFT of post and every graft/merge run."""
    updates = {}
    for run in runs(wildcards.exp):
        method = parse_run(run)["method"]
        if method == "sft":
            updates[run] = f"results/{wildcards.exp}/{run}"
        elif method in ("graft", "merge"):
            updates[run] = f"results/{wildcards.exp}/{run}/model"
    return updates


def sensitivity_inputs(wildcards):
    """What rules produce: an SFT run is one directory per lr holding a checkpoint per epoch."""
    return sorted(
        {
            path.rsplit("/", 1)[0] if run.startswith("sft/") else path
            for run, path in sensitivity_updates(wildcards).items()
        }
    )


rule sensitivity:
    input:
        fisher="results/{exp}/fisher/post/diag",
        post=model_dir("post"),
        updates=sensitivity_inputs,
    output:
        parquet="results/{exp}/sensitivity.parquet",
        png=report(
            "results/{exp}/sensitivity.png",
            category="Sensitive weights",
            labels={"experiment": "{exp}"},
        ),
    log:
        "logs/{exp}/sensitivity.log",
    conda:
        "../envs/cpu.yaml"
    threads: config["threads"]["sample"]
    params:
        updates=sensitivity_updates,
        top=0.01,
    script:
        "../workflow_scripts/sensitivity.py"
