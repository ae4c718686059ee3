"""The study over every experiment: verdicts on both splits and drift per experiment, seeds that
reproduce per group."""

from graftlab.analysis.study import write_study
from graftlab.joblog import job_log

out = snakemake.output
with job_log(snakemake.log[0]):
    write_study(snakemake.params.experiments, out.runs, out.groups, out.png)
