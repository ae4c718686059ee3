# Continual experiments (`stages:`, docs/continual.md): every method as one chain of cached jobs, its stage k
# trained from its own stage k-1 model (graftlab.planning.chains, unit-tested there). Each rule's params hold only
# stage k's settings, so a change to stage k re-runs that stage and, through its new output, every later
# one: nothing before it. Evaluation is rules/evaluate.smk's, keyed `chain/<chain>/stage~k`.


wildcard_constraints:
    k="[0-9]+",
    tune="sft|tune",
    form="|".join(GRAFT_FORMS.values()),


rule stage_data:
    input:
        # Old benchmarks: no stage draws a problem of them (stages' own domains never overlap).
        benchmarks=lambda w: [f for f, _ in chains(w).old_benchmarks().values()],
        problems=lambda w: (
            source_file(chains(w).stage(stage_of(w))["problems"])
            if chains(w).stage(stage_of(w))["problems"]
            else []
        ),
    output:
        sft="results/{exp}/stage~{k}/data/sft.parquet",
        heldout="results/{exp}/stage~{k}/data/heldout.parquet",
        facts="results/{exp}/stage~{k}/data/facts.parquet",
        stats="results/{exp}/stage~{k}/data/sft.json",
    log:
        "logs/{exp}/stage~{k}/data.log",
    benchmark:
        "benchmarks/jobs/{exp}/stage~{k}/data.tsv"
    wildcard_constraints:
        exp=CONTINUAL_PATTERN,
    conda:
        "../envs/cpu.yaml"
    params:
        # What the data is made of, not how long it is trained: new steps or epochs keep the data.
        # Keys sorted: Snakemake compares params with their order, and a config file may order them otherwise.
        stage=lambda w: json.loads(
            json.dumps(
                {
                    k: v
                    for k, v in chains(w).stage(stage_of(w)).items()
                    if k not in ("epochs", "steps")
                },
                sort_keys=True,
            )
        ),
        old_tasks=lambda w: chains(w).world["old_tasks"],
        star=lambda w: stage_data_kind(chains(w).stage(stage_of(w))) == "star",
        seed=lambda w: xcfg(w, "seed"),
    script:
        "../workflow_scripts/stage_data.py"


# A `data: star` stage's traces: the post model's own first verified sample of up to `star.attempts` per
# training problem (the same traces for every chain: the off-policy data each method learns from).
rule stage_star:
    input:
        model=post_dir,
        problems="results/{exp}/stage~{k}/data/sft.parquet",
    output:
        sft="results/{exp}/stage~{k}/data/star.parquet",
        stats="results/{exp}/stage~{k}/data/star.json",
    log:
        "logs/{exp}/stage~{k}/star.log",
    benchmark:
        "benchmarks/jobs/{exp}/stage~{k}/star.tsv"
    wildcard_constraints:
        exp=CONTINUAL_PATTERN,
    conda:
        "../envs/gpu.yaml"
    threads: config["threads"]["sample"]
    resources:
        **sized("star"),
    params:
        model=post_dir,
        sampling=lambda w: xcfg(w, "star"),
        task=lambda w: chains(w).stage_benchmark(stage_of(w))[2],
        seed=lambda w: xcfg(w, "seed"),
        backend={"backend": config["sampling_backend"], **config["vllm"]},
    script:
        "../workflow_scripts/star.py"


