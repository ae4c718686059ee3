# Grafting: post + lam * M(donor_tuned - donor), M the identity (mask~none/rho~0) or a retention-Fisher
# mask zeroing the top-rho fraction of the update. With donor = post this is model merging.
# Grafted models are temporary: evaluated, then deleted.


rule graft:
    input:
        post=post_dir,
        donor=lambda w: model_input(w.donor, w.exp),
        tuned="results/{exp}/sft/{donor}/lr~{lr}",
        fisher=graft_fisher,
    output:
        model=temp(
            directory(
                "results/{exp}/graft/{donor}/lr~{lr}/epoch~{e}/lam~{lam}/mask~{mask}/rho~{rho}/model"
            )
        ),
        # Kept after the model is evaluated and deleted: the latency analysis charges each graft its time.
        seconds="results/{exp}/graft/{donor}/lr~{lr}/epoch~{e}/lam~{lam}/mask~{mask}/rho~{rho}/seconds.json",
    log:
        "logs/{exp}/graft/{donor}/lr~{lr}/epoch~{e}/lam~{lam}/mask~{mask}/rho~{rho}.log",
    conda:
        "../envs/cpu.yaml"
    threads: config["threads"]["sample"]
    params:
        donor=lambda w: model_dir(w.donor, w.exp),
        epoch=lambda w: w.e,
        lam=lambda w: w.lam,
        mask=lambda w: w.mask,
        rho=lambda w: w.rho,
        mask_settings=mask_settings,
    script:
        "../workflow_scripts/graft.py"
