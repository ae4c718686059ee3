# Grafting: post + lam * (donor_tuned - donor). With donor = post this is model merging.
# Grafted models are temporary: evaluated, then deleted.


rule graft:
    input:
        post=model_dir("post"),
        donor=lambda w: model_dir(w.donor),
        tuned="results/{exp}/sft/{donor}/lr~{lr}",
    output:
        temp(
            directory(
                "results/{exp}/graft/{donor}/lr~{lr}/epoch~{e}/lam~{lam}/mask~none/rho~0/model"
            )
        ),
    log:
        "logs/{exp}/graft/{donor}/lr~{lr}/epoch~{e}/lam~{lam}/mask~none/rho~0.log",
    conda:
        "../envs/cpu.yaml"
    threads: config["threads"]["sample"]
    params:
        epoch=lambda w: w.e,
        lam=lambda w: w.lam,
    script:
        "../workflow_scripts/graft.py"
