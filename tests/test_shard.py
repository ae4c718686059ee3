"""Our own on-policy loops sharded over processes (graftlab.train.shard): two CPU processes over gloo, each
holding half of every weight, train as one process does on whole batches, and write the run once."""

import functools
import json
import os
import pickle
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import assert_same_weights, model_weights

from graftlab.errors import GraftlabError
from graftlab.tasks import arith, chat_completion
from graftlab.train.onpolicy import OnPolicyRun
from graftlab.train.opsd import OpsdConfig, train_opsd
from graftlab.train.resume import STATE, Resume
from graftlab.train.sdpo import Sdpo, SdpoConfig

pytestmark = pytest.mark.workflow  # several real processes at once: the slow tier


@pytest.fixture
def post(world_pico):
    """The post model: a decoder layer (an FSDP unit) and the root unit (embedding, norm, head)."""
    return world_pico


@pytest.fixture(autouse=True)
def importable_here(monkeypatch):
    """The launched processes unpickle this module's `ScriptedSdpo`: they find it as pytest did."""
    here = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def problems(count: int) -> list[dict]:
    return [dict(p, task="arith") for p in arith.sample_problems("mul", count, "test", 0)]


def test_opsd_over_two_processes_samples_through_the_sharded_student_and_trains_as_one(post, tmp_path):
    """Near-greedy sampling (OPSD's temperature must be positive) through `generate` on the sharded student,
    each process its half of the batch, then the pooled loss of both halves: the same checkpoints as one
    process on whole batches, and the same step log."""
    examples = [{"prompt": p["prompt"], "demonstration": p["answer"]} for p in problems(8)]
    cfg = OpsdConfig(
        alpha=0.5, lr=1e-2, steps=2, save_steps=(1, 2), batch_size=4, max_new_tokens=6, temperature=1e-4, threads=1
    )
    one = train_opsd(post, examples, cfg, tmp_path / "one")
    two = train_opsd(post, examples, cfg, tmp_path / "two", processes=2)
    for step in (1, 2):
        assert_same_weights(tmp_path / f"one/step~{step}", tmp_path / f"two/step~{step}", atol=1e-5)
    assert [r["response_tokens"] for r in one] == [r["response_tokens"] for r in two]
    assert [r["loss"] for r in one] == pytest.approx([r["loss"] for r in two], rel=1e-5)
    assert [json.loads(line) for line in (tmp_path / "two/steps.jsonl").open()] == two
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one", "two"]  # no scratch left behind


def test_a_sharded_run_killed_mid_way_resumes_with_its_processes_to_the_same_weights(post, tmp_path, capfd):
    """The whole state is gathered and saved by the first process after every step (resume_minutes 0); the
    job, killed with all its processes once a state is saved, reruns from it over two processes again and
    ends on the uninterrupted run's checkpoints."""
    examples = [{"prompt": p["prompt"], "demonstration": p["answer"]} for p in problems(8)]
    cfg = OpsdConfig(
        alpha=0.5, lr=1e-2, steps=12, save_steps=(6, 12), batch_size=4, max_new_tokens=8, temperature=1e-4, threads=1
    )
    train_opsd(post, examples, cfg, tmp_path / "whole", processes=2)
    state = tmp_path / "resume" / "run"
    spec = tmp_path / "job.pkl"
    spec.write_bytes(pickle.dumps((post, examples, cfg, tmp_path / "run", None, Resume(state, 0), 2)))
    code = "import pickle, sys\nfrom graftlab.train.opsd import train_opsd\n"
    code += "train_opsd(*pickle.load(open(sys.argv[1], 'rb')))"
    job = subprocess.Popen([sys.executable, "-c", code, str(spec)], start_new_session=True)
    while not (state / STATE).exists() and job.poll() is None:
        time.sleep(0.02)
    os.killpg(job.pid, signal.SIGKILL)
    job.wait()
    assert job.returncode == -signal.SIGKILL and not (tmp_path / "run").exists()
    capfd.readouterr()
    log = train_opsd(post, examples, cfg, tmp_path / "run", resume=Resume(state, 0), processes=2)
    resumed = re.search(r"resume: OPSD continues after step (\d+)", capfd.readouterr().out)
    assert resumed and 1 <= int(resumed[1]) < 12
    for step in (6, 12):
        assert_same_weights(tmp_path / f"whole/step~{step}", tmp_path / f"run/step~{step}", atol=1e-6)
    assert [r["step"] for r in log] == list(range(1, 13)) and not state.exists()


ANSWER = "42"


