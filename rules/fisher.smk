# Retention Fisher of the post model: its own rollouts on fresh old-task prompts, then the Fisher of each
# kind a masked graft asks for (and the diagonal one the sensitivity analysis ranks by). Both live in the
# post model's retention home, `results/fisher/<model>-<digest>/` (graftlab.planning.layout,
# `retention_home`), keyed by all they are computed from: experiments that agree on it share one job.


rule rollouts:
    input:
        model=lambda w: retention_layout(w).post_dir,
        benchmarks=lambda w: [
            f for f, _ in retention_layout(w).old_benchmarks().values()
        ],
        prompts=lambda w: retention_layout(w).retention_prompts(),
    output:
        rollouts="results/fisher/{home}/rollouts.parquet",
        stats="results/fisher/{home}/rollouts.json",
    log:
        "logs/fisher/{home}/rollouts.log",
    benchmark:
        "benchmarks/jobs/fisher/{home}/rollouts.tsv"
    wildcard_constraints:
        home=RETENTION_PATTERN,
    conda:
        "../envs/gpu.yaml"
    threads: config["threads"]["sample"]
    resources:
        **sized("rollouts"),
    params:
        tasks=lambda w: retention_layout(w).retention_spec()["tasks"],
        # Only what sampling uses: a new Fisher batch size or EKFAC must not re-sample the rollouts.
        rollouts=lambda w: retention_layout(w).retention_spec()["rollouts"],
        seed=lambda w: retention_layout(w).retention_spec()["seed"],
        backend={"backend": config["sampling_backend"], **config["vllm"]},
    script:
        "../workflow_scripts/rollouts.py"


rule fisher:
    input:
        model=lambda w: retention_layout(w).post_dir,
        rollouts="results/fisher/{home}/rollouts.parquet",
    output:
        directory("results/fisher/{home}/{fisher}"),
    log:
        "logs/fisher/{home}/{fisher}.log",
    benchmark:
        "benchmarks/jobs/fisher/{home}/{fisher}.tsv"
    wildcard_constraints:
        home=RETENTION_PATTERN,
        # The kind, with KFAC's options (graftlab.planning.layout.fisher_name): diag, kfac-completion-ekfac, ...
        fisher="(" + "|".join(FISHER_KINDS) + ")(-[a-z]+)*",
    conda:
        "../envs/gpu.yaml"
    threads: config["threads"]["train"]
    resources:
        **sized("fisher"),
    params:
        # The kind and its options, from the directory's name: EKFAC on must not recompute the diagonal Fisher.
        kind=lambda w: fisher_options(w.fisher)[0],
        options=lambda w: fisher_options(w.fisher)[1],
    # The batch size is memory, not results (the sums are the same up to rounding): the script reads it from
    # the config, so changing it never recomputes a Fisher, nor the grafts and analyses built on one.
    script:
        "../workflow_scripts/fisher.py"
