"""A run that diverges stops (issue 33, item 2; `graftlab.train.diverge`): in every trainer (SFT, GRPO and the
Pedagogical RL teacher through TRL; OPSD and SDPO, our own loops), the first optimizer step whose loss or
gradient is not finite ends the run with one GraftlabError naming the step, before the optimizer applies
it, and the run leaves nothing behind: no output, no step log, no work directory.

Each trainer runs two steps on the pico world model, as tests/test_clipping.py drives them. A learning rate
of 1e30 blows the weights up in the first step, so the second step's gradient is not finite (inf would make
them NaN, and our loops would then fail sampling before any loss). Poisons injected into the first step
reach each of the checks: a NaN gradient, a gradient whose norm overflows to inf though every entry is
finite (clipped to zero by the Trainer, so only its logged norm shows it), and a NaN loss over a finite
gradient."""

import itertools
import math

import polars as pl
import pytest
import torch
from conftest import mul_traces as traces
from torch.optim.optimizer import register_optimizer_step_pre_hook

from graftlab.errors import GraftlabError
from graftlab.tasks import TASKS, Task, arith

TRAINERS = ("sft", "grpo", "opsd", "sdpo", "teacher")
WHAT = {"sft": "SFT", "grpo": "GRPO", "opsd": "OPSD", "sdpo": "SDPO", "teacher": "Pedagogical RL teacher"}
HUGE = 1e30


@pytest.fixture
def applied():
    """The global L2 norm of the gradient at every optimizer step taken while the test runs."""
    norms = []

    def hook(optimizer, args, kwargs):
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        norms.append(float(torch.nn.utils.get_total_norm(grads)))

    handle = register_optimizer_step_pre_hook(hook)
    yield norms
    handle.remove()


def alternating(monkeypatch):
    """Problems of a task graded right and wrong in turn, so every group has both: RL's advantages and
    gradient are never zero, and every SDPO rollout has a successful sibling to learn from."""
    turn = itertools.count()
    task = Task("alternating", prompt=str, grade=lambda completion, answer: next(turn) % 2 == 0, reference=str)
    monkeypatch.setitem(TASKS, "alternating", task)
    return [{"prompt": f"{i}+{i}=", "answer": str(2 * i), "task": "alternating"} for i in range(4)]


def train(trainer: str, model, data, out, monkeypatch, lr: float, clip: float, resume=None) -> None:
    """Two steps of `trainer` from `model`, every file it writes under `out`; inputs under `data`."""
    if trainer == "sft":
        from graftlab.train.sft import TrainConfig, finetune
        from graftlab.world import build
        from graftlab.world.tokenizer import build_tokenizer

        rows = build.sft_rows(build_tokenizer(), [arith.problem("mul", a, 7) for a in (12, 34, 56, 78)])
        # No warmup: the first step takes the whole learning rate.
        cfg = TrainConfig(lr=lr, batch_size=2, steps=2, save_steps=(2,), warmup_ratio=0.0, max_grad_norm=clip)
        finetune(model, rows, cfg, [out / "model"], steps_out=out / "steps.jsonl", resume=resume)
    elif trainer == "grpo":
        from graftlab.train.grpo import GrpoConfig, train_grpo

        cfg = GrpoConfig(lr=lr, steps=2, batch_size=2, generations=2, max_new_tokens=6, max_grad_norm=clip)
        train_grpo(model, alternating(monkeypatch), cfg, out / "run", resume=resume)
    elif trainer == "opsd":
        from graftlab.synth.demonstrations import opsd_examples
        from graftlab.train.opsd import OpsdConfig, train_opsd

        examples = opsd_examples(pl.DataFrame(traces(2)).select("id", "task", "prompt", "completion"))
        cfg = OpsdConfig(alpha=0.5, lr=lr, steps=2, batch_size=2, max_new_tokens=6, max_grad_norm=clip)
        train_opsd(model, examples, cfg, out / "run", resume=resume)
    elif trainer == "sdpo":
        from graftlab.train.sdpo import SdpoConfig, train_sdpo

        cfg = SdpoConfig(lr=lr, steps=2, batch_size=2, generations=4, max_grad_norm=clip)
        train_sdpo(model, alternating(monkeypatch), cfg, out / "run", resume=resume)
    else:
        import graftlab.synth.pedagogical as pedagogical

        # A pico model never earns the teacher's reward (a verified, thinking trace): right and wrong in turn.
        def rewards(*args, **kwargs):
            def reward(prompts, completions, completion_ids, log_metric=None, **_):
                got = [float(i % 2) for i in range(len(completion_ids))]
                log_metric("pedagogical/reward", sum(got) / len(got))  # what marks a step's log line
                return got

            return reward

        monkeypatch.setattr(pedagogical, "make_reward_func", rewards)
        problems = data / "problems.parquet"
        pl.DataFrame(traces(4)).write_parquet(problems)
        cfg = pedagogical.TeacherConfig(
            lr=lr, steps=2, group_size=2, prompts_per_step=2, max_new_tokens=6, max_grad_norm=clip
        )
        pedagogical.train_teacher(
            model, problems, cfg, out / "teacher", out / "steps.jsonl", curves_out=out / "c.png", resume=resume
        )


def diverges(trainer, world_pico, tmp_path, monkeypatch, step: int, lr: float = 1e-3, clip: float = 1.0) -> str:
    """The one line a run of `trainer` stops with at optimizer `step`; asserted to leave nothing behind."""
    data, out = tmp_path / "data", tmp_path / "out"
    data.mkdir()
    out.mkdir()
    with pytest.raises(GraftlabError) as err:
        train(trainer, world_pico, data, out, monkeypatch, lr, clip)
    message = str(err.value)
    assert message.startswith(f"{WHAT[trainer]} diverged at step {step}: ")
    assert message.endswith("; no output written. Lower the learning rate or check the data")
    assert "\n" not in message
    assert list(out.iterdir()) == []  # the output, its step log and curves, and the work directory
    return message


