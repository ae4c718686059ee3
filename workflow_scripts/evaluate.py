"""Evaluate one model on the old benchmarks and the held-out new-task problems."""

from pathlib import Path

from graftlab.evaluate.run import Benchmark, evaluate
from graftlab.io.joblog import job_log
from graftlab.sampling import Engine, SamplingConfig

p = snakemake.params
benchmarks = [Benchmark(name, Path(path), role, task) for name, path, role, task in p.benchmarks]
with job_log(snakemake.log[0], snakemake.threads):
    evaluate(
        p.model,
        benchmarks,
        SamplingConfig.from_config(p.sampling, p.seed),
        Path(snakemake.output.metrics).parent,
        snakemake.wildcards.run,
        Engine.of(p.backend, seed=p.seed),
        validation=p.validation,
    )
