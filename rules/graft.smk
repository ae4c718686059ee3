# Grafting: post + lam * M(donor_tuned - donor), M the identity (mask~none/rho~0) or a retention-Fisher
# mask zeroing the top-rho fraction of the update. With donor = post this is model merging.
# A grafted model exists only inside its job: grafted into the job's scratch directory, evaluated, its
# update's sensitivity share measured, then deleted. Each job holds one `temp_grafts` resource, so
# `--resources temp_grafts=N` (a profile's, else 2: rules/common.smk) bounds the grafts on disk at once;
# a temp() output evaluated by a later job could not be bounded (docs/cluster.md#disk). The outputs are
# the evaluation's and the sensitivity job's own paths: every reader finds them where it finds an SFT model's.
# Its finished samples are kept under the graft's inputs and settings (it resumes: the model is made anew),
# and with `eval.parts` a graft is sampled first by parts, as an evaluation is (rules/evaluate.smk), each
# grafting its own copy.


ruleorder: graft > evaluate
ruleorder: graft > sensitivity_update


rule graft:
    input:
        post=post_dir,
        donor=lambda w: layout(w).model_input(w.donor),
        tuned="results/{exp}/sft/{donor}/lr~{lr}",
        fisher=lambda w: layout(w).graft_fisher(w.mask, w.rho),
        benchmarks=lambda w: [b[1] for b in layout(w).eval_benchmarks()],
        sensitivity_fisher=lambda w: layout(w).fisher_dir("diag"),
        parts=part_files("graft", lambda w: f"results/{w.exp}/{graft_run(w)}"),
        # An adaptive sweep's decisions (`eval.adaptive`): a graft screened out is scored no further. Every
        # graft of the sweep reads them all, so one more graft re-decides, and re-scores, the whole sweep.
        # (Read as ancient(), Snakemake 9.27 left a new graft's job out of the DAG altogether.)
        screened=lambda w: screened_file(w) or [],
    output:
        metrics="results/{exp}/eval/graft/{donor}/lr~{lr}/epoch~{epoch}/lam~{lam}/mask~{mask}/rho~{rho}/metrics.json",
        share="results/{exp}/sensitivity/graft/{donor}/lr~{lr}/epoch~{epoch}/lam~{lam}/mask~{mask}/rho~{rho}/share.parquet",
        # The latency analysis charges each graft its time; graftlab.planning.disk reads when its model existed.
        seconds="results/{exp}/graft/{donor}/lr~{lr}/epoch~{epoch}/lam~{lam}/mask~{mask}/rho~{rho}/seconds.json",
    log:
        "logs/{exp}/graft/{donor}/lr~{lr}/epoch~{epoch}/lam~{lam}/mask~{mask}/rho~{rho}.log",
    benchmark:
        "benchmarks/jobs/{exp}/graft/{donor}/lr~{lr}/epoch~{epoch}/lam~{lam}/mask~{mask}/rho~{rho}.tsv"
    conda:
        "../envs/gpu.yaml"
    threads: config["threads"]["sample"]
    resources:
        **sized("graft"),
        temp_grafts=1,
    params:
        **graft_params(),
        top=SENSITIVITY_TOP,
    script:
        "../workflow_scripts/graft.py"


# Adaptive sweeps (`eval.adaptive`): every graft scored first on a share of the validation problems, into
# results/{exp}/screen/; `screen` decides which can still reach the frontier (graftlab.analysis.screen).
rule graft_screen:
    input:
        post=post_dir,
        donor=lambda w: layout(w).model_input(w.donor),
        tuned="results/{exp}/sft/{donor}/lr~{lr}",
        fisher=lambda w: layout(w).graft_fisher(w.mask, w.rho),
        benchmarks=lambda w: [b[1] for b in layout(w).eval_benchmarks()],
    output:
        metrics="results/{exp}/screen/graft/{donor}/lr~{lr}/epoch~{epoch}/lam~{lam}/mask~{mask}/rho~{rho}/metrics.json",
    log:
        "logs/{exp}/screen/graft/{donor}/lr~{lr}/epoch~{epoch}/lam~{lam}/mask~{mask}/rho~{rho}.log",
    benchmark:
        "benchmarks/jobs/{exp}/screen/graft/{donor}/lr~{lr}/epoch~{epoch}/lam~{lam}/mask~{mask}/rho~{rho}.tsv"
    conda:
        "../envs/gpu.yaml"
    threads: config["threads"]["sample"]
    resources:
        **sized("graft_screen"),
        temp_grafts=1,
    params:
        **graft_params(),
        adaptive=lambda w: xcfg(w, "eval", "adaptive"),
    script:
        "../workflow_scripts/graft_screen.py"


rule screen:
    input:
        lambda w: [
            f"results/{w.exp}/screen/{r.key}/metrics.json"
            for r in layout(w).run_list()
            if r.kind == "graft"
        ],
    output:
        decisions="results/{exp}/screen/decisions.json",
        table="results/{exp}/screened.parquet",
    log:
        "logs/{exp}/screen.log",
    benchmark:
        "benchmarks/jobs/{exp}/screen.tsv"
    conda:
        "../envs/cpu.yaml"
    script:
        "../workflow_scripts/screen.py"


rule graft_part:
    input:
        post=post_dir,
        donor=lambda w: layout(w).model_input(w.donor),
        tuned="results/{exp}/sft/{donor}/lr~{lr}",
        fisher=lambda w: layout(w).graft_fisher(w.mask, w.rho),
        benchmarks=lambda w: [b[1] for b in layout(w).eval_benchmarks()],
        screened=lambda w: screened_file(w) or [],
    output:
        temp(
            "results/{exp}/graft/{donor}/lr~{lr}/epoch~{epoch}/lam~{lam}/mask~{mask}/rho~{rho}/part~{part}of{parts}"
        ),
    log:
        "logs/{exp}/graft/{donor}/lr~{lr}/epoch~{epoch}/lam~{lam}/mask~{mask}/rho~{rho}/part~{part}of{parts}.log",
    benchmark:
        "benchmarks/jobs/{exp}/graft/{donor}/lr~{lr}/epoch~{epoch}/lam~{lam}/mask~{mask}/rho~{rho}/part~{part}of{parts}.tsv"
    wildcard_constraints:
        part=r"\d+",
        parts=r"\d+",
    conda:
        "../envs/gpu.yaml"
    threads: config["threads"]["sample"]
    resources:
        **sized("graft_part"),
        temp_grafts=1,
    params:
        **graft_params(),
        # The graft job's store (graftlab.train.resume.resume_dir of its metrics.json), which the parts fill.
        metrics=lambda w: f"results/{w.exp}/eval/{graft_run(w)}/metrics.json",
    script:
        "../workflow_scripts/graft_part.py"