@pytest.mark.parametrize("clip", [1.0, 0.0], ids=["clipped", "unclipped"])
@pytest.mark.parametrize("trainer", TRAINERS)
def test_a_huge_learning_rate_stops_every_trainer_at_its_second_step(
    trainer, clip, world_pico, tmp_path, monkeypatch, applied
):
    diverges(trainer, world_pico, tmp_path, monkeypatch, 2, lr=HUGE, clip=clip)
    # The first step was applied, the second refused before the optimizer could apply it.
    assert len(applied) == 1 and math.isfinite(applied[0])


def poison_gradient(monkeypatch, factor: float) -> None:
    """Every model a trainer loads has one parameter's gradient multiplied by `factor` in the backward."""
    from transformers import AutoModelForCausalLM

    load = AutoModelForCausalLM.from_pretrained

    def loaded(*args, **kwargs):
        model = load(*args, **kwargs)
        weight = model.get_output_embeddings().weight
        weight.register_hook(lambda grad: grad * factor)  # the frozen models (teachers, the student) run no backward
        return model

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", loaded)


def poison_loss(monkeypatch) -> None:
    """Every trainer's loss NaN, its gradient untouched: a NaN constant added to it."""
    from trl import GRPOTrainer, SFTTrainer

    import graftlab.train.divergence as divergence

    def plus_nan(compute):
        return lambda *args, **kwargs: compute(*args, **kwargs) + math.nan

    for trainer in (SFTTrainer, GRPOTrainer):
        monkeypatch.setattr(trainer, "compute_loss", plus_nan(trainer.compute_loss))
    for name in ("generalized_divergence", "token_divergence"):  # OPSD's loss; SDPO's per token
        monkeypatch.setattr(divergence, name, plus_nan(getattr(divergence, name)))


@pytest.mark.parametrize("trainer", TRAINERS)
def test_a_nan_gradient_with_a_finite_loss_stops_every_trainer_before_its_step(
    trainer, world_pico, tmp_path, monkeypatch, applied
):
    poison_gradient(monkeypatch, math.nan)
    message = diverges(trainer, world_pico, tmp_path, monkeypatch, 1)
    assert "loss nan" not in message and "gradient norm n" in message  # nan, or not finite
    assert applied == []


@pytest.mark.parametrize("trainer", TRAINERS)
def test_a_gradient_norm_overflowing_to_inf_stops_every_trainer(trainer, world_pico, tmp_path, monkeypatch, applied):
    poison_gradient(monkeypatch, 1e30)  # every entry finite (about 1e30), their squares' sum not
    message = diverges(trainer, world_pico, tmp_path, monkeypatch, 1)
    assert "gradient norm inf (before clipping)" in message
    # Clipped by that norm, the gradient is zero: the Trainers' one step moves nothing.
    assert all(norm == 0 for norm in applied)


@pytest.mark.parametrize("trainer", TRAINERS)
def test_a_nan_loss_with_a_finite_gradient_stops_every_trainer(trainer, world_pico, tmp_path, monkeypatch, applied):
    poison_loss(monkeypatch)
    message = diverges(trainer, world_pico, tmp_path, monkeypatch, 1)
    assert "loss nan" in message and "gradient norm nan" not in message
    assert all(math.isfinite(norm) for norm in applied)


@pytest.mark.parametrize("trainer", ["sft", "opsd"])
def test_a_rerun_from_the_resume_state_saved_before_the_divergence_diverges_there_again(
    trainer, world_pico, tmp_path, monkeypatch
):
    """The resume state saved after the first step stays (a rerun of the same configuration would train
    there again), holds no mark of ended training, and resuming from it diverges at the same step."""
    from graftlab.train.resume import TRAINED, Resume

    data, out, state = tmp_path / "data", tmp_path / "out", tmp_path / "resume"
    data.mkdir()
    out.mkdir()
    messages = []
    for _ in range(2):
        with pytest.raises(GraftlabError, match=f"^{WHAT[trainer]} diverged at step 2: ") as err:
            train(trainer, world_pico, data, out, monkeypatch, HUGE, 1.0, resume=Resume(state, 0))
        messages.append(str(err.value))
        assert list(out.iterdir()) == [] and not (state / TRAINED).exists()
        saved = {p.name for p in state.iterdir()}
        assert "checkpoint-1" in saved if trainer == "sft" else "state.pt" in saved
    assert messages[0] == messages[1]


def test_graftlab_sft_that_diverges_exits_with_one_line_and_no_output(world_pico, tmp_path, capsys, monkeypatch):
    from graftlab.commands.cli import main

    poison_gradient(monkeypatch, math.nan)  # a learning rate the flag allows (at most 1) need not diverge

    data, out = tmp_path / "sft.parquet", tmp_path / "donor"
    rows = traces(4)
    pl.DataFrame({"prompt": [r["prompt"] for r in rows], "completion": [r["completion"] for r in rows]}).write_parquet(
        data
    )
    argv = ["sft", "--model", str(world_pico), "--data", str(data), "--lr", "1e-3", "--steps", "3"]
    status = main([*argv, "--batch-size", "2", "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert status != 0
    assert err[-1].startswith("graftlab: error: SFT diverged at step 1: ")
    assert [line for line in err if line.startswith("graftlab:")] == err[-1:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sft.parquet"]
    assert not any("Traceback" in line for line in err)