# SFT from the chain's previous stage (`sft`: base post is the SFT method, base a donor the cumulative
# donor's chain), or of the fixed donor on the stage's data alone (`tune`: graft_chain's update).
rule chain_sft:
    input:
        model=lambda w: (
            chains(w).model_input(w.donor)
            if w.tune == "tune"
            else previous(w, "sft")[0]
        ),
        data=lambda w: chains(w).sft_data(stage_of(w)),
        post=post_dir,
    output:
        report(
            directory("results/{exp}/chain/{tune}/{donor}/lr~{lr}/stage~{k}"),
            patterns=["{curves,training}.png"],
            caption="../report/training.rst",
            category="{exp}",
            subcategory="Training curves",
            labels={"method": "{tune}", "run": "{donor} lr~{lr}", "stage": "{k}"},
        ),
    log:
        "logs/{exp}/chain/{tune}/{donor}/lr~{lr}/stage~{k}.log",
    benchmark:
        "benchmarks/jobs/{exp}/chain/{tune}/{donor}/lr~{lr}/stage~{k}.tsv"
    wildcard_constraints:
        exp=CONTINUAL_PATTERN,
    conda:
        "../envs/gpu.yaml"
    # A stage's SFT is small, as an on-policy stage is: one thread, two side by side, rather than both cores
    # held while the other jobs wait (benchmarks/README.md).
    threads: config["threads"]["on_policy"]
    resources:
        **sized("sft"),
    params:
        model=lambda w: (
            chains(w).model_dir(w.donor) if w.tune == "tune" else previous(w, "sft")[1]
        ),
        template=post_dir,  # the post model's chat format, as rule sft's donors
        lr=lambda w: float(w.lr),
        epochs=lambda w: chains(w).epochs(stage_of(w)),
        batch_size=lambda w: xcfg(w, "sft", "batch_size"),
        micro_batch_size=lambda w: xcfg(w, "sft", "micro_batch_size"),
        seed=lambda w: xcfg(w, "seed"),
        precision=config["precision"],
        gradient_checkpointing=config["gradient_checkpointing"],
        save_dtype=config["save_dtype"],
        resume_minutes=config["resume_minutes"],
    script:
        "../workflow_scripts/sft.py"


# A merge chain's SFT at stage k: from the chain's own model after stage k-1 (the post model at stage 1),
# which differs with the chain's lam and mask, so it lies inside the chain's stage directory. Sized as SFT.
use rule chain_sft as chain_merge_sft with:
    input:
        model=lambda w: previous(w, MERGE_CHAIN)[0],
        data=lambda w: chains(w).sft_data(stage_of(w)),
        post=post_dir,
    output:
        report(
            directory(
                "results/{exp}/chain/merge_chain/post/lr~{lr}/lam~{lam}/mask~{mask}/rho~{rho}/stage~{k}/sft"
            ),
            patterns=["{curves,training}.png"],
            caption="../report/training.rst",
            category="{exp}",
            subcategory="Training curves",
            labels={
                "method": "merge_chain",
                "run": "lr~{lr} lam~{lam} mask~{mask} rho~{rho}",
                "stage": "{k}",
            },
        ),
    log:
        "logs/{exp}/chain/merge_chain/post/lr~{lr}/lam~{lam}/mask~{mask}/rho~{rho}/stage~{k}/sft.log",
    benchmark:
        "benchmarks/jobs/{exp}/chain/merge_chain/post/lr~{lr}/lam~{lam}/mask~{mask}/rho~{rho}/stage~{k}/sft.tsv"
    # chain_sft's other params stand: Snakemake merges params by name (inputs it replaces whole).
    params:
        model=lambda w: previous(w, MERGE_CHAIN)[1],


rule chain_graft:
    input:
        unpack(graft_inputs),
    output:
        model=directory(
            "results/{exp}/chain/{form}/{donor}/lr~{lr}/lam~{lam}/mask~{mask}/rho~{rho}/stage~{k}/model"
        ),
        seconds="results/{exp}/chain/{form}/{donor}/lr~{lr}/lam~{lam}/mask~{mask}/rho~{rho}/stage~{k}/seconds.json",
    log:
        "logs/{exp}/chain/{form}/{donor}/lr~{lr}/lam~{lam}/mask~{mask}/rho~{rho}/stage~{k}.log",
    benchmark:
        "benchmarks/jobs/{exp}/chain/{form}/{donor}/lr~{lr}/lam~{lam}/mask~{mask}/rho~{rho}/stage~{k}.tsv"
    wildcard_constraints:
        exp=CONTINUAL_PATTERN,
    conda:
        "../envs/cpu.yaml"
    threads: config["threads"]["sample"]
    resources:
        **sized("chain_graft"),
    params:
        donor=lambda w: chains(w).donor_pair(wchain(w, w.form), stage_of(w))[0][1],
        epoch=lambda w: chains(w).epochs(stage_of(w)),
        lam=lambda w: w.lam,
        mask=lambda w: w.mask,
        rho=lambda w: w.rho,
        # The masks of the chain's section: `graft` for the graft chains, `merge` for the merge chains.
        mask_settings=lambda w: (
            {}
            if w.mask == "none"
            else {
                k: xcfg(w, section_of(w.form), "masks", k) for k in ("scope", "score")
            }
        ),
    script:
        "../workflow_scripts/chain_graft.py"


