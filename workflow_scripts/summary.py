"""One row per evaluated model of the experiment, with all its keys and metrics."""

from graftlab.analysis.summary import write_summary
from graftlab.joblog import job_log

with job_log(snakemake.log[0]):
    write_summary(snakemake.input, snakemake.wildcards.exp, snakemake.output[0])
