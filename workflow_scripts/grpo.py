"""GRPO of the post model at one learning rate on its setting's SFT problems; a checkpoint per save step."""

from graftlab.io.warm import hand_off

hand_off()  # in the run's warm process, if there is one (graftlab.io.warm)

import polars as pl

from graftlab.io.joblog import job_log
from graftlab.train.grpo import GrpoConfig, train_grpo
from graftlab.train.problems import rl_problems
from graftlab.train.resume import Resume, resume_dir
from graftlab.train.settings import job_settings
from graftlab.train.shard import job_gpus_processes

p, inp = snakemake.params, snakemake.input
# A continual stage starts from a checkpoint inside its previous stage's output (params.model).
model = p.get("model") or inp.model
g = {k: v for k, v in p.grpo.items() if k not in ("lr", "checkpoints")}
with job_log(snakemake.log[0], snakemake.threads):
    cfg = GrpoConfig(
        lr=float(p.lr),
        save_steps=tuple(p.save_steps),
        **job_settings(snakemake),
        **g,
    )
    problems = rl_problems(pl.read_parquet(inp.data))
    resume = Resume(resume_dir(snakemake.output[0]), p.resume_minutes)
    processes = job_gpus_processes(snakemake.resources)  # sharded over several
    inputs = {"post": model, "data": inp.data}
    train_grpo(model, problems, cfg, snakemake.output[0], inputs, resume, processes=processes)
