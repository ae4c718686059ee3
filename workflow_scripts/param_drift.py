"""Parameter drift of every chain's model after every stage, against its stage's start and the post model:
the pairs' tables (rule model_drift) in one, and its figure."""

from graftlab.io.warm import hand_off

hand_off()  # in the run's warm process, if there is one (graftlab.io.warm)

from graftlab.analysis.param_drift import write_chain_drift
from graftlab.io.joblog import job_log

out = snakemake.output
with job_log(snakemake.log[0], snakemake.threads):
    write_chain_drift(list(snakemake.input), out.table, out.png)
