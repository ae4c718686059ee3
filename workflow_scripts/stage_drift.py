"""Parameter drift of one chain's model after one stage, against the stage's start and the post model."""

from graftlab.io.warm import hand_off

hand_off()  # in the run's warm process, if there is one (graftlab.io.warm)

from graftlab.analysis.param_drift import write_pairs_drift
from graftlab.io.joblog import job_log

p = snakemake.params
with job_log(snakemake.log[0], snakemake.threads):
    write_pairs_drift(p.pairs, snakemake.output[0], p.k, p.share)
