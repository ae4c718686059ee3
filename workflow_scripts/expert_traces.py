"""Expert traces of the mined problems: the tiny world's solver, or a data set's written solutions."""

from graftlab.io.warm import hand_off

hand_off()  # in the run's warm process, if there is one (graftlab.io.warm)

from graftlab.io.joblog import job_log
from graftlab.synth.traces import write_traces

with job_log(snakemake.log[0]):
    write_traces(snakemake.input[0], snakemake.output.sft, snakemake.output.stats)
