"""Retention rollouts: the post model's own samples on fresh old-domain prompts, as token ids, and their
sampling seconds and share correct."""

from graftlab.io.warm import hand_off

hand_off()  # in the run's warm process, if there is one (graftlab.io.warm)

from graftlab.fisher.rollouts import RolloutConfig, write_rollouts
from graftlab.io.joblog import job_log
from graftlab.sampling import Engine

p, inp = snakemake.params, snakemake.input
with job_log(snakemake.log[0], snakemake.threads):
    write_rollouts(
        inp.model,
        list(inp.benchmarks),
        p.tasks,
        RolloutConfig(**p.rollouts, seed=p.seed),
        snakemake.output.rollouts,
        Engine.of(p.backend, seed=p.seed),
        prompts_file=inp.prompts or None,
        stats_out=snakemake.output.stats,
    )
