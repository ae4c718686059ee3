# Sensitive-weight analysis (grafting paper §7): the share of each update (SFT of post, and every graft
# or merge, as grafted model - post) written to the top 1% of coordinates by the post model's retention
# Fisher. Grafted models are temp(): as inputs here they are kept until this rule has run.


rule sensitivity:
    input:
        fisher="results/{exp}/fisher/post/diag",
        post=model_dir("post"),
        updates=sensitivity_inputs,
    output:
        parquet="results/{exp}/sensitivity.parquet",
        png=report(
            "results/{exp}/sensitivity.png",
            caption="../report/sensitivity.rst",
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
