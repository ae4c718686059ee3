# Sampling-based evaluation of every model on the old benchmarks and the held-out new-task problems, each
# graded by its own task (arithmetic exact match, math-verify, greedy knowledge exact match). The
# per-benchmark records are written beside metrics.json, which comes last: it marks a finished job.


rule evaluate:
    input:
        model=lambda w: layout(w).eval_model(w.run)[0],
        benchmarks=lambda w: [b[1] for b in layout(w).eval_benchmarks()],
    output:
        metrics="results/{exp}/eval/{run}/metrics.json",
    log:
        "logs/{exp}/eval/{run}.log",
    benchmark:
        "benchmarks/jobs/{exp}/eval/{run}.tsv"
    conda:
        "../envs/sample-vllm.yaml"
    threads: config["threads"]["sample"]
    resources:
        **sized("evaluate"),
    params:
        **eval_params(model=lambda w: layout(w).eval_model(w.run)[1]),
    script:
        "../workflow_scripts/evaluate.py"
