"""Parameter drift of every chain's model after every stage, against its stage's start and the post model."""

from graftlab.io.warm import hand_off

hand_off()  # in the run's warm process, if there is one (graftlab.io.warm)

from graftlab.analysis.param_drift import write_chain_drift
from graftlab.io.joblog import job_log

p, out = snakemake.params, snakemake.output
with job_log(snakemake.log[0], snakemake.threads):
    write_chain_drift(p.pairs, out.table, out.png, p.k, p.share)
