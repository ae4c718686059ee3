# Real models named in config `models`: fetched once (a local directory copied, a hub id downloaded at
# its pinned revision) into resources/models/{name}/, then used like the tiny world's checkpoints.


# Downloads run where Snakemake runs (a login node with internet); compute jobs run with the hub offline.
localrules:
    fetch_model,


rule fetch_model:
    input:
        # A local source is an input, so a rebuilt or edited local model is fetched again.
        lambda w: local_source(MODELS[w.name]["source"]),
        # The model whose long-context rope scaling this one takes (graftlab.io.fetch.copy_rope).
        rope=lambda w: rope_dir(w.name),
    output:
        directory("resources/models/{name}"),
    log:
        "logs/models/{name}.log",
    benchmark:
        "benchmarks/jobs/models/{name}.tsv"
    wildcard_constraints:
        name="|".join(MODELS) or "(?!)",
    conda:
        "../envs/cpu.yaml"
    resources:
        **sized("fetch_model"),
    params:
        source=lambda w: MODELS[w.name]["source"],
        revision=lambda w: MODELS[w.name]["revision"],
        rope_from=lambda w: rope_dir(w.name) or None,
    script:
        "../workflow_scripts/fetch_model.py"
