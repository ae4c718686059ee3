"""Mine the new-task problems the post model rarely or never solves."""

from graftlab.io.warm import hand_off

hand_off()  # in the run's warm process, if there is one (graftlab.io.warm)

from graftlab.io.joblog import job_log
from graftlab.sampling import Engine
from graftlab.synth.mining import MiningConfig, mine

p = snakemake.params
with job_log(snakemake.log[0], snakemake.threads):
    mine(
        snakemake.input.model,
        snakemake.input.candidates,
        MiningConfig(**p.mining, seed=p.seed),
        snakemake.output.train,
        snakemake.output.heldout,
        Engine.of(p.backend, seed=p.seed),
        p.task,
        benchmark_files=snakemake.input.benchmarks,
    )