# The retention Fisher of a graft chain's model after stage k, for its masked graft at stage k+1: its own
# rollouts on fresh problems of the old tasks and of the tiny-world stages up to k.
rule chain_rollouts:
    input:
        model="results/{exp}/chain/{form}/{donor}/lr~{lr}/lam~{lam}/mask~{mask}/rho~{rho}/stage~{k}/model",
        benchmarks=lambda w: chains(w).retention(stage_of(w) + 1)[1],
        prompts=lambda w: chains(w).retention_prompts(),
    output:
        rollouts="results/{exp}/chain/{form}/{donor}/lr~{lr}/lam~{lam}/mask~{mask}/rho~{rho}/stage~{k}/fisher/rollouts.parquet",
        stats="results/{exp}/chain/{form}/{donor}/lr~{lr}/lam~{lam}/mask~{mask}/rho~{rho}/stage~{k}/fisher/rollouts.json",
    log:
        "logs/{exp}/chain/{form}/{donor}/lr~{lr}/lam~{lam}/mask~{mask}/rho~{rho}/stage~{k}/rollouts.log",
    benchmark:
        "benchmarks/jobs/{exp}/chain/{form}/{donor}/lr~{lr}/lam~{lam}/mask~{mask}/rho~{rho}/stage~{k}/rollouts.tsv"
    wildcard_constraints:
        exp=CONTINUAL_PATTERN,
    conda:
        "../envs/gpu.yaml"
    threads: config["threads"]["sample"]
    resources:
        **sized("rollouts"),
    params:
        tasks=lambda w: chains(w).retention(stage_of(w) + 1)[0],
        rollouts=lambda w: {k: xcfg(w, "fisher", k) for k in ROLLOUT_KEYS},
        seed=lambda w: xcfg(w, "seed"),
        backend={"backend": config["sampling_backend"], **config["vllm"]},
    script:
        "../workflow_scripts/rollouts.py"


rule chain_fisher:
    input:
        model="results/{exp}/chain/{form}/{donor}/lr~{lr}/lam~{lam}/mask~{mask}/rho~{rho}/stage~{k}/model",
        rollouts="results/{exp}/chain/{form}/{donor}/lr~{lr}/lam~{lam}/mask~{mask}/rho~{rho}/stage~{k}/fisher/rollouts.parquet",
    output:
        directory(
            "results/{exp}/chain/{form}/{donor}/lr~{lr}/lam~{lam}/mask~{mask}/rho~{rho}/stage~{k}/fisher/{kind}"
        ),
    log:
        "logs/{exp}/chain/{form}/{donor}/lr~{lr}/lam~{lam}/mask~{mask}/rho~{rho}/stage~{k}/fisher-{kind}.log",
    benchmark:
        "benchmarks/jobs/{exp}/chain/{form}/{donor}/lr~{lr}/lam~{lam}/mask~{mask}/rho~{rho}/stage~{k}/fisher-{kind}.tsv"
    wildcard_constraints:
        exp=CONTINUAL_PATTERN,
        kind="|".join(FISHER_KINDS),
    conda:
        "../envs/gpu.yaml"
    threads: config["threads"]["train"]
    resources:
        **sized("fisher"),
    params:
        kind=lambda w: w.kind,
        options=lambda w: (
            {
                "ekfac": xcfg(w, "fisher", "ekfac"),
                "positions": xcfg(w, "fisher", "kfac_positions"),
            }
            if w.kind == "kfac"
            else {}
        ),
    script:
        "../workflow_scripts/fisher.py"


rule chain_opsd:
    input:
        model=lambda w: previous(w, "opsd")[0],
        data=stage_file("sft.parquet"),
        facts=knowledge_facts,
    output:
        report(
            directory("results/{exp}/chain/opsd/post/alpha~{alpha}/lr~{lr}/stage~{k}"),
            patterns=["{curves,training}.png"],
            caption="../report/training.rst",
            category="{exp}",
            subcategory="Training curves",
            labels={"method": "opsd", "run": "alpha~{alpha} lr~{lr}", "stage": "{k}"},
        ),
    log:
        "logs/{exp}/chain/opsd/post/alpha~{alpha}/lr~{lr}/stage~{k}.log",
    benchmark:
        "benchmarks/jobs/{exp}/chain/opsd/post/alpha~{alpha}/lr~{lr}/stage~{k}.tsv"
    wildcard_constraints:
        exp=CONTINUAL_PATTERN,
    conda:
        "../envs/gpu.yaml"
    threads: config["threads"]["on_policy"]
    resources:
        **sized("opsd"),
    params:
        **on_policy_params("opsd", ("alpha", "lr")),
        alpha=lambda w: float(w.alpha),
    script:
        "../workflow_scripts/opsd.py"


