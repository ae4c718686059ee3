"""One configured data set (new-task problems, retention prompts or a benchmark) as problems, read once for
every experiment that configures it (rules/data.smk)."""

from graftlab.io.fetch import hub_online

hub_online()  # a local rule: the one job that downloads data sets

from graftlab.io.warm import hand_off

hand_off()  # runs cold: the hub's switch is read at import, and the warm process imported it off

from graftlab.io.joblog import job_log
from graftlab.tasks.sources import ProblemSource, write_problems

with job_log(snakemake.log[0]):
    source = ProblemSource.from_config(snakemake.params.name, snakemake.params.source)
    write_problems(source, snakemake.output.problems, snakemake.output.stats)
