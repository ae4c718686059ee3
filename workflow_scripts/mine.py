"""Mine the new-task problems the post model rarely or never solves."""

from graftlab.io.warm import hand_off

hand_off()  # in the run's warm process, if there is one (graftlab.io.warm)

from graftlab.io.joblog import job_log
from graftlab.sample_chunks import chunks_kept
from graftlab.sampling import Engine
from graftlab.synth.mining import MiningConfig, mine
from graftlab.train.resume import resume_dir
from graftlab.train.shard import job_gpus_processes

p = snakemake.params
with job_log(snakemake.log[0], snakemake.threads):
    # Finished chunks of samples kept until the job is done: a killed job's rerun samples only the rest;
    # a job one engine would take beyond its limit runs several at once, one a GPU group.
    processes = job_gpus_processes(snakemake.resources)
    with chunks_kept(Engine.of(p.backend, seed=p.seed), resume_dir(snakemake.output.train), processes) as engine:
        mine(
            snakemake.input.model,
            snakemake.input.candidates,
            MiningConfig(**p.mining, seed=p.seed),
            snakemake.output.train,
            snakemake.output.heldout,
            engine,
            p.task,
            benchmark_files=snakemake.input.benchmarks,
        )
