"""`graftlab sft`: the workflow's SFT from the command line, its output layout, its one-line refusals that
leave no output behind, and its launch over several processes."""

import argparse
import json
import os
import socket
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import polars as pl
import pytest
import torch
import yaml
from safetensors.torch import load_file

from graftlab.commands.sft import FSDP_CONFIG, add_parser, cli_args, launch_command, main
from graftlab.tasks import arith, chat_completion
from graftlab.train.live import Live
from graftlab.train.sft import TrainConfig
from graftlab.train.shard import job_processes

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model(world_pico) -> Path:
    return world_pico


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "sft.parquet"
    problems = arith.sample_problems("mul", 16, "test", 0)
    completions = [chat_completion(p["thinking"], p["answer"]) for p in problems]
    pl.DataFrame({"prompt": [p["prompt"] for p in problems], "completion": completions}).write_parquet(path)
    return path


def sft(model, data, out, *more) -> int:
    return main(["sft", "--model", str(model), "--data", str(data), "--lr", "1e-3", "--out", str(out), *more])


def test_add_parser_registers_the_subcommand_with_its_runner():
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["sft", "--model", "m", "--data", "d", "--lr", "1e-5", "--steps", "3", "--out", "o"])
    assert args.command == "sft" and callable(args.run) and args.steps == 3 and args.micro_batch_size == "auto"


def test_epochs_write_the_last_epoch_as_dir_and_each_earlier_one_inside_it(model, data, tmp_path):
    out = tmp_path / "donor"
    assert sft(model, data, out, "--epochs", "2", "--batch-size", "8") == 0
    names = {p.name for p in out.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", "graftlab.json", "steps.jsonl", "epoch~1"} <= names
    assert "training.png" in names
    assert "epoch~2" not in names and ".stage" not in names
    final, first = (json.loads((d / "graftlab.json").read_text()) for d in (out, out / "epoch~1"))
    assert (final["checkpoint"], first["checkpoint"]) == (2, 1)
    assert final["params"]["epochs"] == 2 and final["inputs"]["data"] == str(data)
    assert len((out / "steps.jsonl").read_text().splitlines()) == 4  # 16 examples / 8, two epochs
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())
    moved = load_file(out / "model.safetensors")
    assert not torch.equal(
        moved["model.norm.weight"], load_file(out / "epoch~1/model.safetensors")["model.norm.weight"]
    )


def test_steps_write_one_model_in_the_dtype_asked_for(model, data, tmp_path):
    out = tmp_path / "donor"
    assert sft(model, data, out, "--steps", "2", "--batch-size", "4", "--save-dtype", "bfloat16") == 0
    assert not list(out.glob("epoch~*"))
    assert (out / "training.png").read_bytes().startswith(b"\x89PNG")
    assert all("loss" in json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines())
    record = json.loads((out / "graftlab.json").read_text())
    assert record["params"]["steps"] == 2 and record["save_dtype"] == "bfloat16"
    assert {t.dtype for t in load_file(out / "model.safetensors").values()} == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


@pytest.mark.parametrize(
    "more, message, status",
    [
        ([], "exactly one of --epochs and --steps", 2),
        (["--epochs", "1", "--steps", "2"], "exactly one of --epochs and --steps", 2),
        (
            ["--steps", "1", "--batch-size", "8", "--micro-batch-size", "3"],
            "micro_batch_size: 3 does not divide the batch of 8",
            2,
        ),
        (["--steps", "1", "--micro-batch-size", "many"], "--micro-batch-size: must be a number", 2),
        (["--steps", "1", "--lr", "0"], "--lr: must be > 0", 2),
        (["--steps", "1", "--model-missing"], "model directory not found", 1),
        (["--steps", "1", "--bad-data"], "lacks columns ['completion']", 1),
    ],
)
def test_a_refusal_is_one_line_and_leaves_no_output(model, data, tmp_path, capsys, more, message, status):
    if "--model-missing" in more:
        more, model = [m for m in more if m != "--model-missing"], tmp_path / "absent"
    if "--bad-data" in more:
        more, data = [m for m in more if m != "--bad-data"], tmp_path / "bad.parquet"
        pl.DataFrame({"prompt": ["1*2="]}).write_parquet(data)
    assert sft(model, data, tmp_path / "out", *more) == status
    err = capsys.readouterr().err.strip()
    assert err.startswith("graftlab: error:") and message in err and "\n" not in err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


def test_launch_command_runs_one_process_plainly_and_several_under_accelerate():
    argv = ["--model", "m", "--out", "o"]
    assert launch_command(1, argv, fsdp=True) == [sys.executable, "-m", "graftlab.commands.sft", "sft", *argv]
    fsdp = launch_command(4, argv, fsdp=True)
    assert fsdp[:5] == [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "4"]
    assert fsdp[5:7] == ["--config_file", str(FSDP_CONFIG)] and fsdp[-5:] == ["sft", *argv]
    ddp = launch_command(2, argv, fsdp=False)
    assert "--multi_gpu" in ddp and "--config_file" not in ddp
    # Each launch meets on a port free when it starts, never accelerate's fixed default (two jobs on one
    # node would collide there); a given port is passed through.
    port = int(ddp[ddp.index("--main_process_port") + 1])
    assert port != 29500 and launch_command(2, argv, fsdp=False, port=port) == ddp
    with socket.socket() as s:
        s.bind(("localhost", port))  # it was free
    with pytest.raises(ValueError, match="at least 1"):
        launch_command(0, argv, fsdp=False)


