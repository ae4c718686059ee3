"""Pretraining corpus of bare arithmetic facts."""

from pathlib import Path

from graftlab.joblog import job_log
from graftlab.world.build import make_corpus

p = snakemake.params
with job_log(snakemake.log[0]):
    make_corpus(p.tasks, p.documents, p.lines_per_doc, p.seed, Path(snakemake.output[0]))
