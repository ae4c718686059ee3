"""Supervised fine-tuning with TRL's `SFTTrainer`, which runs cleanly on the CPU here (checked on a
0.2M-parameter Qwen3 model: about 14 steps/s at batch 32). Examples arrive pre-tokenized with a
`completion_mask`, so TRL neither re-templates them nor puts loss on prompt tokens.

The same entry point pretrains the tiny world (no mask: loss on every token), post-trains it and fine-tunes
donors, so every model of the pipeline is trained by one code path.
"""

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from graftlab.methods import METHODS
from graftlab.methods.spec import refuse
from graftlab.schema import schema_default
from graftlab.train.resume import (
    RESUME_ONLY,
    TRAINER_STATE,
    Resume,
    fingerprint,
    last_checkpoint,
    link_tree,
    mark_trained,
    trained,
    trainer_callback,
)
from graftlab.train.settings import RunSettings


@dataclass(frozen=True, kw_only=True)
class TrainConfig(RunSettings):
    lr: float
    batch_size: int
    epochs: int | None = None  # one checkpoint per epoch ...
    steps: int | None = None  # ... or a fixed number of steps with checkpoints at save_steps
    save_steps: tuple[int, ...] = ()
    warmup_ratio: float = 0.05
    weight_decay: float = 0.0
    max_grad_norm: float = schema_default("sft", "max_grad_norm")  # 0: no clipping
    # batch_size is the effective batch: micro-batches of this size, their gradients accumulated.
    micro_batch_size: int | str = schema_default("sft", "micro_batch_size")
    # A model whose tokenizer's chat template formats the examples, and is saved with the trained model: a
    # donor from pre-training has none, and learns the post model's format (docs/methods.md).
    chat_template_from: str | None = None

    def __post_init__(self) -> None:
        refuse("SFT", METHODS["sft"].spec.check(vars(self)))  # the config's checks (graftlab.methods)


def encode_chat(tokenizer, prompt_text: str, completion_text: str) -> dict:
    """Token ids of prompt + completion and a mask that is 1 on completion tokens only."""
    p = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    c = tokenizer(completion_text, add_special_tokens=False)["input_ids"]
    return {"input_ids": p + c, "completion_mask": [0] * len(p) + [1] * len(c)}


def encode_traces(tokenizer, prompts: list[str], completions: list[str]) -> list[dict]:
    """SFT examples from user prompts and assistant completions, in the model's chat format."""
    from graftlab.tasks import chat_prompt

    return [encode_chat(tokenizer, chat_prompt(tokenizer, p), c) for p, c in zip(prompts, completions)]


def sft_inputs(model_dir, data, template_from=None, role: str = "model") -> tuple:
    """The tokenizer and encoded examples of SFT of the model at `model_dir` (its `role` names it in a
    refusal) on the traces parquet `data`, each input through its gate before any training: a model
    directory with finite weights (a NaN weight makes every loss NaN, hours later), a tokenizer with a chat
    template (its own, or `template_from`'s), text in every row, every example within the model's context."""
    from graftlab.io.gates import chat_tokenizer, context_length
    from graftlab.io.gates import model_dir as model_gate
    from graftlab.io.tables import read_traces, within_context

    config = model_gate(model_dir, role)
    traces = read_traces(data)
    tokenizer = chat_tokenizer(model_dir, role, template_from)
    rows = encode_traces(tokenizer, traces["prompt"].to_list(), traces["completion"].to_list())
    within_context([len(r["input_ids"]) for r in rows], context_length(config), f"SFT data ({data})")
    model_gate(model_dir, role, finite=True)
    return tokenizer, rows


def step_timer(records: list[dict], keep: Path | None = None):
    """A TrainerCallback appending each optimizer step's epoch and wall seconds (forward, backward and
    update: SFT samples nothing) to `records`, for the latency comparison with OPSD, whose steps also
    sample, and to charge a checkpoint `epoch~e` the steps it took; and the step's training `loss` and
    gradient norm before clipping, for its curves (`training.png`). With `keep`, the records so far are
    written there at every checkpoint, for a resumed run to start from."""
    import math
    import time

    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        epoch = 0

        def on_epoch_begin(self, args, state, control, **kwargs):
            # `state.epoch` ends an epoch at 0.999… or 1.000…; a resumed run begins mid-epoch.
            self.epoch = math.floor(state.epoch + 1e-6) + 1

        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            seconds = time.perf_counter() - self.start
            records.append({"step": state.global_step, "epoch": self.epoch, "sample_s": 0.0, "update_s": seconds})

        def on_log(self, args, state, control, logs=None, **kwargs):
            # Called after on_step_end and before on_save, so the loss is in the step's record when `keep`
            # is written. With logging_steps=1 (`trl_args`), transformers' `_maybe_log_save_evaluate` logs
            # the loss summed since the last log over the steps since it: this step's loss alone, the
            # token-mean cross-entropy on the completion tokens of its whole batch (its micro-batches and
            # processes together). The end-of-training log has `train_loss`, not `loss`, and is skipped.
            if not logs or "loss" not in logs:
                return
            for record in reversed(records):
                if record["step"] == state.global_step:
                    for key in ("loss", "grad_norm"):  # the norm before clipping (`max_grad_norm`)
                        value = float(logs[key]) if key in logs else math.nan
                        record[key] = value if math.isfinite(value) else None  # JSON has no NaN: null
                    break

        def on_save(self, args, state, control, **kwargs):
            if keep is not None:
                keep.write_text(json.dumps(records))

    return StepTimer()


