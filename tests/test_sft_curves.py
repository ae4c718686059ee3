"""SFT's training curves: every optimizer step's loss in `steps.jsonl`, equal to the mean token
cross-entropy on the completions computed by hand from the weights the step started from, and drawn
with the run's other metrics as `training.png`."""

import json
import math

import polars as pl
import pytest
import torch
from PIL import Image
from transformers import AutoModelForCausalLM, AutoTokenizer

from graftlab.tasks import arith, chat_completion
from graftlab.train.sft import TrainConfig, encode_traces, sft_epochs

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "sft.parquet"
    problems = arith.sample_problems("mul", 12, "test", 0)
    completions = [chat_completion(p["thinking"], p["answer"]) for p in problems]
    pl.DataFrame({"prompt": [p["prompt"] for p in problems], "completion": completions}).write_parquet(path)
    return path


def completion_cross_entropy(model_dir, rows) -> float:
    """Mean over every completion token of every row of -log p(token | the tokens before it), one
    unpadded forward pass per row, in float64: what SFT's loss is on a batch of these rows."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for row in rows:
            ids = torch.tensor([row["input_ids"]])
            logp = model(input_ids=ids).logits[0].double().log_softmax(-1)
            for t in range(1, len(row["input_ids"])):
                if row["completion_mask"][t]:
                    total -= logp[t - 1, row["input_ids"][t]].item()
                    count += 1
    return total / count


def test_sft_logs_each_steps_loss_as_the_cross_entropy_of_the_weights_it_started_from(world_pico, traces, tmp_path):
    # The whole data set is one step's batch, in two micro-batches of 6: step k's batch is every trace
    # whatever the order, and its loss is the token-mean cross-entropy of the weights after step k - 1,
    # which are the initial model and the checkpoints epoch~1, epoch~2 (no warm-up: a first step at lr 0
    # would leave epoch~1 the initial model).
    cfg = TrainConfig(lr=1e-2, batch_size=12, micro_batch_size=6, epochs=3, warmup_ratio=0.0)
    sft_epochs(world_pico, traces, cfg, tmp_path / "run")
    run = tmp_path / "run"
    assert sorted(p.name for p in run.iterdir()) == ["epoch~1", "epoch~2", "epoch~3", "steps.jsonl", "training.png"]
    steps = [json.loads(line) for line in (run / "steps.jsonl").open()]
    assert [s["step"] for s in steps] == [1, 2, 3] and [s["epoch"] for s in steps] == [1, 2, 3]
    assert all({"sample_s", "update_s"} <= s.keys() for s in steps)
    assert all(isinstance(s["loss"], float) and math.isfinite(s["loss"]) for s in steps)

    traces_df = pl.read_parquet(traces)
    rows = encode_traces(AutoTokenizer.from_pretrained(world_pico), traces_df["prompt"], traces_df["completion"])
    for step, start in zip(steps, [world_pico, run / "epoch~1", run / "epoch~2"]):
        assert step["loss"] == pytest.approx(completion_cross_entropy(start, rows), rel=1e-5)
    assert steps[0]["loss"] > steps[1]["loss"] > steps[2]["loss"]  # lr 1e-2 on one batch: it fits

    png = (run / "training.png").read_bytes()
    assert png.startswith(PNG)
    with Image.open(run / "training.png") as image:
        image.verify()
    with Image.open(run / "training.png") as image:
        assert image.format == "PNG" and min(image.size) > 100


def test_a_step_log_of_many_steps_has_a_loss_on_every_one(world_pico, traces, tmp_path):
    # Logged every step, not every tenth: 12 traces / 2 a step x 2 epochs = 12 steps.
    sft_epochs(world_pico, traces, TrainConfig(lr=1e-3, batch_size=2, epochs=2), tmp_path / "run")
    steps = [json.loads(line) for line in (tmp_path / "run" / "steps.jsonl").open()]
    assert [s["step"] for s in steps] == list(range(1, 13))
    assert all(math.isfinite(s["loss"]) and s["loss"] > 0 for s in steps)
    assert len({s["loss"] for s in steps}) > 1  # each its own step's, not one running mean repeated


def test_the_pedagogical_teachers_step_log_is_drawn_with_its_loss_reward_and_entropy(tmp_path, monkeypatch):
    import graftlab.tasks as tasks
    from graftlab.synth import pedagogical as ped
    from graftlab.world import build
    from graftlab.world.tokenizer import build_tokenizer

    # As tests/test_pedagogical.py trains it: every trace correct and well formed, so learnability varies
    # within groups and the reward is not all 0.
    always = tasks.Task("always", prompt=str, grade=lambda completion, answer: True, reference=str)
    monkeypatch.setattr(tasks, "get_task", lambda name: always)
    monkeypatch.setattr(ped, "well_formed", lambda completion, tokens, min_tokens: True)
    tok = build_tokenizer()
    arch = dict(hidden_size=16, intermediate_size=32, layers=1, heads=2, kv_heads=1, max_positions=128)
    build.init_model(tok, arch, seed=0).save_pretrained(tmp_path / "post")
    tok.save_pretrained(tmp_path / "post")
    pl.DataFrame(arith.sample_problems("mul", 4, "test", 0)).write_parquet(tmp_path / "train.parquet")
    cfg = ped.TeacherConfig(group_size=2, prompts_per_step=2, steps=2, lr=1e-3, max_new_tokens=8)
    out = tmp_path / "teacher"
    ped.train_teacher(
        tmp_path / "post",
        tmp_path / "train.parquet",
        cfg,
        out,
        tmp_path / "steps.jsonl",
        curves_out=tmp_path / "training.png",
    )
    steps = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    assert all(math.isfinite(s[k]) for s in steps for k in ("loss", "reward", "entropy"))
    assert (tmp_path / "training.png").read_bytes().startswith(PNG)
