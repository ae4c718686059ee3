"""One stage of a continual experiment: its SFT traces, held-out problems and (knowledge) facts."""

from graftlab.io.warm import hand_off

hand_off()  # in the run's warm process, if there is one (graftlab.io.warm)

from pathlib import Path

from graftlab.io.joblog import job_log
from graftlab.synth.stage_data import write_stage_data

p, inp = snakemake.params, snakemake.input
with job_log(snakemake.log[0]):
    write_stage_data(
        p.stage,
        Path(snakemake.output.sft).parent,
        p.seed,
        p.old_tasks,
        exclude_files=list(inp.benchmarks),
        problems_file=inp.problems or None,
        star=p.star,
    )
