# Sampling-based evaluation of every model on the old benchmarks and the held-out new-task problems, each
# graded by its own task (arithmetic exact match, math-verify, greedy knowledge exact match). The
# per-benchmark records are written beside metrics.json, which comes last: it marks a finished model.


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
    wildcard_constraints:
        # A single-domain training run's checkpoints are evaluated together, below.
        run=f"(?!(?:{'|'.join(TRAINED_KINDS)})/).+",
    conda:
        "../envs/gpu.yaml"
    threads: config["threads"]["sample"]
    resources:
        **sized("evaluate"),
    params:
        **eval_params(
            runs=lambda w: [w.run],
            models=lambda w: [layout(w).eval_model(w.run)[1]],
        ),
    script:
        "../workflow_scripts/evaluate.py"


# Every kept checkpoint of a training run (SFT's epochs, an on-policy run's steps) in one job, which pays
# the start-up once; each model still gets its own metrics.json. A rule's outputs are fixed but for its
# wildcards, so each list of checkpoints has its rule (graftlab.planning.layout.checkpoint_rule), its
# `exp` tied to the runs that keep that list.
for checkpoints, runs in CHECKPOINT_GROUPS.items():

    rule:
        name:
            checkpoint_rule(checkpoints)
        input:
            model="results/{exp}/{trainrun}",
            benchmarks=lambda w: [b[1] for b in layout(w).eval_benchmarks()],
        output:
            metrics=[
                f"results/{{exp}}/eval/{{trainrun}}/{c}/metrics.json"
                for c in checkpoints
            ],
        log:
            "logs/{exp}/eval/{trainrun}.log",
        benchmark:
            "benchmarks/jobs/{exp}/eval/{trainrun}.tsv"
        wildcard_constraints:
            exp=runs_pattern(runs),
            trainrun=f"(?:{'|'.join(TRAINED_KINDS)})/.+",
        conda:
            "../envs/gpu.yaml"
        threads: config["threads"]["sample"]
        resources:
            **sized("evaluate_run"),
        params:
            **eval_params(
                runs=checkpoint_keys(checkpoints),
                models=checkpoint_models(checkpoints),
            ),
        script:
            "../workflow_scripts/evaluate.py"
