"""Shared fixtures: pico Qwen3 models built locally (no hub access), small enough for unit tests."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch


def build_pico_model(
    out: Path,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    max_shard_size: int | str | None = None,
    base: Path | None = None,
    noise: float = 0.0,
    **config: object,
) -> Path:
    """Save a tiny random Qwen3ForCausalLM (hidden 16, 2 layers, vocab 32 unless ``config`` overrides).

    With ``base``, start from that saved model instead and add ``noise``-scaled Gaussian noise to every
    parameter: a stand-in for fine-tuning that keeps the shapes and config of ``base``.
    """
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    if base is not None:
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(noise * torch.randn_like(param))
    else:
        defaults = dict(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            vocab_size=32,
            max_position_embeddings=64,
        )
        model = Qwen3ForCausalLM(Qwen3Config(**{**defaults, **config}))
        with torch.no_grad():
            # Random norms too (they initialise to ones), so every tensor differs between models.
            for param in model.parameters():
                param.add_(0.02 * torch.randn_like(param))
    model.to(dtype)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out, **kwargs)
    return out


@pytest.fixture
def pico_model(tmp_path: Path) -> Callable[..., Path]:
    """Factory: ``pico_model("name", seed=..., dtype=..., max_shard_size=..., base=..., noise=...,
    **qwen3_config)`` saves a pico model under ``tmp_path/name`` and returns its directory."""

    def make(name: str = "model", **kwargs: object) -> Path:
        return build_pico_model(tmp_path / name, **kwargs)

    return make


REPO = Path(__file__).resolve().parents[1]
SMOKE = REPO / "configs" / "smoke.yaml"
# The tiny world's architecture at its smallest, with the world's character tokenizer: what a trainer test
# trains in seconds (SFT, OPSD, the teacher, resume).
WORLD_PICO = dict(hidden_size=16, intermediate_size=32, layers=1, heads=2, kv_heads=1, max_positions=256)


@pytest.fixture(scope="session")
def world_pico(tmp_path_factory) -> Path:
    """A model directory of WORLD_PICO at seed 0, with its tokenizer; tests only read it."""
    from graftlab.world import build
    from graftlab.world.tokenizer import build_tokenizer

    path = tmp_path_factory.mktemp("world-pico")
    tok = build_tokenizer()
    build.init_model(tok, WORLD_PICO, seed=0).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def snakemake(workdir: Path, *args: str, configs: tuple[Path, ...] = (SMOKE,)) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--directory", str(workdir)]
    cmd += ["--configfile", *map(str, configs)] if configs else []
    return subprocess.run(cmd + list(args), capture_output=True, text=True, cwd=workdir)


@pytest.fixture(scope="session")
def smoke(tmp_path_factory) -> Path:
    """configs/smoke.yaml run once, whole, for every workflow test module."""
    workdir = tmp_path_factory.mktemp("smoke")
    proc = snakemake(workdir, "--cores", "2", "--quiet")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return workdir


def graft_args(post: Path, donor: Path, tuned: Path, scale: str, out: Path) -> list[str]:
    """The arguments of `graftlab graft` for one graft, after the subcommand."""
    return [
        "--post",
        str(post),
        "--donor",
        str(donor),
        "--donor-tuned",
        str(tuned),
        "--scale",
        scale,
        "--out",
        str(out),
    ]
