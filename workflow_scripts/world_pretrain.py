"""Pretrain the tiny model from scratch; every output is one checkpoint of the donor ladder."""

from pathlib import Path

from graftlab.joblog import job_log
from graftlab.world.build import pretrain

p = snakemake.params
with job_log(snakemake.log[0], snakemake.threads):
    pretrain(
        snakemake.input.tokenizer,
        snakemake.input.corpus,
        p.arch,
        p.pretrain,
        [Path(o) for o in snakemake.output],
        p.seed,
        snakemake.threads,
    )
