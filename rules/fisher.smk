# Retention Fisher of the post model: its own rollouts on fresh old-task prompts, then the
# Fisher of each kind a masked graft asks for, computed once per experiment and kind and kept.


rule rollouts:
    input:
        model=post_dir,
        benchmarks=lambda w: [f for f, _ in layout(w).old_benchmarks().values()],
        prompts=lambda w: layout(w).retention_prompts(),
    output:
        rollouts="results/{exp}/fisher/post/rollouts.parquet",
        stats="results/{exp}/fisher/post/rollouts.json",
    log:
        "logs/{exp}/fisher/post/rollouts.log",
    benchmark:
        "benchmarks/jobs/{exp}/fisher/post/rollouts.tsv"
    conda:
        "../envs/sample-vllm.yaml"
    threads: config["threads"]["sample"]
    resources:
        **sized("rollouts"),
    params:
        tasks=lambda w: layout(w).world["old_tasks"],
        # Only what sampling uses: a new Fisher batch size or EKFAC must not re-sample the rollouts.
        rollouts=lambda w: {
            k: xcfg(w, "fisher", k)
            for k in ("rollouts", "temperature", "max_new_tokens")
        },
        seed=lambda w: xcfg(w, "seed"),
        backend={"backend": config["sampling_backend"], **config["vllm"]},
    script:
        "../workflow_scripts/rollouts.py"


rule fisher:
    input:
        model=post_dir,
        rollouts="results/{exp}/fisher/post/rollouts.parquet",
    output:
        directory("results/{exp}/fisher/post/{mask}"),
    log:
        "logs/{exp}/fisher/post/{mask}.log",
    benchmark:
        "benchmarks/jobs/{exp}/fisher/post/{mask}.tsv"
    wildcard_constraints:
        # The kind a masked graft names (`mask~{mask}`); mask~none ranks by no Fisher.
        mask="|".join(FISHER_KINDS),
    conda:
        "../envs/train.yaml"
    threads: config["threads"]["train"]
    resources:
        **sized("fisher"),
    params:
        kind=lambda w: w.mask,
        # Options of one kind only: switching EKFAC on must not recompute the diagonal Fisher.
        options=lambda w: (
            {
                "ekfac": xcfg(w, "fisher", "ekfac"),
                "positions": xcfg(w, "fisher", "kfac_positions"),
            }
            if w.mask == "kfac"
            else {}
        ),
    # The batch size is memory, not results (the sums are the same up to rounding): the script reads it
    # from the config, so changing it never recomputes a Fisher, nor the grafts and analyses built on one.
    script:
        "../workflow_scripts/fisher.py"
