"""Live metrics of a training run, for watching it while it runs (its `steps.jsonl` and `training.png` are
written when it ends): TensorBoard event files by default, Weights & Biases as well when asked.

`Live` is a run's choice, set by the workflow from the config's `live_metrics` section (`job_settings`):
the TensorBoard directory `logs/tensorboard/<the job's log path>/`, so `tensorboard --logdir logs/tensorboard`
shows every run of every experiment named by its key, and the W&B project, the run named by the same key.
TRL's trainers (SFT, GRPO, the Pedagogical RL teacher) report through transformers' own callbacks
(`trainer_kwargs`); our own loops (OPSD, SDPO) through `writer`, one scalar per numeric field of each step's
record.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Live:
    """Where a run's live metrics go: `tensorboard`, its event files' directory, and `wandb`, a W&B project;
    None for neither. `name` names the run in W&B."""

    tensorboard: str | None = None
    wandb: str | None = None
    name: str | None = None

    @classmethod
    def of(cls, spec) -> Live:
        """From a `Live`, its dict, or None (no live metrics: a run outside the workflow)."""
        return spec if isinstance(spec, Live) else cls(**(spec or {}))

    @classmethod
    def for_job(cls, section: dict, log_file: str) -> Live:
        """The choice of a workflow job: the config's `live_metrics` section, the job's log file naming the
        run (`logs/expert/sft/post/lr~1e-3.log` -> TensorBoard `logs/tensorboard/expert/sft/post/lr~1e-3/`,
        W&B run `expert/sft/post/lr~1e-3`)."""
        key = Path(log_file).with_suffix("").as_posix().removeprefix("logs/")
        board = f"logs/tensorboard/{key}" if section["tensorboard"] else None
        return cls(board, section["wandb"], key)


def trainer_kwargs(live) -> dict:
    """transformers' TrainingArguments reporting `live`: its `report_to` and `run_name`. transformers reads
    TensorBoard's directory from the environment (`TENSORBOARD_LOGGING_DIR`) and W&B's project from
    `WANDB_PROJECT`: set here, in this job's own process."""
    live = Live.of(live)
    report = []
    if live.tensorboard:
        os.environ["TENSORBOARD_LOGGING_DIR"] = str(Path(live.tensorboard).resolve())
        report.append("tensorboard")
    if live.wandb:
        _need_wandb()
        os.environ["WANDB_PROJECT"] = live.wandb
        report.append("wandb")
    return {"report_to": report or "none", "run_name": live.name}


@contextmanager
def writer(live):
    """A function `log(record)` writing each numeric field of a step's record (its `step` the x axis) to
    `live`'s TensorBoard and W&B run; closed, and flushed, on leaving."""
    live = Live.of(live)
    board = run = None
    if live.tensorboard:
        from torch.utils.tensorboard import SummaryWriter

        board = SummaryWriter(live.tensorboard)
    if live.wandb:
        wandb = _need_wandb()
        run = wandb.init(project=live.wandb, name=live.name, reinit="create_new")

    def log(record: dict) -> None:
        scalars = {k: v for k, v in record.items() if isinstance(v, int | float) and not isinstance(v, bool)}
        step = int(record["step"])
        if board is not None:
            for key, value in scalars.items():
                if key != "step":
                    board.add_scalar(key, value, step)
        if run is not None:
            run.log(scalars, step=step)

    try:
        yield log
    finally:
        if board is not None:
            board.close()
        if run is not None:
            run.finish()


def _need_wandb():
    try:
        import wandb
    except ImportError:
        raise RuntimeError(
            "live_metrics.wandb names a Weights & Biases project, but wandb is not installed: pip install wandb "
            "(and `wandb login`), or set live_metrics.wandb: null"
        ) from None
    return wandb
