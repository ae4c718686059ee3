"""A training run's checkpoints screened (rules/evaluate.smk, `eval.adaptive_checkpoints`): each kept checkpoint
in turn scored on the share `eval.adaptive` of the problems alone, drawn from the validation split, as a graft
sweep's screening scores its grafts (graftlab.analysis.screen); one sampling engine for the run, each
checkpoint's samples kept."""

from graftlab.io.warm import hand_off

hand_off()  # in the run's warm process, if there is one (graftlab.io.warm)

from pathlib import Path

from graftlab.evaluate.run import Benchmark, evaluate
from graftlab.io.joblog import job_log
from graftlab.sample_chunks import chunks_kept
from graftlab.sampling import Engine, SamplingConfig, load_sampler
from graftlab.train.resume import resume_dir

p = snakemake.params
benchmarks = Benchmark.all_of(p.benchmarks)
with job_log(snakemake.log[0], snakemake.threads):
    sampler = None
    for run, model, metrics in zip(p.runs, p.models, snakemake.output.metrics, strict=True):
        # Its samples kept, as a graft's screening's (graft_screen.py): a killed job reads them back.
        with chunks_kept(Engine.of(p.backend, seed=p.seed), resume_dir(metrics), keep=True) as engine:
            sampler = load_sampler(model, engine, after=sampler)
            evaluate(
                model,
                benchmarks,
                SamplingConfig.from_config(p.sampling, p.seed),
                Path(metrics).parent,
                run,
                sampler=sampler,
                validation=p.validation,
                screening=p.adaptive,
            )
