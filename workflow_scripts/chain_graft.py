"""A continual chain's graft at one stage: the stage's donor update onto the chain's previous model, masked
by that model's retention Fisher unless the mask is `none`. The model is kept (the next stage starts from
it); the seconds it took go to `seconds.json`."""

from graftlab.io.warm import hand_off

hand_off()  # in the run's warm process, if there is one (graftlab.io.warm)

from graftlab.graft import masked_graft
from graftlab.io.atomic import write_json
from graftlab.io.joblog import job_log, timed

p, inp, out = snakemake.params, snakemake.input, snakemake.output
seconds = {}
with job_log(snakemake.log[0], snakemake.threads):
    with timed(seconds, "graft_s"):
        tuned = f"{inp.tuned}/epoch~{p.epoch}"
        masked_graft(inp.post, p.donor, tuned, float(p.lam), out.model, p.mask, inp.fisher, p.rho, **p.mask_settings)
    write_json(out.seconds, seconds)
