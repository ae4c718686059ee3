"""Graft one donor update onto the post model (merging when the donor is the post model), masked by the
post model's retention Fisher unless the mask is `none`; the seconds it took go to `seconds.json`."""

from graftlab.atomic import write_json
from graftlab.fisher import make_mask
from graftlab.graft import graft
from graftlab.joblog import job_log, timed

p, inp, out = snakemake.params, snakemake.input, snakemake.output
tuned = f"{inp.tuned}/epoch~{p.epoch}"
seconds = {}
with job_log(snakemake.log[0], snakemake.threads):
    # One figure for mask and graft: a mask may rank lazily, tensor by tensor, while the graft runs.
    with timed(seconds, "graft_s"):
        mask = None
        if p.mask != "none":
            mask = make_mask(p.mask, inp.fisher, inp.post, p.donor, tuned, float(p.rho), **p.mask_settings)
        graft(inp.post, p.donor, tuned, float(p.lam), out.model, project=mask)
    write_json(out.seconds, seconds)
