"""Takeover of one tiny-world experiment: per evaluated model, the share of old-task answers written in the
new task's procedure."""

from graftlab.analysis.takeover import write_takeover
from graftlab.joblog import job_log

p = snakemake.params
with job_log(snakemake.log[0], 1):
    write_takeover(p.eval_dir, p.runs, p.old, p.new_task, snakemake.output[0])
