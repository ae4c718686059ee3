# Grafting: post + lam * M(donor_tuned - donor), M the identity (mask~none/rho~0) or a retention-Fisher
# mask zeroing the top-rho fraction of the update. With donor = post this is model merging.
# Grafted models are temporary: evaluated, then deleted.


rule graft:
    input:
        post=post_dir,
        donor=lambda w: layout(w).model_input(w.donor),
        tuned="results/{exp}/sft/{donor}/lr~{lr}",
        fisher=lambda w: layout(w).graft_fisher(w.mask, w.rho),
    output:
        model=temp(
            directory(
                "results/{exp}/graft/{donor}/lr~{lr}/epoch~{epoch}/lam~{lam}/mask~{mask}/rho~{rho}/model"
            )
        ),
        # Kept after the model is evaluated and deleted: the latency analysis charges each graft its time.
        seconds="results/{exp}/graft/{donor}/lr~{lr}/epoch~{epoch}/lam~{lam}/mask~{mask}/rho~{rho}/seconds.json",
    log:
        "logs/{exp}/graft/{donor}/lr~{lr}/epoch~{epoch}/lam~{lam}/mask~{mask}/rho~{rho}.log",
    benchmark:
        "benchmarks/jobs/{exp}/graft/{donor}/lr~{lr}/epoch~{epoch}/lam~{lam}/mask~{mask}/rho~{rho}.tsv"
    conda:
        "../envs/cpu.yaml"
    threads: config["threads"]["sample"]
    resources:
        **sized("graft"),
    params:
        donor=lambda w: layout(w).model_dir(w.donor),
        epoch=lambda w: w.epoch,
        lam=lambda w: w.lam,
        mask=lambda w: w.mask,
        rho=lambda w: w.rho,
        mask_settings=lambda w: layout(w).mask_settings(w.donor, w.mask),
    script:
        "../workflow_scripts/graft.py"
