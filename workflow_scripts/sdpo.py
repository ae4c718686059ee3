"""SDPO of the post model under one teacher schedule and learning rate (sdpo or sdpo_cot); a checkpoint per
kept step."""

from graftlab.io.warm import hand_off

hand_off()  # in the run's warm process, if there is one (graftlab.io.warm)

import polars as pl

from graftlab.io.joblog import job_log
from graftlab.methods.sdpo import run_density
from graftlab.train.problems import rl_problems
from graftlab.train.resume import Resume, resume_dir
from graftlab.train.sdpo import SdpoConfig, train_sdpo
from graftlab.train.settings import job_settings
from graftlab.train.shard import job_gpus_processes

p, inp = snakemake.params, snakemake.input
# A continual stage starts from a checkpoint inside its previous stage's output (params.model).
model = p.get("model") or inp.model
with job_log(snakemake.log[0], snakemake.threads):
    cfg = SdpoConfig(
        lr=p.lr,
        teacher=p.teacher,
        save_steps=tuple(p.save_steps),
        **job_settings(snakemake),
        **run_density(p.sdpo, p.cot),  # sdpo's switches, or (cot) sdpo_cot's
    )
    problems = rl_problems(pl.read_parquet(inp.data))
    resume = Resume(resume_dir(snakemake.output[0]), p.resume_minutes)
    teacher = {"teacher_dir": p.get("teacher_dir"), "keep_teacher": bool(p.get("keep_teacher"))}
    processes = job_gpus_processes(snakemake.resources)  # sharded over several
    inputs = {"post": model, "data": inp.data}
    train_sdpo(model, problems, cfg, snakemake.output[0], inputs, resume, **teacher, processes=processes)
