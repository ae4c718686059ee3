"""Pedagogical RL's data: the trained teacher's first verified trace per problem, stored without the
reference solution it was shown."""

from graftlab.io.warm import hand_off

hand_off()  # in the run's warm process, if there is one (graftlab.io.warm)

from graftlab.io.joblog import job_log
from graftlab.sample_chunks import chunks_kept
from graftlab.sampling import Engine
from graftlab.synth.pedagogical import write_teacher_traces
from graftlab.synth.star import StarConfig
from graftlab.train.resume import resume_dir
from graftlab.train.shard import job_gpus_processes

p, inp, out = snakemake.params, snakemake.input, snakemake.output
with job_log(snakemake.log[0], snakemake.threads):
    # Finished chunks of samples kept until the job is done: a killed job's rerun samples only the rest;
    # a job one engine would take beyond its limit runs several at once, one a GPU group.
    processes = job_gpus_processes(snakemake.resources)
    with chunks_kept(Engine.of(p.backend, seed=p.seed), resume_dir(out.sft), processes) as engine:
        cfg = StarConfig(**p.sampling, seed=p.seed)
        write_teacher_traces(inp.model, inp.problems, cfg, out.sft, out.stats, engine, p.task, p.template)