def train(
    model,
    tokenizer,
    rows: list[dict],
    work_dir: Path,
    cfg: TrainConfig,
    steps: list[dict] | None = None,
    resume: Resume | None = None,
) -> list[Path]:
    """Train `model` in place on `rows`; return the checkpoint directories in training order, and append
    every step's seconds to `steps` when given. With `resume`, `work_dir` is its directory: the Trainer
    saves its full state there every `resume.minutes` and continues from the newest such state.

    Each checkpoint is a complete Hugging Face model directory (weights, config, tokenizer).
    """
    import torch
    from datasets import Dataset
    from transformers import ProgressCallback
    from trl import SFTTrainer

    from graftlab.train import diverge

    torch.set_num_threads(cfg.threads)
    if cfg.epochs is None and cfg.steps is None:
        raise ValueError("TrainConfig needs epochs or steps")
    args = _sft_args(cfg, work_dir, "completion_mask" in rows[0], resume is not None, _micro(cfg, rows, model))
    start = last_checkpoint(resume) if resume is not None else None
    keep = work_dir / "steps.json" if resume is not None else None
    if start is not None and steps is not None and keep.exists():
        done = int(Path(start).name.split("-")[1])
        steps[:] = [r for r in json.loads(keep.read_text()) if r["step"] <= done]
    callbacks = [diverge.trainer_callback("SFT")] + ([step_timer(steps, keep)] if steps is not None else [])
    if resume is not None:
        callbacks.append(trainer_callback(resume))
    trainer = SFTTrainer(
        model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer, callbacks=callbacks
    )
    try:
        trainer.train(resume_from_checkpoint=start)
    except BaseException:
        # A run stopped mid-way (diverged, out of memory) leaves its progress bar open: the error would print
        # on the bar's line, and the bar once more after it.
        bar = getattr(trainer.pop_callback(ProgressCallback), "training_bar", None)
        if bar is not None:
            bar.close()
        raise
    checkpoints = sorted(work_dir.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    for ckpt in [c for c in checkpoints if (c / RESUME_ONLY).exists()]:
        shutil.rmtree(ckpt)
    checkpoints = [c for c in checkpoints if c.exists()]
    # A resumable run keeps the newest state until its output is written (publish_checkpoints skips it).
    for ckpt in checkpoints if resume is None else ():
        for name in TRAINER_STATE:
            (ckpt / name).unlink(missing_ok=True)
    if cfg.save_steps:
        wanted = set(cfg.save_steps)
        checkpoints = [c for c in checkpoints if int(c.name.split("-")[1]) in wanted]
    return checkpoints


def _micro(cfg: TrainConfig, rows: list[dict], model) -> int:
    """The micro-batch of one process: its share of the effective batch (data-parallel processes each
    take batch / processes) in micro-batches sized for the longest example."""
    import os

    from graftlab.errors import GraftlabError
    from graftlab.train.precision import micro_batch

    processes = int(os.environ.get("WORLD_SIZE", "1"))
    if cfg.batch_size % processes:
        raise GraftlabError(f"batch_size {cfg.batch_size} does not split over {processes} processes")
    seq_len = max(len(r["input_ids"]) for r in rows)
    return micro_batch(cfg.micro_batch_size, cfg.batch_size // processes, seq_len, model)


def _sft_args(cfg: TrainConfig, work_dir: Path, masked: bool, resumable: bool, micro: int | None = None):
    import os

    from trl import SFTConfig

    from graftlab.train.precision import accumulation, announce, checkpointing
    from graftlab.train.trl_args import trl_args

    precision = announce(cfg.precision)
    per_process = cfg.batch_size // int(os.environ.get("WORLD_SIZE", "1"))
    micro = micro or per_process
    recompute = checkpointing(cfg.gradient_checkpointing)
    print(
        f"batch: {cfg.batch_size} = {micro} x {accumulation(per_process, micro)} accumulated"
        f" x {cfg.batch_size // per_process} processes; gradient checkpointing {'on' if recompute else 'off'}",
        flush=True,
    )
    return trl_args(
        SFTConfig,
        cfg,
        work_dir,
        per_process,
        micro,
        precision,
        num_train_epochs=cfg.epochs or 1,
        max_steps=cfg.steps or -1,
        lr_scheduler_type="cosine",
        warmup_steps=cfg.warmup_ratio,
        weight_decay=cfg.weight_decay,
        optim="adamw_torch",
        save_strategy="epoch" if cfg.epochs else "steps",
        save_steps=_save_every(cfg),
        # Resuming needs the optimizer, scheduler and RNG in the checkpoint, not only the model.
        save_only_model=not resumable,
        completion_only_loss=masked,
        data_seed=cfg.seed,
        # Every parameter gets a gradient; DDP's search for unused ones is an extra pass over the graph.
        ddp_find_unused_parameters=False,
        max_length=None,
        disable_tqdm=False,
    )


def _save_every(cfg: TrainConfig) -> int:
    # Trainer saves every k steps; the ladder's checkpoints must be multiples of one k.
    if not cfg.save_steps:
        return 10**9
    from functools import reduce
    from math import gcd

    return reduce(gcd, cfg.save_steps)


def publish_checkpoints(checkpoints: list[Path], targets: list[Path], link: bool, dtype: str = "float32") -> None:
    """Each checkpoint to its target: moved, or with `link` hard-linked without its training state, so
    the resume directory it lies in stays whole until the output is written; then its weights are
    written as `dtype` (the trainer saves its fp32 master weights; the cast replaces the target's files,
    never the linked originals)."""
    from graftlab.train.precision import cast_saved

    if len(checkpoints) != len(targets):
        raise RuntimeError(f"training wrote {len(checkpoints)} checkpoints, expected {len(targets)}")
    for src, dst in zip(checkpoints, targets):
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(dst, ignore_errors=True)
        if link:
            link_tree(src, dst, skip=TRAINER_STATE)
        else:
            shutil.move(str(src), str(dst))
        cast_saved(dst, dtype)


def main_process() -> bool:
    """Whether this is the process that writes outputs: the only one, or rank 0 of `accelerate launch`."""
    import os

    return int(os.environ.get("RANK", "0")) == 0


def finetune(
    model_dir,
    rows: list[dict],
    cfg: TrainConfig,
    targets: list[Path],
    model=None,
    data=None,
    steps_out=None,
    resume: Resume | None = None,
    tokenizer=None,
) -> None:
    """Train the model at `model_dir` (or the given fresh `model`) and write one checkpoint per target,
    each with its `graftlab.json` provenance, and the seconds and loss of every step as JSON lines to
    `steps_out`, with their curves (`graftlab.train.curves.plot_training`) as `training.png` beside it.

    Training state lives in a hidden work directory beside the first target, so a failed run leaves no
    directory that looks like a finished checkpoint; with `resume`, in its directory instead, which a
    failed run keeps for the rerun to continue from. `tokenizer` (by default `model_dir`'s) is saved with
    every checkpoint.
    """

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from graftlab.io.provenance import write_provenance
    from graftlab.train.precision import WEIGHTS_DTYPE, save_dtype
    from graftlab.train.settings import recorded

    tokenizer = tokenizer or AutoTokenizer.from_pretrained(model_dir)
    dtype = save_dtype(cfg.save_dtype, model_dir, model)
    inputs = {"model": "initialised from scratch" if model is not None else str(model_dir), "data": str(data)}
    if resume is not None:
        resume.open(fingerprint(cfg, model=inputs["model"], data=inputs["data"], examples=len(rows)))
        work = resume.dir
    else:
        work = targets[0].parent / f".work-{targets[0].name}"
        shutil.rmtree(work, ignore_errors=True)
    try:
        done = trained(resume)
        if done is None:
            if model is None:
                model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=WEIGHTS_DTYPE)
            steps: list[dict] = []
            checkpoints = train(model, tokenizer, rows, work, cfg, steps, resume)
            if not main_process():
                return  # under data parallelism the first process alone saves, and writes the output
            for i, ckpt in enumerate(checkpoints):
                extra = {"checkpoint": i + 1, "examples": len(rows), "save_dtype": dtype}
                write_provenance(ckpt, inputs, recorded(cfg), extra=extra)
            if resume is not None:
                mark_trained(resume, {"checkpoints": [c.name for c in checkpoints], "steps": steps})
        else:
            checkpoints, steps = [work / name for name in done["checkpoints"]], done["steps"]
        publish_checkpoints(checkpoints, targets, link=resume is not None, dtype=dtype)
        if steps_out is not None:
            from graftlab.train.curves import write_step_log

            write_step_log(steps, steps_out)
    finally:
        if resume is None:
            shutil.rmtree(work, ignore_errors=True)
    if resume is not None:
        resume.finish()


def sft_epochs(model_dir, data, cfg: TrainConfig, out_dir: Path, resume: Resume | None = None, inputs=None) -> None:
    """SFT on a traces parquet (`prompt`, `completion`); writes `out_dir/epoch~{e}` for every epoch,
    `out_dir/steps.jsonl`, the seconds (as OPSD's, with no sampling) and loss of every step, and
    `out_dir/training.png`, its curves; all at once, so a failed run leaves nothing. With `resume`, a
    killed run continues from its newest saved state. `inputs`: `sft_inputs`' answer, when already gated."""
    from graftlab.io.atomic import atomic_dir

    tok, rows = inputs or sft_inputs(model_dir, data, cfg.chat_template_from)
    with atomic_dir(out_dir) as tmp:
        targets = [tmp / f"epoch~{e}" for e in range(1, cfg.epochs + 1)]
        finetune(model_dir, rows, cfg, targets, data=data, steps_out=tmp / "steps.jsonl", resume=resume, tokenizer=tok)