class ScriptedSdpo(Sdpo):
    """SDPO whose rollouts are fixed per problem (the same whichever process samples it): the first two
    of each group answer right, the others wrong, so every rollout has a successful sibling to learn from;
    with `only` set, only that problem's group has right answers. What is tested is the sharded update, the
    moving teacher and the record, not sampling."""

    only: str | None = None

    @functools.cached_property
    def sampler(self):
        tok, generations, only = self.tok, self.cfg.generations, self.only

        class Fixed:
            backend = "transformers"

            def sample_ids(self, prompts, scfg):
                out = []
                for prompt in prompts:
                    ids = tok(prompt, add_special_tokens=False)["input_ids"]
                    right = 2 if only is None or only in prompt else 0
                    texts = [chat_completion("x", ANSWER if i < right else f"{i}{ANSWER}") for i in range(generations)]
                    out.append([(ids, tok(t, add_special_tokens=False)["input_ids"]) for t in texts])
                return out

        return Fixed()


class OneRightSdpo(ScriptedSdpo):
    only = problems(4)[0]["prompt"]


def test_sdpo_over_two_processes_when_one_has_nothing_to_distil_trains_as_one(post, tmp_path):
    """One problem alone has right answers: in its batch one process distils and the other, whose group has
    no successful rollout, has nothing to; it still meets the first's teacher forward and backward (FSDP's
    collectives would hang otherwise), and the run equals one process's."""
    data = [dict(p, answer=ANSWER) for p in problems(4)]
    cfg = SdpoConfig(lr=1e-2, steps=2, batch_size=2, generations=4, updates_per_batch=1, threads=1)

    def run(out: Path, processes: int) -> list[dict]:
        start = functools.partial(OneRightSdpo.start, cfg=cfg, problems=data, post_dir=post)
        return OnPolicyRun("SDPO", "problems", post, cfg, start).train(data, out, None, None, {}, processes=processes)

    one, two = run(tmp_path / "one", 1), run(tmp_path / "two", 2)
    assert_same_weights(tmp_path / "one/step~2", tmp_path / "two/step~2", atol=1e-5)
    assert sorted(r["accuracy"] for r in one) == [0.0, 0.25]  # one batch distils, from one problem of two
    assert [r["distilled_tokens"] for r in one] == [r["distilled_tokens"] for r in two]


def test_sdpo_over_two_processes_with_a_moving_teacher_trains_as_one(post, tmp_path):
    """Two updates on each sampled batch (the importance weight on the second), an EMA teacher kept for a
    next stage: the same student, teacher and step records from two sharded processes as from one."""
    data = [dict(p, answer=ANSWER) for p in problems(4)]
    cfg = SdpoConfig(
        lr=1e-2, steps=4, save_steps=(2, 4), batch_size=2, generations=4, updates_per_batch=2, teacher="ema:0.5"
    )
    cfg = SdpoConfig(**(vars(cfg) | {"threads": 1}))

    def run(out: Path, processes: int) -> list[dict]:
        start = functools.partial(ScriptedSdpo.start, cfg=cfg, problems=data, post_dir=post, keep_teacher=True)
        trainer = OnPolicyRun("SDPO", "problems", post, cfg, start, frozen_teacher=False)
        return trainer.train(data, out, None, None, {}, extras=("teacher",), processes=processes)

    one, two = run(tmp_path / "one", 1), run(tmp_path / "two", 2)
    for name in ("step~2", "step~4", "teacher"):
        assert_same_weights(tmp_path / "one" / name, tmp_path / "two" / name, atol=1e-5)
    moved = model_weights(tmp_path / "one/teacher")["model.norm.weight"]
    assert not torch.allclose(moved, model_weights(post)["model.norm.weight"])
    timing = ("sample_s", "update_s")
    for a, b in zip(one, two, strict=True):
        assert {k: v for k, v in a.items() if k not in timing} == pytest.approx(
            {k: v for k, v in b.items() if k not in timing}, rel=1e-5, abs=1e-7
        )
    assert one[0]["accuracy"] == 0.5 and one[0]["distilled_tokens"] > 0


def test_a_batch_that_does_not_split_over_the_processes_is_refused_in_one_line(post, tmp_path):
    examples = [{"prompt": p["prompt"], "demonstration": p["answer"]} for p in problems(6)]
    cfg = OpsdConfig(alpha=0.5, lr=1e-2, steps=1, batch_size=3, max_new_tokens=4, threads=1)
    with pytest.raises(GraftlabError, match=r"^OPSD: the problems of a batch: 3 do not split over 2 processes$"):
        train_opsd(post, examples, cfg, tmp_path / "odd", processes=2)
    assert not (tmp_path / "odd").exists()


