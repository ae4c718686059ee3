"""Pretraining corpus of bare arithmetic facts, with a share of chat-format solved problems if asked."""

from pathlib import Path

from graftlab.joblog import job_log
from graftlab.world.build import make_corpus

p = snakemake.params
with job_log(snakemake.log[0]):
    make_corpus(p.tasks, p.documents, p.lines_per_doc, p.seed, Path(snakemake.output[0]), p.chat_share, p.chat_tasks)
