"""Retention Fisher of the post model on its rollouts (kind: diag or kfac)."""

from graftlab.fisher import write_fisher
from graftlab.io.joblog import job_log

p, inp = snakemake.params, snakemake.input
batch_size = snakemake.config["experiments"][snakemake.wildcards.exp]["fisher"]["batch_size"]
with job_log(snakemake.log[0], snakemake.threads):
    write_fisher(p.kind, inp.model, inp.rollouts, snakemake.output[0], batch_size, **p.options)
