"""Drift of one tiny-world experiment: the world's drift ratio and each donor update's cosine with the
post model's own SFT update."""

from graftlab.io.warm import hand_off

hand_off()  # in the run's warm process, if there is one (graftlab.io.warm)

from graftlab.analysis.drift import write_drift
from graftlab.io.joblog import job_log

p, inp = snakemake.params, snakemake.input
with job_log(snakemake.log[0], 1):
    write_drift(inp.init, p.base, inp.post, p.updates, snakemake.output[0])
