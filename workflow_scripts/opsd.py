"""On-policy self-distillation of the post model at one alpha and learning rate; a checkpoint per save step."""

from graftlab.io.warm import hand_off

hand_off()  # in the run's warm process, if there is one (graftlab.io.warm)

import polars as pl

from graftlab.io.joblog import job_log
from graftlab.synth.demonstrations import opsd_examples
from graftlab.train.opsd import OpsdConfig, train_opsd
from graftlab.train.resume import Resume, resume_dir
from graftlab.train.settings import job_settings
from graftlab.train.shard import job_gpus_processes

p, inp = snakemake.params, snakemake.input
# A continual stage starts from a checkpoint inside its previous stage's output (params.model).
model = p.get("model") or inp.model
o = {k: v for k, v in p.opsd.items() if k != "checkpoints"}
with job_log(snakemake.log[0], snakemake.threads):
    cfg = OpsdConfig(
        alpha=p.alpha,
        lr=p.lr,
        save_steps=tuple(p.save_steps),
        **job_settings(snakemake),
        **o,
    )
    facts = pl.read_parquet(inp.facts) if inp.facts else None
    examples = opsd_examples(pl.read_parquet(inp.data), facts)
    resume = Resume(resume_dir(snakemake.output[0]), p.resume_minutes)
    processes = job_gpus_processes(snakemake.resources)  # sharded over several
    inputs = {"post": model, "data": inp.data}
    train_opsd(model, examples, cfg, snakemake.output[0], inputs, resume, processes=processes)
