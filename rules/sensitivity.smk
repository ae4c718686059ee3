# Sensitive-weight analysis (grafting paper §7): the share of each update (SFT of post, and every graft
# or merge, as grafted model - post) written to the top 1% of coordinates by the post model's retention
# Fisher. One job per update, run while a temp() grafted model exists (beside its evaluation), so adding
# a run never rebuilds grafts already analysed; then one table and figure per experiment.


rule sensitivity_update:
    input:
        fisher=lambda w: layout(w).fisher_dir("diag"),
        post=post_dir,
        model=lambda w: layout(w).eval_model(w.run)[0],
    output:
        "results/{exp}/sensitivity/{run}/share.parquet",
    log:
        "logs/{exp}/sensitivity/{run}.log",
    benchmark:
        "benchmarks/jobs/{exp}/sensitivity/{run}.tsv"
    wildcard_constraints:
        run="(?!graft/).+",  # a graft's share is measured by its sweep's job (rules/graft.smk)
    conda:
        "../envs/cpu.yaml"
    threads: 1  # numpy, one thread (graftlab.analysis.sensitivity_shares)
    resources:
        **sized("sensitivity_update"),
    params:
        run=lambda w: w.run,
        model=lambda w: layout(w).eval_model(w.run)[1],
        top=0.01,
    script:
        "../workflow_scripts/sensitivity_update.py"


rule sensitivity:
    input:
        lambda w: [
            f"results/{w.exp}/sensitivity/{run}/share.parquet"
            for run in layout(w).sensitivity_runs()
        ],
    output:
        parquet="results/{exp}/sensitivity.parquet",
        png=report(
            "results/{exp}/sensitivity.png",
            caption="../report/sensitivity.rst",
            category="{exp}",
            subcategory="Figures",
            labels={"figure": "sensitive weights"},
        ),
    log:
        "logs/{exp}/sensitivity.log",
    benchmark:
        "benchmarks/jobs/{exp}/sensitivity.tsv"
    conda:
        "../envs/cpu.yaml"
    script:
        "../workflow_scripts/sensitivity.py"
