"""Resume after preemption: a trainer SIGKILLed mid-run and rerun continues from its saved step and ends
with the weights of a run never interrupted (CPU, fp32, one thread: bit for bit)."""

import json
import signal
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
from conftest import assert_same_weights

from graftlab.synth.demonstrations import opsd_examples
from graftlab.synth.traces import expert_traces
from graftlab.tasks import arith, chat_completion
from graftlab.train.opsd import OpsdConfig, train_opsd
from graftlab.train.resume import Resume
from graftlab.train.sft import TrainConfig, sft_epochs

SFT = dict(lr=1e-2, batch_size=8, epochs=2)  # 32 traces: 4 steps an epoch
OPSD = dict(alpha=0.5, lr=1e-2, steps=4, save_steps=[2, 4], batch_size=2, max_new_tokens=8)

# The job, run as its own process. It saves its state after every step (0 minutes) and SIGKILLs itself
# right after the save of step `kill_at` (-1: right after training is marked as ended, before the output
# is written): a preemption at a known point, with no cleanup of any kind.
JOB = """
import json, os, signal, sys
from pathlib import Path
from graftlab.train import resume as rs

kind, model, data, out, state_dir, cfg, kill_at = sys.argv[1:]
cfg, kill_at = json.loads(cfg), int(kill_at)

def saved(step):
    if step == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)

resume = rs.Resume(Path(state_dir), 0)
mark_trained = rs.mark_trained

def marked(r, record):
    mark_trained(r, record)
    saved(-1)

rs.mark_trained = marked
if kind == "sft":
    from graftlab.train import sft

    make = sft.trainer_callback

    def callback(r):
        cb = make(r)
        on_save = cb.on_save

        def save(args, state, control, **kw):
            on_save(args, state, control, **kw)
            saved(state.global_step)

        cb.on_save = save
        return cb

    sft.trainer_callback = callback
    sft.mark_trained = marked
    sft.sft_epochs(model, data, sft.TrainConfig(**cfg), Path(out), resume)
else:
    from graftlab.train import opsd

    save_state = rs.save_state

    def save(r, state):
        save_state(r, state)
        saved(state["step"])

    rs.save_state = save
    examples = json.loads(Path(data).read_text())
    opsd.train_opsd(model, examples, opsd.OpsdConfig(**cfg), out, resume=resume)
"""


@pytest.fixture(scope="module")
def model(world_pico) -> Path:
    return world_pico


def job(kind, model, data, out, state_dir, cfg, kill_at=0) -> subprocess.CompletedProcess:
    args = [kind, model, data, out, state_dir, json.dumps(cfg), str(kill_at)]
    return subprocess.run(
        [sys.executable, "-c", JOB, *map(str, args)], capture_output=True, text=True, timeout=120, check=False
    )


def sft_data(tmp_path: Path) -> Path:
    """32 expert traces of the tiny world's multiplication: 4 steps an epoch at SFT's batch of 8."""
    data = tmp_path / "sft.parquet"
    expert_traces(pl.DataFrame(arith.sample_problems("mul", 32, "test", 0)))[0].write_parquet(data)
    return data


def opsd_data(tmp_path: Path) -> tuple[list[dict], Path]:
    """OPSD's examples of 6 multiplication traces, and the JSON file the job reads them from."""
    rows = [
        dict(p, completion=chat_completion(p["thinking"], p["answer"]))
        for p in arith.sample_problems("mul", 6, "test", 0)
    ]
    examples = opsd_examples(pl.DataFrame(rows).select("id", "task", "prompt", "completion"))
    data = tmp_path / "examples.json"
    data.write_text(json.dumps(examples))
    return examples, data


def killed_and_rerun(kind, model, data, out, state_dir, cfg, kill_at) -> str:
    """The rerun's output, after checking that the first run died by SIGKILL leaving its state behind."""
    first = job(kind, model, data, out, state_dir, cfg, kill_at)
    assert first.returncode == -signal.SIGKILL, first.stderr[-3000:]
    assert not out.exists() and state_dir.is_dir()
    rerun = job(kind, model, data, out, state_dir, cfg)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert not state_dir.exists(), "a finished job leaves no resume state"
    return rerun.stdout + rerun.stderr


@pytest.mark.workflow  # a real process killed, or several at once: the slow tier
def test_sft_killed_mid_epoch_resumes_at_the_saved_step_and_ends_with_the_same_weights(model, tmp_path):
    data = sft_data(tmp_path)
    sft_epochs(model, data, TrainConfig(**SFT), tmp_path / "reference")

    log = killed_and_rerun("sft", model, data, tmp_path / "run", tmp_path / "resume" / "run", SFT, kill_at=3)
    assert f"resume: continuing from {tmp_path / 'resume' / 'run' / 'checkpoint-3'}" in log
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["epoch~1", "epoch~2", "steps.jsonl", "training.png"]
    steps = [json.loads(line) for line in (tmp_path / "run" / "steps.jsonl").open()]
    assert [s["step"] for s in steps] == list(range(1, 9)) and [s["epoch"] for s in steps] == [1] * 4 + [2] * 4
    # Each step's loss, those before the kill from the kept records: the uninterrupted run's, bit for bit.
    reference = [json.loads(line) for line in (tmp_path / "reference" / "steps.jsonl").open()]
    assert [s["loss"] for s in steps] == [s["loss"] for s in reference]
    for epoch in ("epoch~1", "epoch~2"):
        assert_same_weights(tmp_path / "reference" / epoch, tmp_path / "run" / epoch)
        assert not (tmp_path / "run" / epoch / "optimizer.pt").exists()


