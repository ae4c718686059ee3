"""Gradient clipping in every trainer (SFT, GRPO and the Pedagogical RL teacher through TRL; OPSD and SDPO,
our own loops): each step log records the gradient's global norm before clipping, and a step whose norm
exceeds `max_grad_norm` reaches the optimizer with its norm clipped to it, as the official SDPO and OPSD code
(and TRL) do at 1.0.

Measured at the optimizer itself: a hook on every optimizer's step reads the gradient the update is about
to use. A run at `max_grad_norm: 0` (no clipping) shows the raw norm, which must be what the clipped run's
log reports for its first step (the same weights and batch), clipped at half of it."""

import json
import math

import polars as pl
import pytest
import torch
from conftest import mul_traces as traces
from torch.optim.optimizer import register_optimizer_step_pre_hook

from graftlab.tasks import TASKS, Task, arith


@pytest.fixture
def seen_norms():
    """The global L2 norm of the gradient at every optimizer step taken while the test runs."""
    norms = []

    def hook(optimizer, args, kwargs):
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        norms.append(float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(x) for x in grads]))))

    handle = register_optimizer_step_pre_hook(hook)
    yield norms
    handle.remove()


def coin(monkeypatch):
    """Problems of a task an untrained model passes about half the time, so rewards and siblings vary."""
    task = Task("coin", prompt=str, grade=lambda completion, answer: len(completion) % 2 == 0, reference=str)
    monkeypatch.setitem(TASKS, "coin", task)
    return [{"prompt": f"{i}+{i}=", "answer": str(2 * i), "task": "coin"} for i in range(4)]


def run_sft(model, tmp, clip, monkeypatch):
    from graftlab.train.sft import TrainConfig, finetune
    from graftlab.world import build
    from graftlab.world.tokenizer import build_tokenizer

    rows = build.sft_rows(build_tokenizer(), [arith.problem("mul", a, 7) for a in (12, 34, 56, 78)])
    cfg = TrainConfig(lr=1e-3, batch_size=2, steps=2, save_steps=(2,), max_grad_norm=clip)
    finetune(model, rows, cfg, [tmp / "out"], steps_out=tmp / "steps.jsonl")
    return [json.loads(line) for line in (tmp / "steps.jsonl").open()]


def run_grpo(model, tmp, clip, monkeypatch):
    from graftlab.train.grpo import GrpoConfig, train_grpo

    cfg = GrpoConfig(lr=1e-2, steps=2, batch_size=2, generations=2, max_new_tokens=6, max_grad_norm=clip)
    return train_grpo(model, coin(monkeypatch), cfg, tmp / "run")


def run_opsd(model, tmp, clip, monkeypatch):
    from graftlab.synth.demonstrations import opsd_examples
    from graftlab.train.opsd import OpsdConfig, train_opsd

    rows = traces(2)
    examples = opsd_examples(pl.DataFrame(rows).select("id", "task", "prompt", "completion"))
    cfg = OpsdConfig(alpha=0.5, lr=1e-2, steps=2, batch_size=2, max_new_tokens=6, max_grad_norm=clip)
    return train_opsd(model, examples, cfg, tmp / "run")


def run_sdpo(model, tmp, clip, monkeypatch):
    from graftlab.train.sdpo import SdpoConfig, train_sdpo

    cfg = SdpoConfig(lr=1e-2, steps=2, batch_size=2, generations=4, max_grad_norm=clip)
    return [s for s in train_sdpo(model, coin(monkeypatch), cfg, tmp / "run") if s["grad_norm"] is not None]


def run_teacher(model, tmp, clip, monkeypatch):
    import graftlab.synth.pedagogical as pedagogical
    from graftlab.synth.pedagogical import TeacherConfig, train_teacher

    # A pico model never earns the teacher's reward (a verified, thinking trace): rewards by parity instead,
    # so the advantages and the gradient are not zero. Clipping is the Trainer's, whatever the reward.
    def parity(*args, **kwargs):
        def reward(prompts, completions, completion_ids, log_metric=None, **_):
            rewards = [float(len(c) % 2) for c in completion_ids]
            log_metric("pedagogical/reward", sum(rewards) / len(rewards))  # what marks a step's log line
            return rewards

        return reward

    monkeypatch.setattr(pedagogical, "make_reward_func", parity)

    rows = traces(4)
    pl.DataFrame(rows).write_parquet(tmp / "problems.parquet")
    cfg = TeacherConfig(steps=2, group_size=2, prompts_per_step=2, max_new_tokens=6, max_grad_norm=clip)
    train_teacher(model, tmp / "problems.parquet", cfg, tmp / "teacher", tmp / "steps.jsonl", curves_out=tmp / "c.png")
    return [json.loads(line) for line in (tmp / "steps.jsonl").open()]


@pytest.mark.parametrize("trainer", [run_sft, run_grpo, run_opsd, run_sdpo, run_teacher])
def test_every_trainer_logs_the_norm_before_clipping_and_steps_on_the_clipped_gradient(
    trainer, world_pico, tmp_path, monkeypatch, seen_norms
):
    (tmp_path / "raw").mkdir()
    (tmp_path / "clipped").mkdir()
    raw_log = trainer(world_pico, tmp_path / "raw", 0.0, monkeypatch)
    raw = list(seen_norms)
    seen_norms.clear()
    # Unclipped, the optimizer sees the norm the log reports.
    assert raw and raw[0] > 0
    assert [s["grad_norm"] for s in raw_log] == pytest.approx(raw, rel=1e-4)
    limit = raw[0] / 2  # the first step, the same in both runs, is clipped
    log = trainer(world_pico, tmp_path / "clipped", limit, monkeypatch)
    # Clipped: the log reports the first step's norm before clipping, the unclipped run's; the optimizer sees
    # each step's norm scaled by torch's clip coefficient, min(1, limit / (norm + 1e-6)), as in HF's Trainer.
    assert len(seen_norms) == len(log) == len(raw_log)
    assert log[0]["grad_norm"] == pytest.approx(raw[0], rel=1e-4)
    clipped = [s["grad_norm"] * min(1.0, limit / (s["grad_norm"] + 1e-6)) for s in log]
    assert seen_norms == pytest.approx(clipped, rel=1e-4)
    assert seen_norms[0] < limit * (1 + 1e-4) < raw[0]
    assert all(math.isfinite(s["grad_norm"]) for s in raw_log + log)
