"""Old-task benchmarks and the pool of new-task candidates for mining."""

from pathlib import Path

from graftlab.joblog import job_log
from graftlab.world.build import make_benchmarks, make_candidates

p = snakemake.params
with job_log(snakemake.log[0]):
    make_benchmarks(p.old_tasks, p.benchmark_size, p.seed, Path(snakemake.output.benchmarks[0]).parent)
    make_candidates(p.new_task, p.candidates, p.seed, Path(snakemake.output.candidates))