rule chain_grpo:
    input:
        model=lambda w: previous(w, "grpo")[0],
        data=stage_file("sft.parquet"),
    output:
        report(
            directory("results/{exp}/chain/grpo/post/lr~{lr}/stage~{k}"),
            patterns=["{curves,training}.png"],
            caption="../report/training.rst",
            category="{exp}",
            subcategory="Training curves",
            labels={"method": "grpo", "run": "lr~{lr}", "stage": "{k}"},
        ),
    log:
        "logs/{exp}/chain/grpo/post/lr~{lr}/stage~{k}.log",
    benchmark:
        "benchmarks/jobs/{exp}/chain/grpo/post/lr~{lr}/stage~{k}.tsv"
    wildcard_constraints:
        exp=CONTINUAL_PATTERN,
    conda:
        "../envs/gpu.yaml"
    threads: config["threads"]["on_policy"]
    resources:
        **sized("grpo"),
    params:
        **on_policy_params("grpo", ("lr", "checkpoints")),
    script:
        "../workflow_scripts/grpo.py"


# A frozen teacher stays the post model through every stage; an EMA teacher carries on from the one the
# previous stage left; a refresh schedule (S-SDPO0 at refresh:1) starts each stage from the student.
rule chain_sdpo:
    input:
        model=lambda w: previous(w, w.sdpo)[0],
        data=stage_file("sft.parquet"),
        # A frozen teacher is the post model; an EMA one lies in the previous stage, the `model` input.
        teacher=lambda w: (
            post_dir(w)
            if chains(w).teacher_start(wchain(w, w.sdpo), stage_of(w)) == post_dir(w)
            else []
        ),
    output:
        report(
            directory(
                "results/{exp}/chain/{sdpo}/post/teacher~{teacher}/lr~{lr}/stage~{k}"
            ),
            patterns=["{curves,training}.png"],
            caption="../report/training.rst",
            category="{exp}",
            subcategory="Training curves",
            labels={
                "method": "{sdpo}",
                "run": "teacher~{teacher} lr~{lr}",
                "stage": "{k}",
            },
        ),
    log:
        "logs/{exp}/chain/{sdpo}/post/teacher~{teacher}/lr~{lr}/stage~{k}.log",
    benchmark:
        "benchmarks/jobs/{exp}/chain/{sdpo}/post/teacher~{teacher}/lr~{lr}/stage~{k}.tsv"
    wildcard_constraints:
        exp=CONTINUAL_PATTERN,
    conda:
        "../envs/gpu.yaml"
    threads: config["threads"]["on_policy"]
    resources:
        **sized("sdpo"),
    params:
        **on_policy_params("sdpo", ("lr", "checkpoints", "teachers", "cot_teachers")),
        cot=lambda w: w.sdpo == "sdpo_cot",
        teacher=lambda w: w.teacher,
        teacher_dir=lambda w: chains(w).teacher_start(wchain(w, w.sdpo), stage_of(w)),
        keep_teacher=lambda w: chains(w).keeps_teacher(wchain(w, w.sdpo)),
    script:
        "../workflow_scripts/sdpo.py"


# What every chain became: accuracy, gain and forgetting per stage and benchmark, collapse, and drift.
rule continual:
    input:
        metrics=lambda w: chains(w).eval_metrics(),
    output:
        table="results/{exp}/continual.parquet",
        summary="results/{exp}/summary.parquet",
        accuracy=report(
            "results/{exp}/continual_accuracy.png",
            caption="../report/continual_accuracy.rst",
            category="{exp}",
            subcategory="Figures",
            labels={"figure": "accuracy by stage"},
        ),
        heatmap=report(
            "results/{exp}/continual_heatmap.png",
            caption="../report/continual_heatmap.rst",
            category="{exp}",
            subcategory="Figures",
            labels={"figure": "stage x benchmark"},
        ),
    log:
        "logs/{exp}/continual.log",
    benchmark:
        "benchmarks/jobs/{exp}/continual.tsv"
    wildcard_constraints:
        exp=CONTINUAL_PATTERN,
    conda:
        "../envs/cpu.yaml"
    params:
        # Training logs (steps.jsonl) lie in the stage directories, inputs of the evaluations above.
        chains=lambda w: chains(w).results_spec(),
        base=lambda w: f"{chains(w).root}/eval/post/metrics.json",
        domains=lambda w: [s["domain"] for s in chains(w).stages],
    script:
        "../workflow_scripts/continual.py"


