"""Pretraining corpus of bare arithmetic facts, with a share of chat-format solved problems if asked: of
the old tasks and pretraining-only families, and of the new task (exposure)."""

from graftlab.io.warm import hand_off

hand_off()  # in the run's warm process, if there is one (graftlab.io.warm)

from pathlib import Path

from graftlab.io.joblog import job_log
from graftlab.world.build import exposure_problems, make_corpus

p = snakemake.params
with job_log(snakemake.log[0]):
    exposure = (
        exposure_problems(p.new_task, p.new_task_problems, p.seed, Path(snakemake.input.candidates))
        if p.new_task_share > 0
        else []
    )
    make_corpus(
        p.tasks,
        p.documents,
        p.lines_per_doc,
        p.seed,
        Path(snakemake.output[0]),
        p.chat_share,
        p.chat_tasks,
        p.new_task_share,
        exposure,
        p.families,
    )
