# Retention Fisher of the post model (DESIGN §3): its own rollouts on fresh old-task prompts, then the
# Fisher of each kind a masked graft asks for, computed once per experiment and kind and kept.


rule rollouts:
    input:
        model=post_dir,
        benchmarks=lambda w: [f for f, _ in old_benchmarks(w.exp).values()],
        prompts=retention_prompts,
    output:
        rollouts="results/{exp}/fisher/post/rollouts.parquet",
        stats="results/{exp}/fisher/post/rollouts.json",
    log:
        "logs/{exp}/fisher/post/rollouts.log",
    conda:
        "../envs/sample-vllm.yaml"
    threads: config["threads"]["sample"]
    params:
        tasks=lambda w: world_of(w.exp)[1]["old_tasks"],
        # Only what sampling uses: a new Fisher batch size or EKFAC must not re-sample the rollouts.
        rollouts=lambda w: {
            k: xcfg(w, "fisher", k)
            for k in ("rollouts", "temperature", "max_new_tokens")
        },
        seed=lambda w: xcfg(w, "seed"),
        backend=config["sampling_backend"],
    script:
        "../workflow_scripts/rollouts.py"


rule fisher:
    input:
        model=post_dir,
        rollouts="results/{exp}/fisher/post/rollouts.parquet",
    output:
        directory("results/{exp}/fisher/post/{kind}"),
    log:
        "logs/{exp}/fisher/post/{kind}.log",
    benchmark:
        "benchmarks/jobs/{exp}/fisher/post/{kind}.tsv"
    conda:
        "../envs/train.yaml"
    threads: config["threads"]["train"]
    params:
        kind=lambda w: w.kind,
        # Options of one kind only: switching EKFAC on must not recompute the diagonal Fisher.
        options=lambda w: (
            {
                "ekfac": xcfg(w, "fisher", "ekfac"),
                "positions": xcfg(w, "fisher", "kfac_positions"),
            }
            if w.kind == "kfac"
            else {}
        ),
    # The batch size is memory, not results (the sums are the same up to rounding): the script reads it
    # from the config, so changing it never recomputes a Fisher, nor the grafts and analyses built on one.
    script:
        "../workflow_scripts/fisher.py"
