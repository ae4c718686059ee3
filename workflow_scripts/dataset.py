"""One configured data set (new-task problems, retention prompts or a benchmark) as problems."""

from graftlab.joblog import job_log
from graftlab.problem_sources import ProblemSource, write_problems

with job_log(snakemake.log[0]):
    source = ProblemSource.from_config(snakemake.wildcards.source, snakemake.params.source)
    write_problems(source, snakemake.output.problems, snakemake.output.stats)
