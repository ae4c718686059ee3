"""Old-task benchmarks: held-out problem sets that post-training never sees."""

from graftlab.io.warm import hand_off

hand_off()  # in the run's warm process, if there is one (graftlab.io.warm)

from pathlib import Path

from graftlab.io.joblog import job_log
from graftlab.world.build import make_benchmarks

p = snakemake.params
with job_log(snakemake.log[0]):
    make_benchmarks(p.tasks, p.size, p.seed, Path(snakemake.output[0]).parent)
