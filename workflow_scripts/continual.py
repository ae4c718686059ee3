"""A continual experiment's tables and figures: accuracy, gain and forgetting per method, stage and benchmark;
average accuracy and forgetting with collapse per method and stage."""

from graftlab.io.warm import hand_off

hand_off()  # in the run's warm process, if there is one (graftlab.io.warm)

from graftlab.analysis.continual_results import write_continual_results
from graftlab.io.joblog import job_log

p, out = snakemake.params, snakemake.output
with job_log(snakemake.log[0]):
    write_continual_results(p.chains, p.base, p.domains, dict(out.items()))
