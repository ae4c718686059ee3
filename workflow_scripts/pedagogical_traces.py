"""Pedagogical RL's data: the trained teacher's first verified trace per problem, stored without the
reference solution it was shown."""

from graftlab.io.warm import hand_off

hand_off()  # in the run's warm process, if there is one (graftlab.io.warm)

from graftlab.io.joblog import job_log
from graftlab.sampling import Engine
from graftlab.synth.pedagogical import write_teacher_traces
from graftlab.synth.star import StarConfig

p, inp, out = snakemake.params, snakemake.input, snakemake.output
with job_log(snakemake.log[0], snakemake.threads):
    cfg = StarConfig(**p.sampling, seed=p.seed)
    write_teacher_traces(inp.model, inp.problems, cfg, out.sft, out.stats, Engine.of(p.backend, seed=p.seed), p.task)
