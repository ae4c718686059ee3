"""SFT of one model at one learning rate; a checkpoint per epoch."""

from pathlib import Path

from graftlab.joblog import job_log
from graftlab.train.resume import Resume, resume_dir
from graftlab.train.sft import TrainConfig, sft_epochs

p = snakemake.params
cfg = TrainConfig(
    lr=p.lr,
    batch_size=p.batch_size,
    epochs=p.epochs,
    seed=p.seed,
    threads=snakemake.threads,
    precision=p.precision,
    micro_batch_size=p.micro_batch_size,
    gradient_checkpointing=p.gradient_checkpointing,
    save_dtype=p.save_dtype,
)
with job_log(snakemake.log[0], snakemake.threads):
    resume = Resume(resume_dir(snakemake.output[0]), p.resume_minutes)
    sft_epochs(p.model, snakemake.input.data, cfg, Path(snakemake.output[0]), resume)
