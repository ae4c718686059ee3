"""Evaluate models on the old benchmarks and the held-out new-task problems: one model, or every kept
checkpoint of a training run, one after another in this process (each into its own metrics.json)."""

from graftlab.io.warm import hand_off

hand_off()  # in the run's warm process, if there is one (graftlab.io.warm)

from pathlib import Path

from graftlab.evaluate.run import Benchmark, evaluate
from graftlab.io.joblog import job_log
from graftlab.sampling import Engine, SamplingConfig

p = snakemake.params
benchmarks = [Benchmark(name, Path(path), role, task) for name, path, role, task in p.benchmarks]
with job_log(snakemake.log[0], snakemake.threads):
    for run, model, metrics in zip(p.runs, p.models, snakemake.output, strict=True):
        evaluate(
            model,
            benchmarks,
            SamplingConfig.from_config(p.sampling, p.seed),
            Path(metrics).parent,
            run,
            Engine.of(p.backend, seed=p.seed),
            validation=p.validation,
        )