def test_the_shipped_fsdp_config_shards_fully_per_decoder_layer_in_bf16_over_fp32():
    """What src/graftlab/commands/fsdp.yaml must say for FSDP of a Qwen3 or OLMo 3 model."""
    from accelerate.commands.config.config_args import load_config_from_file

    assert FSDP_CONFIG == REPO / "src/graftlab/commands/fsdp.yaml"
    raw = yaml.safe_load(FSDP_CONFIG.read_text())
    loaded = load_config_from_file(str(FSDP_CONFIG))  # accelerate itself reads it
    fsdp = loaded.fsdp_config
    assert loaded.distributed_type == "FSDP" and loaded.mixed_precision == "bf16"
    assert fsdp["fsdp_reshard_after_forward"] is True and fsdp["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
    # No layer class named: the model's _no_split_modules decide, which a Qwen3 model has.
    assert "fsdp_transformer_layer_cls_to_wrap" not in raw["fsdp_config"]
    from transformers import Qwen3ForCausalLM

    assert Qwen3ForCausalLM._no_split_modules == ["Qwen3DecoderLayer"]
    assert fsdp["fsdp_state_dict_type"] == "FULL_STATE_DICT"


def test_cli_args_reproduce_the_workflow_config(tmp_path):
    cfg = TrainConfig(lr=3e-3, batch_size=16, epochs=2, seed=5, threads=2, micro_batch_size=4, save_dtype="bfloat16")
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["sft", *cli_args(cfg, "m", "d.parquet", tmp_path / "o")])
    assert (args.lr, args.epochs, args.batch_size, args.micro_batch_size) == (3e-3, 2, 16, 4)
    assert (args.seed, args.threads, args.save_dtype, args.epoch_dirs) == (5, 2, "bfloat16", True)
    assert (args.tensorboard, args.wandb) == (None, None)
    # The processes of a multi-GPU SFT report where the workflow's job would.
    live = Live("logs/tensorboard/x/sft/post/lr~3e-3", "proj", "x/sft/post/lr~3e-3")
    args = parser.parse_args(["sft", *cli_args(replace(cfg, live=live), "m", "d.parquet", tmp_path / "o")])
    assert (args.tensorboard, args.wandb) == (live.tensorboard, "proj")


@pytest.mark.workflow  # a real process killed, or several at once: the slow tier
def test_two_data_parallel_processes_train_as_one_and_write_once(model, data, tmp_path):
    """The workflow's own launch over two processes (`launch_command`, accelerate with commands/fsdp.yaml),
    which on a host without CUDA accelerate runs as data parallel over gloo: each process takes half of
    every batch of 8, the gradients are averaged, and the first process alone writes DIR, with the weights
    of one process taking whole batches. Within fp32 rounding: the launch config's `mixed_precision: bf16`
    must not override the trainer's fp32 (it did, by 1e-4, before graftlab.train.precision pinned it)."""
    single, parallel = tmp_path / "single", tmp_path / "parallel"
    assert sft(model, data, single, "--steps", "2", "--batch-size", "8") == 0
    argv = ["--model", str(model), "--data", str(data), "--lr", "1e-3", "--steps", "2", "--batch-size", "8"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(
        launch_command(2, [*argv, "--threads", "1", "--out", str(parallel)], fsdp=True),
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("batch: 8 = 4 x 1 accumulated x 2 processes") == 2  # both trained
    assert done.stdout.count("graftlab: wrote") == 1
    a, b = load_file(single / "model.safetensors"), load_file(parallel / "model.safetensors")
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["parallel", "single"]


def test_the_workflow_launches_over_several_gpus_and_a_failure_is_one_line(monkeypatch, tmp_path):
    from graftlab.commands import sft as sft_cli
    from graftlab.errors import GraftlabError

    seen = []
    monkeypatch.setattr(
        subprocess, "run", lambda command, check: seen.append(command) or argparse.Namespace(returncode=1)
    )
    cfg = TrainConfig(lr=1e-3, batch_size=8, epochs=2)
    with pytest.raises(GraftlabError, match=r"SFT over 2 GPUs failed \(exit status 1\)"):
        sft_cli.launch_epochs("m", "d.parquet", cfg, tmp_path / "o", 2)
    port = int(seen[0][seen[0].index("--main_process_port") + 1])
    assert seen == [launch_command(2, cli_args(cfg, "m", "d.parquet", tmp_path / "o"), fsdp=True, port=port)]
    assert "--epoch-dirs" in seen[0] and "--config_file" in seen[0]


@pytest.mark.parametrize(("asked", "given", "processes"), [(2, "2", 2), (4, "2", 2), (2, None, 0), (1, "4", 1)])
def test_a_job_without_cuda_starts_a_process_per_gpu_slurm_gave_it(monkeypatch, asked, given, processes):
    """The SLURM test's fake GPUs: no CUDA, the allocation in SLURM_GPUS_ON_NODE; never more than asked."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    if given is None:
        monkeypatch.delenv("SLURM_GPUS_ON_NODE", raising=False)
    else:
        monkeypatch.setenv("SLURM_GPUS_ON_NODE", given)
    count, why = job_processes(asked)
    assert count == processes and "no CUDA" in why


def test_a_job_with_cuda_starts_a_process_per_gpu_it_sees_at_most_those_asked(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "8")  # what torch sees counts, not what SLURM says
    assert [job_processes(n)[0] for n in (1, 2, 4)] == [1, 2, 2]
