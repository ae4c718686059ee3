"""One row per evaluated model of the experiment, with all its keys, metrics and what it learned from."""

from graftlab.io.warm import hand_off

hand_off()  # in the run's warm process, if there is one (graftlab.io.warm)

from graftlab.analysis.summary import data_columns, write_summary
from graftlab.io.joblog import job_log

inp = snakemake.input
with job_log(snakemake.log[0]):
    data = data_columns(snakemake.params.data, inp.data, inp.source or None)
    write_summary(inp.metrics, snakemake.wildcards.exp, snakemake.output[0], data, snakemake.params.root)
