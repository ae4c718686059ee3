"""Training traces for the mined problems."""

from graftlab.joblog import job_log
from graftlab.synth.traces import write_traces

with job_log(snakemake.log[0]):
    write_traces(snakemake.params.data, snakemake.input[0], snakemake.output[0])
