"""Graft one donor update onto the post model (merging when the donor is the post model)."""

from graftlab.graft import graft
from graftlab.joblog import job_log

p = snakemake.params
with job_log(snakemake.log[0], snakemake.threads):
    graft(
        post=snakemake.input.post,
        donor=snakemake.input.donor,
        donor_tuned=f"{snakemake.input.tuned}/epoch~{p.epoch}",
        scale=float(p.lam),
        out=snakemake.output[0],
    )
