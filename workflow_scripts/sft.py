"""SFT of one model at one learning rate; a checkpoint per epoch. Over several GPUs through accelerate.
Also a continual chain's SFT stage (rule chain_sft)."""

from graftlab.io.warm import hand_off

hand_off()  # in the run's warm process, if there is one (graftlab.io.warm)

from pathlib import Path

from graftlab.commands.sft import launch_epochs
from graftlab.io.joblog import job_log
from graftlab.train.resume import Resume, resume_dir
from graftlab.train.settings import job_settings
from graftlab.train.sft import TrainConfig, sft_epochs
from graftlab.train.shard import job_gpus_processes

p = snakemake.params
cfg = TrainConfig(
    lr=p.lr,
    batch_size=p.batch_size,
    epochs=p.epochs,
    micro_batch_size=p.micro_batch_size,
    chat_template_from=p.template,
    **job_settings(snakemake),
)
with job_log(snakemake.log[0], snakemake.threads):
    processes = job_gpus_processes(snakemake.resources)  # FSDP over several
    if processes > 1:
        launch_epochs(p.model, snakemake.input.data, cfg, Path(snakemake.output[0]), processes)
    else:
        resume = Resume(resume_dir(snakemake.output[0]), p.resume_minutes)
        sft_epochs(p.model, snakemake.input.data, cfg, Path(snakemake.output[0]), resume)
