"""`graftlab sft`: the workflow's SFT (`graftlab.train.sft`) on one model and one data set, outside
Snakemake, as `trl sft` would run it: for making a donor by hand.

DIR is the trained model, a Hugging Face directory with its `graftlab.json`. With `--epochs E` it holds
the last epoch's model, and every earlier epoch e lies inside it as `DIR/epoch~e` (the workflow grafts
every epoch, and a model directory loads the same with subdirectories beside its files). `DIR/steps.jsonl`
holds the seconds and loss of every step, `DIR/training.png` its curves. A failed run leaves no DIR.

`accelerate launch -m graftlab.commands.sft sft ...` runs the same over several processes
(`launch_command` builds that line; docs/real-models.md#more-than-one-gpu).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from graftlab.errors import UsageError
from graftlab.io.gates import MAX_LR, flag, threads
from graftlab.sampling import free_port
from graftlab.train.live import Live
from graftlab.train.shard import FSDP_CONFIG  # shipped inside the package: accelerate reads it as a file


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register the `sft` subcommand on the `graftlab` command's subparsers."""
    from graftlab.schema import schema_default

    p = subparsers.add_parser(
        "sft",
        help="fine-tune a model on a prompt/completion parquet, as the workflow's SFT",
        description="Supervised fine-tuning of MODEL on a parquet with `prompt` and `completion` columns (loss on "
        "completion tokens only; AdamW, cosine schedule, 5% warm-up), written to DIR as a Hugging Face model "
        "with graftlab.json. With --epochs E, DIR is the last epoch and DIR/epoch~e each earlier one.",
    )
    p.add_argument("--model", required=True, help="Hugging Face model directory to start from")
    p.add_argument("--data", required=True, help="parquet with `prompt` and `completion` columns")
    p.add_argument("--lr", required=True, type=flag(above=0, high=MAX_LR), help="peak learning rate")
    p.add_argument("--epochs", type=flag(low=1, integer=True), help="passes over the data (give this or --steps)")
    p.add_argument("--steps", type=flag(low=1, integer=True), help="optimizer steps (give this or --epochs)")
    p.add_argument("--out", required=True, help="output model directory (written atomically)")
    p.add_argument(
        "--batch-size",
        type=flag(low=1, integer=True),
        default=schema_default("sft", "batch_size"),
        help="examples per optimizer step",
    )
    p.add_argument(
        "--micro-batch-size",
        default="auto",
        type=_micro_batch,
        help="examples per forward/backward pass, dividing --batch-size; auto: whole batch on CPU, memory-sized on GPU",
    )
    p.add_argument(
        "--seed",
        type=flag(low=0, integer=True),
        default=0,
        help="seed of the data order and initialisation of the trainer",
    )
    p.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto", help="training precision")
    p.add_argument(
        "--save-dtype",
        choices=["auto", "float32", "bfloat16"],
        default="auto",
        help="dtype of the written weights; auto: the dtype MODEL is stored in",
    )
    p.add_argument(
        "--gradient-checkpointing",
        choices=["auto", "true", "false"],
        default="auto",
        help="recompute activations in the backward pass; auto: on for CUDA, off on CPU",
    )
    p.add_argument("--threads", type=threads(), default=None, help="torch threads (default: torch's choice)")
    p.add_argument(
        "--chat-template-from",
        metavar="DIR",
        help="format the examples with this model's chat template, saved with DIR (a donor from pre-training "
        "has none: give the post-trained model)",
    )
    p.add_argument("--tensorboard", metavar="DIR", help="write the step metrics to TensorBoard event files in DIR")
    p.add_argument("--wandb", metavar="PROJECT", help="log the step metrics to this Weights & Biases project")
    # The workflow's layout (DIR/epoch~e for every epoch, DIR/steps.jsonl and training.png), for its runs over
    # several GPUs.
    p.add_argument("--epoch-dirs", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(run=run)


def _micro_batch(text: str) -> str | int:
    return text if text == "auto" else flag(low=1, integer=True)(text)


def _config(args: argparse.Namespace):
    from graftlab.train.sft import TrainConfig

    if (args.epochs is None) == (args.steps is None):
        raise UsageError("graftlab sft needs exactly one of --epochs and --steps")
    if args.epoch_dirs and args.epochs is None:
        raise UsageError("--epoch-dirs needs --epochs")
    from graftlab.errors import GraftlabError

    try:
        return TrainConfig(
            lr=args.lr,
            batch_size=args.batch_size,
            epochs=args.epochs,
            steps=args.steps,
            save_steps=(args.steps,) if args.steps else (),
            seed=args.seed,
            threads=args.threads or 1,
            precision=args.precision,
            micro_batch_size=args.micro_batch_size,
            gradient_checkpointing={"auto": "auto", "true": True, "false": False}[args.gradient_checkpointing],
            save_dtype=args.save_dtype,
            live=Live(args.tensorboard, args.wandb, str(args.out)),  # a W&B run named by its output
            chat_template_from=args.chat_template_from,
        )
    except GraftlabError as err:  # the method's checks of how the flags combine (graftlab.methods)
        raise UsageError(str(err)) from None


def run(args: argparse.Namespace) -> None:
    """Train and write DIR (`args.out`); every refusal is a GraftlabError raised before DIR exists."""
    from graftlab.io.gates import output

    cfg = _config(args)
    # The workflow's layout goes to a Snakemake output, which Snakemake clears; it must still not be an input.
    output(args.out, {"--model": args.model, "--data": args.data, "--chat-template-from": args.chat_template_from})
    if args.threads is None:
        import dataclasses

        import torch

        # TrainConfig pins torch to its threads; a hand run keeps torch's own choice unless told.
        cfg = dataclasses.replace(cfg, threads=torch.get_num_threads())
    from graftlab.io.atomic import atomic_dir
    from graftlab.train.sft import finetune, main_process, sft_epochs, sft_inputs

    out = Path(args.out)
    inputs = sft_inputs(args.model, args.data, args.chat_template_from, "--model")
    if not main_process():
        _train_replica(args, cfg, *inputs)
        return
    if args.epoch_dirs:
        sft_epochs(args.model, args.data, cfg, out, inputs=inputs)
        return
    with atomic_dir(out) as tmp:
        stage = tmp / ".stage"
        if cfg.epochs:
            sft_epochs(args.model, args.data, cfg, stage, inputs=inputs)
            final = stage / f"epoch~{cfg.epochs}"
        else:
            tok, rows = inputs
            final = stage / "model"
            finetune(args.model, rows, cfg, [final], data=args.data, steps_out=stage / "steps.jsonl", tokenizer=tok)
        for item in [*final.iterdir(), *(p for p in stage.iterdir() if p != final)]:
            shutil.move(str(item), str(tmp / item.name))
        shutil.rmtree(stage)
    print(f"graftlab: wrote {out}")


def _train_replica(args: argparse.Namespace, cfg, tokenizer, rows) -> None:
    """A data-parallel process other than the first: it trains in step with the first, which alone saves
    and writes DIR, in a scratch directory of its own that it removes."""
    import os
    import tempfile

    from graftlab.train.sft import finetune

    if cfg.epochs:
        names = [f"epoch~{e}" for e in range(1, cfg.epochs + 1)]
    else:
        names = ["model"]
    with tempfile.TemporaryDirectory(prefix=f"graftlab-sft-rank{os.environ.get('RANK')}-") as scratch:
        finetune(args.model, rows, cfg, [Path(scratch) / n for n in names], data=args.data, tokenizer=tokenizer)


def launch_command(
    processes: int, argv: Sequence[str], fsdp: bool, config: Path = FSDP_CONFIG, port: int | None = None
) -> list[str]:
    """The command that runs `graftlab sft` with the arguments `argv` over `processes` GPUs of one node:
    `accelerate launch` with FSDP (full shard, one wrap per decoder layer, fp32 master weights, bf16
    compute: src/graftlab/commands/fsdp.yaml) when the model does not fit one GPU, else plain DDP; one
    process, no launcher. The processes meet on `port`, by default one free now: accelerate's own default,
    29500, would make two such jobs on one node collide."""
    if processes < 1:
        raise ValueError(f"processes must be at least 1, got {processes}")
    entry = ["-m", "graftlab.commands.sft", "sft", *argv]
    if processes == 1:
        return [sys.executable, *entry]
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(processes)]
    launch += ["--config_file", str(config)] if fsdp else ["--multi_gpu"]
    launch += ["--main_process_port", str(port or free_port())]
    return [*launch, *entry]


