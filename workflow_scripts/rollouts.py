"""Retention rollouts: the post model's own samples on fresh old-domain prompts, as token ids, and their
sampling seconds and share correct."""

from graftlab.io.warm import hand_off

hand_off()  # in the run's warm process, if there is one (graftlab.io.warm)

from graftlab.fisher.rollouts import RolloutConfig, write_rollouts
from graftlab.io.joblog import job_log
from graftlab.sample_chunks import chunks_kept
from graftlab.sampling import Engine
from graftlab.train.resume import resume_dir
from graftlab.train.shard import job_gpus_processes

p, inp = snakemake.params, snakemake.input
with job_log(snakemake.log[0], snakemake.threads):
    # Finished chunks of samples kept until the job is done: a killed job's rerun samples only the rest;
    # a job one engine would take beyond its limit runs several at once, one a GPU group.
    processes = job_gpus_processes(snakemake.resources)
    with chunks_kept(Engine.of(p.backend, seed=p.seed), resume_dir(snakemake.output.rollouts), processes) as engine:
        write_rollouts(
            inp.model,
            list(inp.benchmarks),
            p.tasks,
            RolloutConfig(**p.rollouts, seed=p.seed),
            snakemake.output.rollouts,
            engine,
            prompts_file=inp.prompts or None,
            stats_out=snakemake.output.stats,
        )
