"""Pretrain the tiny model from scratch: the donor ladder (one checkpoint `step~N` per ladder step) and
the initialisation it started from."""

from graftlab.io.warm import hand_off

hand_off()  # in the run's warm process, if there is one (graftlab.io.warm)

from pathlib import Path

from graftlab.io.joblog import job_log
from graftlab.world.build import pretrain

p, out = snakemake.params, snakemake.output
with job_log(snakemake.log[0], snakemake.threads):
    pretrain(
        snakemake.input.tokenizer,
        snakemake.input.corpus,
        p.arch,
        p.pretrain,
        Path(out.ladder),
        Path(out.init),
        p.seed,
        snakemake.threads,
        p.precision,
    )
