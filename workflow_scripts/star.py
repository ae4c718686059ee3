"""Verified traces sampled from a model, the first of up to K per problem: STaR (the post model's own)
or teacher traces (a teacher model's)."""

from graftlab.io.warm import hand_off

hand_off()  # in the run's warm process, if there is one (graftlab.io.warm)

from graftlab.io.joblog import job_log
from graftlab.sampling import Engine
from graftlab.synth.star import StarConfig, write_star

p, inp, out = snakemake.params, snakemake.input, snakemake.output
with job_log(snakemake.log[0], snakemake.threads):
    cfg = StarConfig(**p.sampling, seed=p.seed)
    write_star(p.model, inp.problems, cfg, out.sft, out.stats, Engine.of(p.backend, seed=p.seed), p.task)
