"""One part of an evaluation's sampling (rules/evaluate.smk): every n-th chunk of each model's calls, drawn
into the store its evaluation job reads back and grades (graftlab.sample_chunks.Part)."""

from graftlab.io.warm import hand_off

hand_off()  # in the run's warm process, if there is one (graftlab.io.warm)


from graftlab.analysis.screen import screened_out
from graftlab.evaluate.run import Benchmark, presample
from graftlab.io.atomic import write_json
from graftlab.io.joblog import job_log
from graftlab.sample_chunks import Part, chunks_kept
from graftlab.sampling import Engine, SamplingConfig, load_sampler
from graftlab.train.resume import resume_dir
from graftlab.train.shard import job_gpus_processes

p, w = snakemake.params, snakemake.wildcards
part = Part(int(w.part), int(w.parts))
benchmarks = Benchmark.all_of(p.benchmarks)
screened, skipped = snakemake.input.get("screened"), []
with job_log(snakemake.log[0], snakemake.threads):
    processes, sampler = job_gpus_processes(snakemake.resources), None
    for run, model, metrics in zip(p.runs, p.models, p.metrics, strict=True):
        # A checkpoint an adaptive experiment screened out is scored no further: its parts sample nothing.
        if screened and screened_out(screened, run) is not None:
            skipped.append(run)
            continue
        with chunks_kept(Engine.of(p.backend, seed=p.seed), resume_dir(metrics), processes, part) as engine:
            sampler = load_sampler(model, engine, after=sampler)  # one vLLM engine for every model it can
            presample(model, benchmarks, SamplingConfig.from_config(p.sampling, p.seed), sampler)
write_json(
    snakemake.output[0], {"part": part.index, "of": part.count, "models": list(p.models), "screened_out": skipped}
)
