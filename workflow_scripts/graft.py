"""Graft one donor update onto the post model (merging when the donor is the post model), masked by the
post model's retention Fisher unless the mask is `none`."""

from graftlab.fisher import make_mask
from graftlab.graft import graft
from graftlab.joblog import job_log

p, inp = snakemake.params, snakemake.input
tuned = f"{inp.tuned}/epoch~{p.epoch}"
with job_log(snakemake.log[0], snakemake.threads):
    mask = None
    if p.mask != "none":
        mask = make_mask(p.mask, inp.fisher, inp.post, inp.donor, tuned, float(p.rho), **p.mask_settings)
    graft(inp.post, inp.donor, tuned, float(p.lam), snakemake.output[0], project=mask)
