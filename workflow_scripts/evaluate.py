"""Evaluate models on the old benchmarks and the held-out new-task problems: one model, every kept checkpoint
of a training run one after another in this process (each into its own metrics.json; under adaptive sweeps, a
screened-out one's its screening's, and in the job screening them, each on its share of the validation problems
alone), or one model that several experiments evaluate alike, once (its records and metrics.json then written
for each)."""

from graftlab.io.warm import hand_off

hand_off()  # in the run's warm process, if there is one (graftlab.io.warm)

from pathlib import Path

from graftlab.analysis.screen import screened_out, write_screened
from graftlab.evaluate.run import Benchmark, copy_evaluation, evaluate
from graftlab.io.joblog import job_log
from graftlab.sample_chunks import chunks_kept
from graftlab.sampling import Engine, SamplingConfig, load_sampler
from graftlab.train.resume import resume_dir
from graftlab.train.shard import job_gpus_processes

p = snakemake.params
benchmarks = Benchmark.all_of(p.benchmarks)
# A training run's checkpoints under `eval.adaptive_checkpoints`: the experiment's decisions, or, in the job
# screening them, the share of the validation problems they are scored on first (rules/evaluate.smk).
screened, screening = snakemake.input.get("screened"), p.get("screening", 0.0)
with job_log(snakemake.log[0], snakemake.threads):
    # Engines sampling at once, one a GPU group: a job one engine would take beyond its limit has several.
    processes, sampler, scored = job_gpus_processes(snakemake.resources), None, {}
    for run, model, metrics in zip(p.runs, p.models, snakemake.output, strict=True):
        if (run, model) in scored:  # an evaluation several experiments share: the same, written for each
            copy_evaluation(scored[run, model], Path(metrics).parent)
            continue
        scored[run, model] = Path(metrics).parent
        # A checkpoint screened out on the validation problems is scored no further.
        if screened and (decision := screened_out(screened, run)):
            write_screened(f"results/{snakemake.wildcards.exp}/screen/{run}/metrics.json", metrics, decision)
            continue
        # Each model's finished chunks kept until it is scored: a killed job's rerun samples only the rest. A
        # screened run's, and a screening's, are kept past the job: its next decision (or a killed screening)
        # re-runs the job, which reads them back.
        store, engine = resume_dir(metrics), Engine.of(p.backend, seed=p.seed)
        with chunks_kept(engine, store, processes, keep=bool(screened or screening)) as engine:
            sampler = load_sampler(model, engine, after=sampler)  # one vLLM engine for every model it can
            evaluate(
                model,
                benchmarks,
                SamplingConfig.from_config(p.sampling, p.seed),
                Path(metrics).parent,
                run,
                sampler=sampler,
                validation=p.validation,
                screening=screening,
            )