rule param_drift:
    input:
        lambda w: [
            f"results/{w.exp}/param_drift/{c.key}/stage~{k}.parquet"
            for c in chains(w).chains()
            for k in chains(w).stage_numbers()
        ],
    output:
        table="results/{exp}/param_drift.parquet",
        png=report(
            "results/{exp}/param_drift.png",
            caption="../report/param_drift.rst",
            category="{exp}",
            subcategory="Figures",
            labels={"figure": "parameter drift"},
        ),
    log:
        "logs/{exp}/param_drift.log",
    benchmark:
        "benchmarks/jobs/{exp}/param_drift.tsv"
    wildcard_constraints:
        exp=CONTINUAL_PATTERN,
    conda:
        "../envs/cpu.yaml"
    resources:
        **sized("param_drift"),
    script:
        "../workflow_scripts/param_drift.py"


# One chain's model after one stage, against its stage's start and the post model, a job each: at 4B a
# model's float64 SVDs take hours on a CPU, and the 104 pairs of configs/qwen3-4b-continual.yaml would take a
# month in one job (two: about 15 hours).
rule stage_drift:
    input:
        lambda w: sorted(
            {
                i
                for pair in chains(w).stage_drift_pairs(w.chain, stage_of(w))
                for i in pair["inputs"]
            }
        ),
    output:
        "results/{exp}/param_drift/{chain}/stage~{k}.parquet",
    log:
        "logs/{exp}/param_drift/{chain}/stage~{k}.log",
    benchmark:
        "benchmarks/jobs/{exp}/param_drift/{chain}/stage~{k}.tsv"
    wildcard_constraints:
        exp=CONTINUAL_PATTERN,
        k=r"\d+",
    conda:
        "../envs/cpu.yaml"
    threads: config["threads"]["sample"]
    resources:
        **sized("stage_drift"),
    params:
        pairs=lambda w: chains(w).stage_drift_pairs(w.chain, stage_of(w)),
        k=lambda w: xcfg(w, "continual", "drift_k"),
        share=lambda w: xcfg(w, "continual", "drift_share"),
    script:
        "../workflow_scripts/stage_drift.py"


# Output drift: each model's responses against the post model's (embedded by the post model), and KL from
# the post model on each stage's prompts against old-task forgetting.
rule response_kl:
    input:
        metrics=lambda w: chains(w).eval_metrics(),
    output:
        responses="results/{exp}/response_drift.parquet",
        quantiles="results/{exp}/response_quantiles.parquet",
        responses_png=report(
            "results/{exp}/response_drift.png",
            caption="../report/response_drift.rst",
            category="{exp}",
            subcategory="Figures",
            labels={"figure": "response drift"},
        ),
        kl="results/{exp}/kl_forgetting.parquet",
        kl_png=report(
            "results/{exp}/kl_forgetting.png",
            caption="../report/kl_forgetting.rst",
            category="{exp}",
            subcategory="Figures",
            labels={"figure": "KL against forgetting"},
        ),
    log:
        "logs/{exp}/response_kl.log",
    benchmark:
        "benchmarks/jobs/{exp}/response_kl.tsv"
    wildcard_constraints:
        exp=CONTINUAL_PATTERN,
    conda:
        "../envs/gpu.yaml"
    threads: config["threads"]["sample"]
    resources:
        # It samples every model (KL) and embeds their answers: graftlab.planning.work.response_kl_work.
        **sized("response_kl"),
    params:
        post=post_dir,
        post_eval=lambda w: f"{chains(w).root}/eval/post",
        benchmarks=lambda w: chains(w).probe_benchmarks(),
        chains=lambda w: chains(w).results_spec(),
        checkpoints=lambda w: chains(w).checkpoint_spec(),
        cfg=lambda w: {
            "response_prompts": xcfg(w, "continual", "response_prompts"),
            "kl_prompts": xcfg(w, "continual", "kl_prompts"),
            "samples": xcfg(w, "continual", "kl_samples"),
            "max_new_tokens": xcfg(w, "eval", "max_new_tokens"),
            "seed": xcfg(w, "seed"),
        },
    script:
        "../workflow_scripts/response_kl.py"
