"""One configured data set (new-task problems, retention prompts or a benchmark) as problems."""

from graftlab.io.fetch import hub_online

hub_online()  # a local rule: the one job that downloads data sets

from graftlab.io.joblog import job_log  # noqa: E402
from graftlab.tasks.sources import ProblemSource, write_problems  # noqa: E402

with job_log(snakemake.log[0]):
    source = ProblemSource.from_config(snakemake.wildcards.source, snakemake.params.source)
    write_problems(source, snakemake.output.problems, snakemake.output.stats)
