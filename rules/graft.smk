# Grafting: post + lam * M(donor_tuned - donor), M the identity (mask~none/rho~0) or a retention-Fisher
# mask zeroing the top-rho fraction of the update. With donor = post this is model merging.
# A graft sweep (one donor, SFT run, epoch, mask and rho; every lam: graftlab.planning.layout.Experiment.sweeps)
# is one job: its grafts share every input, so the job pays its start-up and its sampling engine's once (with
# vLLM each next graft's weights are read into the running engine: graftlab.sampling.kept_engine). A grafted
# model exists only inside its job: grafted into the job's scratch directory, evaluated, its update's
# sensitivity share measured, then deleted before the next lam's. Each job holds one `temp_grafts` resource, so
# `--resources temp_grafts=N` (a profile's, else 2: rules/common.smk) bounds the grafts on disk at once;
# a temp() output evaluated by a later job could not be bounded (docs/cluster.md#disk). The outputs are
# the evaluation's and the sensitivity job's own paths: every reader finds them where it finds an SFT model's.
# Each graft's finished samples are kept under its inputs and settings (a killed job resumes: the model is
# made anew), and with `eval.parts` a sweep is sampled first by parts, as an evaluation is (rules/evaluate.smk),
# each grafting its own copies. A rule's outputs are fixed but for its wildcards, so each list of lam values
# has its rule (graftlab.planning.layout.sweep_rule), its `exp` tied to the sweeps over that list; one more lam
# makes the sweep another rule's job, which scores every lam of it again.


for lams, sweeps in SWEEP_GROUPS.items():

    rule:
        name:
            sweep_rule("graft", lams)
        input:
            **sweep_inputs(),
            sensitivity_fisher=lambda w: layout(w).fisher_dir("diag"),
            parts=part_files("graft", lambda w: f"results/{w.exp}/{sweep_dir(w)}"),
            # An adaptive sweep's decisions (`eval.adaptive`): a graft screened out is scored no further. Every
            # graft of the sweep reads them all, so one more graft re-decides, and re-scores, the whole sweep.
            # (Read as ancient(), Snakemake 9.27 left a new graft's job out of the DAG altogether.)
            screened=lambda w: screened_file(w) or [],
        output:
            metrics=sweep_outputs(
                f"results/{{exp}}/eval/{GRAFT_KEY}/metrics.json", lams
            ),
            share=sweep_outputs(
                f"results/{{exp}}/sensitivity/{GRAFT_KEY}/share.parquet", lams
            ),
            # The latency analysis charges each graft its time; graftlab.planning.disk reads when its model existed.
            seconds=sweep_outputs(f"results/{{exp}}/{GRAFT_KEY}/seconds.json", lams),
        log:
            f"logs/{{exp}}/{SWEEP_KEY}.log",
        benchmark:
            f"benchmarks/jobs/{{exp}}/{SWEEP_KEY}.tsv"
        wildcard_constraints:
            **SWEEP_CONSTRAINTS,
            exp=sweeps_pattern(sweeps),
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
    rule:
        name:
            sweep_rule("graft_screen", lams)
        input:
            **sweep_inputs(),
        output:
            metrics=sweep_outputs(
                f"results/{{exp}}/screen/{GRAFT_KEY}/metrics.json", lams
            ),
        log:
            f"logs/{{exp}}/screen/{SWEEP_KEY}.log",
        benchmark:
            f"benchmarks/jobs/{{exp}}/screen/{SWEEP_KEY}.tsv"
        wildcard_constraints:
            **SWEEP_CONSTRAINTS,
            exp=sweeps_pattern(sweeps),
        conda:
            "../envs/gpu.yaml"
        threads: config["threads"]["sample"]
        resources:
            **sized("graft_screen"),
            temp_grafts=1,
        params:
            **graft_params(),
            screening=lambda w: xcfg(w, "eval", "adaptive"),
        script:
            "../workflow_scripts/graft.py"


# Every graft's and merge's screening, and with `eval.adaptive_checkpoints` every screened checkpoint's
# (rules/evaluate.smk): one decision over all of them.
rule screen:
    input:
        lambda w: [
            f"results/{w.exp}/screen/{run}/metrics.json"
            for run in layout(w).screenings()
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
        **sweep_inputs(),
        screened=lambda w: screened_file(w) or [],
    output:
        temp(f"results/{{exp}}/{SWEEP_KEY}/part~{{part}}of{{parts}}"),
    log:
        f"logs/{{exp}}/{SWEEP_KEY}/part~{{part}}of{{parts}}.log",
    benchmark:
        f"benchmarks/jobs/{{exp}}/{SWEEP_KEY}/part~{{part}}of{{parts}}.tsv"
    wildcard_constraints:
        **SWEEP_CONSTRAINTS,
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
        # The sweep job's stores (graftlab.train.resume.resume_dir of each metrics.json), which the parts fill.
        metrics=lambda w: [
            f"results/{w.exp}/eval/{run}/metrics.json" for run in graft_runs(w)
        ],
    script:
        "../workflow_scripts/graft_part.py"
