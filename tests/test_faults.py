"""Kill -9 at every stage (issue 18): a graft, an SFT, a Fisher, an evaluation and the `snakemake` process
itself are SIGKILLed in the middle of their work; nothing under the output's final name looks finished
(or the old output stays whole), and the rerun ends with what an uninterrupted run writes.

Each job runs as its own process and is caught mid-way by what it has written, not by a sleep: the test
polls for a sign of work in progress (a temporary sibling, a checkpoint, a progress bar, a first record),
then stops the process group, checks that the sign still holds and the output is still absent, and kills
it. Outputs are compared file by file, tensors bit for bit; the only fields left out are times and the
commit (`VOLATILE`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import polars as pl
import pytest
import torch
from conftest import WHOLE_RUN, dead_pid, graft_args, snakemake, snakemake_cmd
from safetensors.torch import load_file

from graftlab.commands import cli
from graftlab.evaluate.run import Benchmark, evaluate
from graftlab.io.atomic import HOST
from graftlab.sampling import SamplingConfig
from graftlab.synth.traces import expert_traces
from graftlab.tasks import arith

GRAFTLAB = [sys.executable, "-m", "graftlab"]
# Fields no rerun reproduces: wall-clock times (the provenance file's time of creation, SFT's seconds per
# step, the Fisher's seconds) and the checkout's HEAD commit in the provenance file, which moves when a
# commit of other files lands between two runs of the same code (the reference may be minutes older).
VOLATILE = {
    "graftlab.json": {"created_utc", "git_revision"},
    "steps.jsonl": {"update_s"},
    "seconds.json": {"fisher_s"},
}
# Drawings of a log whose timing panels no rerun reproduces (training.png: every field of steps.jsonl):
# the log itself is compared, without its times.
DRAWN = {"training.png"}
# The poll's pause: at least POLL_S, and at least POLL_COST times the check's own CPU time, so a costly check
# (a recursive glob, a growing log read) takes at most a fifth of a core from the job under test. CPU time, not
# wall: a check the busy machine descheduled costs no more, and must not stretch the pause past a short window.
POLL_S = 0.002
POLL_COST = 4
TIMEOUT_S = 300


def kill_mid_way(cmd: list[str], mid_way: Callable[[], bool], cwd: Path, log: Path) -> None:
    """Run `cmd` until `mid_way()` holds, then SIGKILL its whole process group. The group is stopped
    first and `mid_way()` checked again, so the kill provably lands while the work is in progress."""
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    caught = False
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            checked = time.thread_time()
            if mid_way():
                break
            assert proc.poll() is None, f"the job ended before it was caught mid-way:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"the job never got mid-way:\n{log.read_text()[-3000:]}"
            time.sleep(max(POLL_S, POLL_COST * (time.thread_time() - checked)))
        os.killpg(proc.pid, signal.SIGSTOP)
        caught = proc.poll() is None and mid_way()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert caught, f"the job finished between the poll and the stop (log: {log}): size its input up"
    assert proc.returncode == -signal.SIGKILL


def reference(argv: list[str]) -> None:
    """An uninterrupted `graftlab` run, in this process: the same code as the job, without its start-up."""
    assert cli.main(argv) == 0


def run(cmd: list[str], cwd: Path) -> str:
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout + done.stderr


def leftovers(directory: Path) -> list[str]:
    """Temporary siblings of killed writers (atomic.py's `.NAME.tmp-HOST-PID`, `.NAME.old-HOST-PID`)."""
    return sorted(p.name for p in directory.rglob(f".*.*-{HOST}-*"))


def _content(path: Path):
    """What a file says, for comparing two runs: tensors, rows or records without VOLATILE fields."""
    drop = VOLATILE.get(path.name, set())
    if path.name in DRAWN:
        return None
    if path.suffix == ".safetensors":
        return load_file(path)
    if path.suffix == ".parquet":
        return pl.read_parquet(path)
    if path.suffix == ".json":
        return {k: v for k, v in json.loads(path.read_text()).items() if k not in drop}
    if path.suffix == ".jsonl":
        return [{k: v for k, v in json.loads(line).items() if k not in drop} for line in path.open()]
    return path.read_bytes()


def _same(a, b) -> bool:
    if isinstance(a, dict) and a and all(isinstance(v, torch.Tensor) for v in a.values()):
        return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    if isinstance(a, pl.DataFrame):
        return a.equals(b)
    return a == b


def assert_same_output(a: Path, b: Path) -> None:
    """`a` and `b` (files or directory trees) hold the same files with the same content."""
    files = {p.relative_to(a) for p in a.rglob("*") if p.is_file()} if a.is_dir() else {Path()}
    other = {p.relative_to(b) for p in b.rglob("*") if p.is_file()} if b.is_dir() else {Path()}
    assert files == other, f"{a} and {b} hold different files: {sorted(map(str, files ^ other))}"
    differ = [str(f) for f in sorted(files) if not _same(_content(a / f), _content(b / f))]
    assert not differ, f"{a} and {b} differ in {differ}"


# Big enough that writing the graft takes a good part of a second (8.4M parameters, 34 MB a model).
GRAFT_MODEL = dict(vocab_size=32000, hidden_size=128, intermediate_size=256)


def test_graft_killed_mid_write_leaves_the_old_output_and_the_rerun_writes_the_uninterrupted_one(pico_model, tmp_path):
    post = pico_model("post", seed=0, **GRAFT_MODEL)
    donor = pico_model("donor", seed=1, **GRAFT_MODEL)
    tuned = pico_model("tuned", base=donor, noise=0.01)
    runs = tmp_path / "runs"
    runs.mkdir()
    out, expected = runs / "graft", runs / "expected"
    reference(["graft", *graft_args(post, donor, tuned, "1", expected)])
    # A finished graft at another scale is being replaced, as a hand sweep rewrites its output.
    reference(["graft", *graft_args(post, donor, tuned, "0.5", out)])
    old = {f.name: f.read_bytes() for f in out.iterdir()}

    # Blocks of 1 MiB make the write last longer; the result is the default's (compared below).
    cmd = GRAFTLAB + ["graft", *graft_args(post, donor, tuned, "1", out), "--chunk-mb", "1"]
    kill_mid_way(cmd, lambda: bool(leftovers(runs)), tmp_path, tmp_path / "killed.log")
    assert {f.name: f.read_bytes() for f in out.iterdir()} == old, "the killed graft touched the old output"
    killed = leftovers(runs)
    assert killed, "the kill left its temporary sibling (what the rerun must clear)"
    # Copies the rerun cannot know dead: a live process's on this host (this one), another host's (whose pid
    # is dead here: only the host tells them apart).
    alive, elsewhere = runs / f".graft.tmp-{HOST}-{os.getpid()}", runs / f".graft.tmp-another-host-{dead_pid()}"
    alive.mkdir()
    elsewhere.mkdir()

    run(cmd, tmp_path)
    assert_same_output(out, expected)
    assert leftovers(runs) == [alive.name], "the rerun left the killed run's temporary sibling behind"
    assert elsewhere.is_dir(), "the rerun removed another host's temporary sibling"


SFT = ["--lr", "1e-2", "--epochs", "2", "--batch-size", "8", "--threads", "1"]  # 64 traces: 8 steps an epoch
# The workflow's SFT (workflow_scripts/sft.py) of the same configuration as `graftlab sft ... SFT`, saving
# its full state for resuming after every step (0 minutes), into resume/ + the output path.
RESUMABLE_SFT = """
import sys
from pathlib import Path
from graftlab.train.resume import Resume, resume_dir
from graftlab.train.sft import TrainConfig, sft_epochs

model, data, out = sys.argv[1:]
cfg = TrainConfig(lr=1e-2, batch_size=8, epochs=2, threads=1, precision="auto", micro_batch_size="auto",
                  gradient_checkpointing="auto", save_dtype="auto")
sft_epochs(model, data, cfg, Path(out), Resume(resume_dir(out), 0))
"""


@pytest.fixture(scope="module")
def sft_reference(world_pico, tmp_path_factory) -> tuple[Path, Path]:
    """(data, the output of `graftlab sft` on it, never interrupted)."""
    tmp = tmp_path_factory.mktemp("sft-reference")
    data = tmp / "sft.parquet"
    expert_traces(pl.DataFrame(arith.sample_problems("mul", 64, "test", 0)))[0].write_parquet(data)
    out = tmp / "reference"
    reference(["sft", "--model", str(world_pico), "--data", str(data), "--out", str(out), *SFT])
    return data, out


@pytest.mark.workflow  # a real process killed, or several at once: the slow tier
def test_sft_killed_in_its_second_epoch_leaves_no_output_and_the_rerun_trains_the_same_model(
    world_pico, sft_reference, tmp_path
):
    data, expected = sft_reference
    runs = tmp_path / "runs"
    out = runs / "sft"
    cmd = GRAFTLAB + ["sft", "--model", str(world_pico), "--data", str(data), "--out", str(out), *SFT]
    # The first epoch's checkpoint is saved: the job is training the second.
    first_epoch = f".sft.tmp-{HOST}-*/**/.work-epoch~1/checkpoint-*"
    kill_mid_way(cmd, lambda: any(runs.glob(first_epoch)), tmp_path, tmp_path / "killed.log")
    assert not out.exists()

    run(cmd, tmp_path)
    assert_same_output(out, expected)
    assert leftovers(runs) == []


@pytest.mark.workflow  # a real process killed, or several at once: the slow tier
def test_resumable_sft_killed_mid_save_resumes_from_the_last_whole_checkpoint_to_the_same_weights(
    world_pico, sft_reference, tmp_path
):
    data, expected = sft_reference
    out = tmp_path / "runs" / "sft"  # absolute: its resume directory must still lie under resume/
    state = tmp_path / "resume" / "runs" / "sft"
    cmd = [sys.executable, "-c", RESUMABLE_SFT, str(world_pico), str(data), str(out)]

    def mid_save() -> bool:
        # The Trainer writes a checkpoint's optimizer before its trainer_state.json, neither atomically.
        return any(
            int(c.name.split("-")[1]) > 8 and not (c / "trainer_state.json").exists()
            for c in state.glob("checkpoint-*")
            if (c / "optimizer.pt").exists()
        )

    kill_mid_way(cmd, mid_save, tmp_path, tmp_path / "killed.log")
    assert not out.exists()
    log = run(cmd, tmp_path)
    resumed = re.search(r"resume: continuing from (\S+)", log)
    assert resumed and Path(resumed[1]).is_relative_to(Path("resume") / "runs" / "sft"), log[-3000:]
    assert not state.exists(), "a finished job leaves no resume state"
    assert leftovers(tmp_path / "runs") == []

    assert_same_output(out / "epoch~1", expected / "epoch~1")
    assert_same_output(out / "steps.jsonl", expected / "steps.jsonl")
    for f in (out / "epoch~2").iterdir():
        assert_same_output(f, expected / f.name)
    assert (out / "training.png").is_file()
    assert {f.name for f in (out / "epoch~2").iterdir()} | {"epoch~1", "steps.jsonl", "training.png"} == {
        f.name for f in expected.iterdir()
    }


def fisher_rollouts(model: Path, out: Path, count: int = 240) -> Path:
    """`count` rollouts of random tokens (a 40-token prompt, a 60-token completion): one batch each makes
    the Fisher a loop of `count` backward passes, about a second on one thread."""
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    ids = torch.randint(0, vocab, (count, 100), generator=torch.Generator().manual_seed(0)).tolist()
    pl.DataFrame({"prompt_ids": [r[:40] for r in ids], "completion_ids": [r[40:] for r in ids]}).write_parquet(out)
    return out


@pytest.mark.workflow  # a real process killed, or several at once: the slow tier
def test_fisher_killed_mid_pass_leaves_no_output_and_the_rerun_computes_the_same_fisher(world_pico, tmp_path):
    rollouts = fisher_rollouts(world_pico, tmp_path / "rollouts.parquet")
    runs = tmp_path / "runs"
    out, expected = runs / "fisher", runs / "expected"
    args = ["--model", str(world_pico), "--rollouts", str(rollouts), "--batch-size", "1", "--threads", "1"]
    reference(["fisher", *args, "--out", str(expected)])

    log = tmp_path / "killed.log"

    def mid_pass() -> bool:
        # tqdm's bar, "diag Fisher:  40%|...| 160/400 [...]": some batches done, not all.
        done = re.findall(r"diag Fisher:.*?\| *(\d+)/(\d+)", log.read_text()) if log.exists() else []
        return bool(done) and 0 < int(done[-1][0]) < int(done[-1][1]) and not out.exists()

    cmd = GRAFTLAB + ["fisher", *args, "--out", str(out)]
    kill_mid_way(cmd, mid_pass, tmp_path, log)
    assert not out.exists()

    run(cmd, tmp_path)
    assert_same_output(out, expected)
    assert leftovers(runs) == []


def evaluation(model: str, out: str, *paths: str) -> None:
    """An evaluation as workflow_scripts/evaluate.py runs one: the first benchmark graded as the new task,
    the others as old ones."""
    benchmarks = [Benchmark(Path(p).stem, Path(p), "old" if i else "new") for i, p in enumerate(paths)]
    cfg = SamplingConfig(n=2, temperature=1.0, top_p=1.0, max_new_tokens=40)
    evaluate(model, benchmarks, cfg, Path(out), "post", backend="transformers")


# The job: `evaluation` in a process of its own.
EVALUATE = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_faults as t\n"
EVALUATE += "t.evaluation(*sys.argv[1:])"


@pytest.mark.workflow  # a real process killed, or several at once: the slow tier
def test_evaluation_killed_between_benchmarks_leaves_no_scores_and_the_rerun_scores_the_same(world_pico, tmp_path):
    benchmarks = []
    for task in ("mul", "add", "sub"):
        benchmarks.append(tmp_path / f"{task}.parquet")
        pl.DataFrame(arith.sample_problems(task, 32, "benchmark", 0)).write_parquet(benchmarks[-1])
    runs = tmp_path / "runs"
    out, expected = runs / "eval", runs / "expected"
    evaluation(str(world_pico), str(expected), *map(str, benchmarks))
    shutil.copytree(expected, out)
    # The same evaluation run again over the finished one, as after a code change, and killed once it has
    # rewritten the first benchmark's records: the old metrics.json must not mark that mix as finished.
    first, last = ((out / f"{task}.parquet").stat().st_ino for task in ("mul", "sub"))

    def mid_way() -> bool:
        return (out / "mul.parquet").stat().st_ino != first and (out / "sub.parquet").stat().st_ino == last

    cmd = [sys.executable, "-c", EVALUATE, str(world_pico), str(out), *map(str, benchmarks)]
    kill_mid_way(cmd, mid_way, tmp_path, tmp_path / "killed.log")
    assert not (out / "metrics.json").exists(), "the old scores mark a half-rewritten evaluation as finished"

    run(cmd, tmp_path)
    assert_same_output(out, expected)
    assert leftovers(runs) == []


# The tiny world of configs/smoke.yaml up to its donor ladder: 3 jobs (tokenizer, corpus, pretraining),
# made by a snakemake killed mid-run and recovered, then compared with the same files of the smoke run's.
WORLD = ["tokenizer", "corpus.parquet", "init", "ladder"]


@pytest.mark.workflow
def test_snakemake_killed_mid_run_recovers_as_documented_to_the_uninterrupted_outputs(tmp_path, smoke):
    """The world built by a snakemake killed -9 mid-run, then by the recovery docs/sweeps.md gives: the
    same command (which refuses the killed run's lock and names --unlock), with --unlock, then as it was."""
    cores, threads, quiet = WHOLE_RUN[:2], WHOLE_RUN[2:4], WHOLE_RUN[4:]  # the smoke run's flags
    args = (*cores, *threads, "results/world/ladder", *quiet)
    world = tmp_path / "results" / "world"
    # Pretraining has saved its first ladder checkpoint and goes on training: jobs are running.
    first_rung = f".ladder.tmp-{HOST}-*/.work-step~50/checkpoint-50"
    kill_mid_way(snakemake_cmd(tmp_path, *args), lambda: any(world.glob(first_rung)), tmp_path, tmp_path / "killed.log")
    assert not (world / "ladder").exists()

    locked = snakemake(tmp_path, *args)
    assert locked.returncode != 0 and "--unlock" in locked.stderr + locked.stdout
    for recovery in ((*args, "--unlock"), args):
        done = snakemake(tmp_path, *recovery)
        assert done.returncode == 0, done.stderr[-3000:]
    assert leftovers(world) == []
    for name in WORLD:
        assert_same_output(world / name, smoke / "results" / "world" / name)
