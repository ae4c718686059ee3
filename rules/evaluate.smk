# Sampling-based evaluation of every model on the old benchmarks and the held-out new-task problems, each
# graded by its own task (arithmetic exact match, math-verify, greedy knowledge exact match). The
# per-benchmark records are written beside metrics.json, which comes last: it marks a finished model.
# With `eval.parts: N` (the dry run names a job a node's engines would sample past the GPU partition's time
# limit, and the N it needs) an evaluation is sampled first by N parts, each every N-th chunk of every call,
# at once on nodes of their own; the job then reads them back and grades (graftlab.sample_chunks.Part).


rule evaluate:
    input:
        **evaluate_inputs(),
    output:
        metrics="results/{exp}/eval/{run}/metrics.json",
    log:
        "logs/{exp}/eval/{run}.log",
    benchmark:
        "benchmarks/jobs/{exp}/eval/{run}.tsv"
    wildcard_constraints:
        # A single-domain training run's checkpoints are evaluated together, below; a graft by its sweep's job;
        # an evaluation several experiments share by its own job, below.
        run=f"(?!(?:{'|'.join((*TRAINED_KINDS, 'graft'))})/).+",
        exp=SHARED_EVALS_EXCLUDED,
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


rule evaluate_part:
    input:
        model=lambda w: layout(w).eval_model(w.run)[0],
        benchmarks=lambda w: [b[1] for b in layout(w).eval_benchmarks()],
    output:
        temp("results/{exp}/eval/{run}/part~{part}of{parts}"),
    log:
        "logs/{exp}/eval/{run}/part~{part}of{parts}.log",
    benchmark:
        "benchmarks/jobs/{exp}/eval/{run}/part~{part}of{parts}.tsv"
    wildcard_constraints:
        run=f"(?!(?:{'|'.join((*TRAINED_KINDS, 'graft'))})/).+",
        part=r"\d+",
        parts=r"\d+",
    conda:
        "../envs/gpu.yaml"
    threads: config["threads"]["sample"]
    resources:
        **sized("evaluate_part"),
    params:
        **eval_params(
            runs=lambda w: [w.run],
            models=lambda w: [layout(w).eval_model(w.run)[1]],
            metrics=lambda w: [f"results/{w.exp}/eval/{w.run}/metrics.json"],
        ),
    script:
        "../workflow_scripts/evaluate_part.py"


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
            parts=part_files(
                "evaluate_run", lambda w: f"results/{w.exp}/eval/{w.trainrun}"
            ),
            # Under `eval.adaptive_checkpoints`, the experiment's decisions: a checkpoint screened out is
            # scored no further (each checkpoint's samples are kept, so a new decision re-scores from them).
            screened=lambda w: screened_checkpoints(w) or [],
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

    rule:
        name:
            f"{checkpoint_rule(checkpoints)}_part"
        input:
            model="results/{exp}/{trainrun}",
            benchmarks=lambda w: [b[1] for b in layout(w).eval_benchmarks()],
            screened=lambda w: screened_checkpoints(w) or [],
        output:
            temp("results/{exp}/eval/{trainrun}/part~{part}of{parts}"),
        log:
            "logs/{exp}/eval/{trainrun}/part~{part}of{parts}.log",
        benchmark:
            "benchmarks/jobs/{exp}/eval/{trainrun}/part~{part}of{parts}.tsv"
        wildcard_constraints:
            exp=runs_pattern(runs),
            trainrun=f"(?:{'|'.join(TRAINED_KINDS)})/.+",
            part=r"\d+",
            parts=r"\d+",
        conda:
            "../envs/gpu.yaml"
        threads: config["threads"]["sample"]
        resources:
            **sized("evaluate_run_part"),
        params:
            **eval_params(
                runs=checkpoint_keys(checkpoints),
                models=checkpoint_models(checkpoints),
                metrics=checkpoint_metrics(checkpoints),
            ),
        script:
            "../workflow_scripts/evaluate_part.py"

    # Under `eval.adaptive_checkpoints`, every checkpoint first scored on the `eval.adaptive` share of the
    # validation problems, into results/{exp}/screen/, as a graft sweep's are (rules/graft.smk).
    rule:
        name:
            f"{checkpoint_rule(checkpoints)}_screen"
        input:
            model="results/{exp}/{trainrun}",
            benchmarks=lambda w: [b[1] for b in layout(w).eval_benchmarks()],
        output:
            metrics=[
                f"results/{{exp}}/screen/{{trainrun}}/{c}/metrics.json"
                for c in checkpoints
            ],
        log:
            "logs/{exp}/screen/{trainrun}.log",
        benchmark:
            "benchmarks/jobs/{exp}/screen/{trainrun}.tsv"
        wildcard_constraints:
            exp=runs_pattern(runs, under="screen"),
            trainrun=f"(?:{'|'.join(TRAINED_KINDS)})/post/.+",
        conda:
            "../envs/gpu.yaml"
        threads: config["threads"]["sample"]
        resources:
            **sized("evaluate_run_screen"),
        params:
            **eval_params(
                runs=checkpoint_keys(checkpoints),
                models=checkpoint_models(checkpoints),
            ),
            screening=lambda w: xcfg(w, "eval", "adaptive"),
        script:
            "../workflow_scripts/evaluate.py"


# An evaluation several experiments ask for alike (the post model's, or a donor's as it is, on the same
# benchmarks with the same settings: graftlab.planning.layout.shared_evaluations) is one job, which scores the
# model once and writes its records and metrics.json for each experiment. Its rule has no wildcards: its
# outputs are every such experiment's.
for digest, members in SHARED_EVALS.items():
    first = FixedWildcards(exp=members[0][0], run=members[0][1])

    rule:
        name:
            f"evaluate_shared_{digest}"
        input:
            **bound(evaluate_inputs(), first),
        output:
            metrics=[f"results/{exp}/eval/{run}/metrics.json" for exp, run in members],
        log:
            f"logs/shared/eval~{digest}.log",
        benchmark:
            f"benchmarks/jobs/shared/eval~{digest}.tsv"
        conda:
            "../envs/gpu.yaml"
        threads: config["threads"]["sample"]
        resources:
            **sized("evaluate", first),
        params:
            **bound(
                eval_params(
                    runs=lambda w: [run for _, run in members],
                    models=lambda w: [layout(w).eval_model(w.run)[1]] * len(members),
                ),
                first,
            ),
        script:
            "../workflow_scripts/evaluate.py"