def cli_args(cfg, model, data, out) -> list[str]:
    """The arguments of `graftlab sft` that train as TrainConfig `cfg` does, into the workflow's layout."""
    if not cfg.epochs:
        raise ValueError("the workflow's layout is one directory per epoch: cfg needs epochs")
    flag = {"auto": "auto", True: "true", False: "false"}[cfg.gradient_checkpointing]
    return [
        *("--model", str(model), "--data", str(data), "--out", str(out), "--lr", repr(cfg.lr)),
        *("--epochs", str(cfg.epochs), "--batch-size", str(cfg.batch_size)),
        *("--micro-batch-size", str(cfg.micro_batch_size), "--seed", str(cfg.seed), "--threads", str(cfg.threads)),
        *("--precision", cfg.precision, "--save-dtype", cfg.save_dtype, "--gradient-checkpointing", flag),
        *live_args(Live.of(cfg.live)),
        *(["--chat-template-from", str(cfg.chat_template_from)] if cfg.chat_template_from else []),
        "--epoch-dirs",
    ]


def live_args(live) -> list[str]:
    """The flags that report as `live` (a `graftlab.train.live.Live`) does."""
    board = ["--tensorboard", live.tensorboard] if live.tensorboard else []
    return board + (["--wandb", live.wandb] if live.wandb else [])


def launch_epochs(model, data, cfg, out, gpus: int) -> None:
    """The workflow's SFT (`sft_epochs`'s output) over `gpus` GPUs with FSDP: a job is given more than one
    GPU only when the model does not fit one (graftlab.planning.resources). Time-based resume is not offered here:
    every process would have to agree on when to save."""
    import subprocess

    from graftlab.errors import GraftlabError

    command = launch_command(gpus, cli_args(cfg, model, data, out), fsdp=True)
    print("launch: " + " ".join(command), flush=True)
    done = subprocess.run(command, check=False)
    if done.returncode:
        raise GraftlabError(f"SFT over {gpus} GPUs failed (exit status {done.returncode}); see the log above")


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m graftlab.commands.sft sft ...`: the subcommand alone, for `accelerate launch -m`; its
    refusals and exit statuses are the `graftlab` command's."""
    from graftlab.commands.refusal import Parser, refused, run

    parser = Parser(prog="graftlab")
    add_parser(parser.add_subparsers(dest="command", required=True))
    try:
        return run(parser.parse_args(argv))
    except UsageError as e:
        return refused(e, 2)


if __name__ == "__main__":
    sys.exit(main())
