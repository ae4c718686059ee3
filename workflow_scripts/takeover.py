"""Takeover of one tiny-world experiment: per evaluated model, the share of old-task answers written in the
new task's procedure."""

from graftlab.io.warm import hand_off

hand_off()  # in the run's warm process, if there is one (graftlab.io.warm)

from graftlab.analysis.takeover import write_takeover
from graftlab.io.joblog import job_log
from graftlab.planning.layout import eval_root

p = snakemake.params
with job_log(snakemake.log[0], 1):
    # The records lie beside the declared metrics.json of each run, in the directory that holds them all.
    eval_dir = eval_root(snakemake.input.metrics[0], p.runs[0])
    write_takeover(eval_dir, p.runs, p.old, p.new_task, snakemake.output[0])
