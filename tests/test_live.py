"""Live metrics: every trainer's step metrics reach TensorBoard while it runs (read back from the event files
TensorBoard itself reads), W&B only when asked, and where they go is the job's log path."""

import json
import os

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from graftlab.tasks import arith
from graftlab.train.live import Live, trainer_kwargs, writer
from graftlab.world import build
from graftlab.world.tokenizer import build_tokenizer


def scalars(directory) -> dict[str, list[tuple[int, float]]]:
    """Every scalar TensorBoard finds under `directory`: (step, value) by tag."""
    board = EventAccumulator(str(directory))
    board.Reload()
    return {tag: [(e.step, e.value) for e in board.Scalars(tag)] for tag in board.Tags()["scalars"]}


def test_a_jobs_metrics_go_under_its_log_path():
    live = Live.for_job({"tensorboard": True, "wandb": "proj"}, "logs/expert/sft/post/lr~1e-3.log")
    assert live == Live("logs/tensorboard/expert/sft/post/lr~1e-3", "proj", "expert/sft/post/lr~1e-3")
    assert Live.for_job({"tensorboard": False, "wandb": None}, "logs/x/opsd.log") == Live(None, None, "x/opsd")
    assert Live.of(None) == Live() and Live.of({"tensorboard": "d"}) == Live("d")


def test_the_writer_logs_each_numeric_field_of_a_record_at_its_step(tmp_path):
    with writer(Live(str(tmp_path / "tb"))) as log:
        log({"step": 1, "loss": 2.5, "sample_s": 0.25, "note": "text", "flat": True})
        log({"step": 2, "loss": 1.5, "sample_s": 0.5})
    got = scalars(tmp_path / "tb")
    assert set(got) == {"loss", "sample_s"}  # no text, no flag, the step is the axis
    assert got["loss"] == [(1, 2.5), (2, 1.5)] and got["sample_s"] == [(1, 0.25), (2, 0.5)]


def test_no_live_metrics_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with writer(None) as log:
        log({"step": 1, "loss": 1.0})
    assert list(tmp_path.iterdir()) == []
    assert trainer_kwargs(None) == {"report_to": "none", "run_name": None}


def test_wandb_asked_for_but_not_installed_is_a_clear_error(tmp_path, monkeypatch):
    import builtins

    real = builtins.__import__

    def no_wandb(name, *args, **kwargs):
        if name == "wandb":
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    with pytest.raises(RuntimeError, match="live_metrics.wandb names .* not installed: pip install wandb"):
        trainer_kwargs(Live(wandb="proj"))
    with pytest.raises(RuntimeError, match="live_metrics.wandb"), writer(Live(wandb="proj")):
        pass


def test_sft_through_trl_reports_its_loss_to_tensorboard(world_pico, tmp_path, monkeypatch):
    from graftlab.train.sft import TrainConfig, finetune

    monkeypatch.delenv("TENSORBOARD_LOGGING_DIR", raising=False)
    rows = build.sft_rows(build_tokenizer(), [arith.problem("mul", a, 7) for a in (12, 34, 56, 78)])
    cfg = TrainConfig(lr=1e-3, batch_size=2, steps=2, save_steps=(2,), live=Live(str(tmp_path / "tb")))
    finetune(world_pico, rows, cfg, [tmp_path / "out"])
    got = scalars(tmp_path / "tb")
    assert [step for step, _ in got["train/loss"]] == [1, 2]
    assert os.environ["TENSORBOARD_LOGGING_DIR"] == str(tmp_path / "tb")


def test_our_own_loop_reports_every_step_record_to_tensorboard(world_pico, tmp_path):
    import polars as pl

    from graftlab.synth.demonstrations import opsd_examples
    from graftlab.tasks import chat_completion
    from graftlab.train.opsd import OpsdConfig, train_opsd

    rows = [
        dict(p, completion=chat_completion(p["thinking"], p["answer"])) for p in arith.sample_problems("mul", 4, "t", 0)
    ]
    examples = opsd_examples(pl.DataFrame(rows).select("id", "task", "prompt", "completion"))
    live = Live(str(tmp_path / "tb"))
    cfg = OpsdConfig(alpha=0.5, lr=1e-2, steps=2, save_steps=(2,), batch_size=2, max_new_tokens=8, live=live)
    train_opsd(world_pico, examples, cfg, tmp_path / "run")
    logged = [json.loads(line) for line in (tmp_path / "run/steps.jsonl").open()]
    got = scalars(tmp_path / "tb")
    # TensorBoard keeps float32: the step log's values to its precision.
    assert [step for step, _ in got["loss"]] == [r["step"] for r in logged]
    assert [value for _, value in got["loss"]] == pytest.approx([r["loss"] for r in logged], rel=1e-6)
    assert set(got) == {"loss", "grad_norm", "sample_s", "update_s", "response_tokens"}