# GRPO: TRL's trainer under accelerate over two processes (on a host without CUDA accelerate runs the FSDP
# config as data parallel over gloo), each sampling and training on its half of every batch.
# Std-scaled advantages (not the default): a group split across processes must be scaled by its whole std.
GRPO = dict(lr=1e-2, steps=1, batch_size=3, generations=4, max_new_tokens=8, seed=1, threads=1, scale_rewards=True)


def parity(turn, answer):
    # About half the samples of a random model: the groups' rewards mix, so there is something to learn.
    return sum(map(ord, turn)) % 2 == 0


def _grpo_trained_by_parity(post, cfg, out: Path) -> None:
    """One process of a launched GRPO step rewarded by `parity`: the first leaves what its clock recorded and
    the Trainer's log in `out`."""
    from graftlab import tasks
    from graftlab.train.grpo import make_trainer
    from graftlab.train.shard import world

    tasks.get_task = lambda name: tasks.Task("fake", prompt=str, grade=parity, reference=str)
    trainer = make_trainer(post, problems(4), cfg, out / f"trainer-{world()[0]}")
    trainer.train()
    if world()[0] == 0:
        run = {"batches": trainer.clock.batches, "log": trainer.state.log_history}
        out.joinpath("run.json").write_text(json.dumps(run))


def test_grpo_over_two_processes_groups_and_pools_the_whole_batch(post, tmp_path, capfd):
    """12 completions, 6 a process: the middle group spans both. Advantages are of whole groups, in TRL's
    order, and the logged loss pools every response token of both halves, -sum A_i n_i / sum n_i, as one
    process's does (tests/test_grpo.py): the normalisation each process's gradient is averaged under."""
    from graftlab.train.grpo import GrpoConfig
    from graftlab.train.shard import FSDP_CONFIG, launch

    launch(2, _grpo_trained_by_parity, post, GrpoConfig(**GRPO), tmp_path, accelerate=FSDP_CONFIG)
    assert capfd.readouterr().out.count("update(s) of 12 = 6 x 1 accumulated x 2 processes") == 2
    run = json.loads((tmp_path / "run.json").read_text())
    [batch] = run["batches"]
    rewards = torch.tensor(batch["rewards"], dtype=torch.float64).view(3, 4)
    assert 0 < rewards[1].sum() < 4  # the group split between the processes has mixed rewards
    centred = rewards - rewards.mean(1, keepdim=True)
    assert batch["advantages"] == pytest.approx((centred / (rewards.std(1, keepdim=True) + 1e-4)).view(-1).tolist())
    adv, tokens = torch.tensor(batch["advantages"], dtype=torch.float64), torch.tensor(batch["tokens"])
    [row] = [h for h in run["log"] if "grpo/sample_s" in h]
    assert row["loss"] == pytest.approx(-(adv * tokens).sum().item() / tokens.sum().item(), rel=1e-4, abs=1e-6)
    assert row["grpo/response_tokens"] == tokens.sum().item() and row["grpo/reward"] == rewards.mean().item()


def test_grpo_over_two_processes_writes_the_run_once(post, tmp_path):
    """The workflow's call: the first process gathers and writes each kept checkpoint, the job publishes the
    step log of whole batches, and no scratch is left."""
    from graftlab.train.grpo import GrpoConfig, train_grpo

    cfg = GrpoConfig(**(GRPO | {"steps": 2, "save_steps": (1, 2), "batch_size": 2}))
    rows = [dict(p, task="mul") for p in problems(4)]
    log = train_grpo(post, rows, cfg, tmp_path / "run", processes=2)
    for step in (1, 2):
        assert model_weights(tmp_path / f"run/step~{step}").keys() == model_weights(post).keys()
    assert [r["step"] for r in log] == [1, 2]
    assert [json.loads(line) for line in (tmp_path / "run/steps.jsonl").open()] == log
    assert all(r["response_tokens"] / r["response_len"] == pytest.approx(8) for r in log)  # all 8 completions
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_a_refusal_inside_the_processes_is_the_launchs_own_line():
    """A process that refuses (a divergence, bad data) hands its message to `launch`, which raises it: the
    job's one line names what was wrong, not only that the processes failed."""
    from graftlab.io.gates import number
    from graftlab.train.shard import launch

    with pytest.raises(GraftlabError, match=r"^the value must be finite, got 'nan'$"):
        launch(2, number, "nan", "the value")