@pytest.mark.workflow  # a real process killed, or several at once: the slow tier
def test_opsd_killed_mid_run_resumes_at_the_saved_step_and_ends_with_the_same_weights(model, tmp_path):
    examples, data = opsd_data(tmp_path)
    cfg = OpsdConfig(**(OPSD | {"save_steps": tuple(OPSD["save_steps"])}))
    reference = train_opsd(model, examples, cfg, tmp_path / "reference")

    log = killed_and_rerun("opsd", model, data, tmp_path / "run", tmp_path / "resume" / "run", OPSD, kill_at=2)
    assert "resume: OPSD continues after step 2" in log
    assert {p.name for p in (tmp_path / "run").iterdir()} == {"step~2", "step~4", "steps.jsonl", "training.png"}
    steps = [json.loads(line) for line in (tmp_path / "run" / "steps.jsonl").open()]
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    assert [s["loss"] for s in steps] == [r["loss"] for r in reference]
    for step in ("step~2", "step~4"):
        assert_same_weights(tmp_path / "reference" / step, tmp_path / "run" / step)


@pytest.mark.workflow  # a real process killed, or several at once: the slow tier
def test_a_kill_after_training_ends_reruns_only_the_writing_of_the_output(model, tmp_path):
    """Killed between the end of training and its output: the rerun trains nothing and writes the
    output from the resume directory, whose checkpoints the first run left whole."""
    data = sft_data(tmp_path)
    sft_epochs(model, data, TrainConfig(**SFT), tmp_path / "reference")
    log = killed_and_rerun("sft", model, data, tmp_path / "run", tmp_path / "resume" / "run", SFT, kill_at=-1)
    assert "resume: training had ended" in log and "resume: continuing from" not in log
    for epoch in ("epoch~1", "epoch~2"):
        assert_same_weights(tmp_path / "reference" / epoch, tmp_path / "run" / epoch)
        assert not (tmp_path / "run" / epoch / "optimizer.pt").exists()
    assert (tmp_path / "run" / "steps.jsonl").read_text().count("\n") == 8
    assert (tmp_path / "run" / "training.png").is_file()


@pytest.mark.workflow  # a real process killed, or several at once: the slow tier
def test_opsd_killed_after_training_writes_its_output_without_training(model, tmp_path):
    examples, data = opsd_data(tmp_path)
    reference = train_opsd(model, examples, OpsdConfig(**(OPSD | {"save_steps": (2, 4)})), tmp_path / "reference")
    log = killed_and_rerun("opsd", model, data, tmp_path / "run", tmp_path / "resume" / "run", OPSD, kill_at=-1)
    assert "resume: training had ended" in log and '"step": 1' not in log
    steps = [json.loads(line) for line in (tmp_path / "run" / "steps.jsonl").open()]
    assert [s["loss"] for s in steps] == [r["loss"] for r in reference]
    for step in ("step~2", "step~4"):
        assert_same_weights(tmp_path / "reference" / step, tmp_path / "run" / step)


def test_a_state_written_for_another_configuration_is_discarded(tmp_path):
    resume = Resume(tmp_path / "r", 30)
    resume.open({"lr": 1e-3})
    (resume.dir / "state.pt").write_text("x")
    resume.open({"lr": 1e-3})
    assert (resume.dir / "state.pt").exists()
    resume.open({"lr": 2e-3})
    assert not (resume.dir / "state.pt").exists()
    assert not resume.due() and Resume(tmp_path / "r", 0).due()


class Preempted(Exception):
    pass


def test_the_pedagogical_teacher_resumes_from_its_trainer_checkpoint_with_the_same_weights(
    model, tmp_path, monkeypatch, capsys
):
    import graftlab.synth.pedagogical as ped
    import graftlab.tasks as tasks
    from graftlab.train import resume as rs

    # As in test_pedagogical: every answer passes, so learnability alone drives GRPO's update.
    always = tasks.Task("always", prompt=str, grade=lambda completion, answer: True, reference=str)
    monkeypatch.setattr(tasks, "get_task", lambda name: always)
    monkeypatch.setattr(ped, "well_formed", lambda completion, tokens, min_tokens: True)
    pl.DataFrame(arith.sample_problems("mul", 4, "test", 0)).write_parquet(tmp_path / "train.parquet")
    cfg = ped.TeacherConfig(group_size=2, prompts_per_step=2, steps=3, lr=1e-3, max_new_tokens=8)
    make = rs.trainer_callback

    def failing(resume):
        cb = make(resume)
        on_save = cb.on_save

        def save(args, state, control, **kw):
            on_save(args, state, control, **kw)
            if state.global_step == 2:
                raise Preempted

        cb.on_save = save
        return cb

    ped.train_teacher(model, tmp_path / "train.parquet", cfg, tmp_path / "reference", tmp_path / "reference.jsonl")
    args = (model, tmp_path / "train.parquet", cfg, tmp_path / "teacher", tmp_path / "log.jsonl")
    state = tmp_path / "resume" / "teacher"
    monkeypatch.setattr(rs, "trainer_callback", failing)
    with pytest.raises(Preempted):
        ped.train_teacher(*args, resume=Resume(state, 0))
    assert not (tmp_path / "teacher").exists() and (state / "checkpoint-2" / "optimizer.pt").exists()
    monkeypatch.setattr(rs, "trainer_callback", make)
    capsys.readouterr()
    ped.train_teacher(*args, resume=Resume(state, 0))
    assert f"resume: continuing from {state / 'checkpoint-2'}" in capsys.readouterr().out
    steps = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3] and not state.exists()
    # The resumed teacher ends where the uninterrupted one did, bit for bit.
    assert_same_weights(tmp_path / "reference", tmp_path / "teacher")
