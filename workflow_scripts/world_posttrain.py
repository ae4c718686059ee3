"""Post-train the base model on the old tasks: the model continual learning starts from."""

from graftlab.io.warm import hand_off

hand_off()  # in the run's warm process, if there is one (graftlab.io.warm)

from pathlib import Path

from graftlab.io.joblog import job_log
from graftlab.world.build import posttrain

p = snakemake.params
with job_log(snakemake.log[0], snakemake.threads):
    posttrain(
        p.base,
        Path(snakemake.input.benchmarks[0]).parent,
        p.tasks,
        p.posttrain,
        Path(snakemake.output.post),
        Path(snakemake.output.ladder),
        p.seed,
        snakemake.threads,
        p.precision,
    )
