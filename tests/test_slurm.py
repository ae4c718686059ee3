"""The cluster path through a real SLURM (tests/slurm/local-slurm.sh: Debian's slurmctld, slurmd, slurmdbd and
munge on this machine, eight fake GPUs as gres) and the real snakemake-executor-plugin-slurm, under
profiles/slurm with only its placeholder names replaced and its GPUs made small: a cluster-shaped tiny run
(tests/slurm/cluster.yaml) whose every job's request, read back from the scheduler's accounting, is what
graftlab.planning.resources sized, whose GPU jobs ran on the `gpu` partition, whose multi-GPU SFT jobs ran as
several processes (gloo on this CPU), two at once, whose OPSD job, requeued mid-run as a preemption does,
resumed and ended bit-identical, and whose results equal a local run's.

Marked `slurm`: `.ci/run` runs it (it starts the daemons as root); `pytest -m "not slurm"` leaves it out."""

import json
import re
import shutil
import subprocess
import threading
import time
from collections import defaultdict
from datetime import datetime
from pathlib import Path

import polars as pl
import pytest
import yaml
from conftest import REPO, in_background, job_requests, snakemake_cmd

from graftlab.io.atomic import write_json
from graftlab.memory import GPU_SHARE
from graftlab.planning.config import resolve
from graftlab.planning.layout import Experiment
from graftlab.planning.work import job_work

pytestmark = [pytest.mark.slurm, pytest.mark.workflow]
CONFIG = REPO / "tests/slurm/cluster.yaml"
TARGETS = ("results/expert/summary.parquet", "results/continual/summary.parquet")
# The trainer the test requeues mid-run (its 12 steps: tests/slurm/cluster.yaml).
OPSD_RUN = "expert/opsd/post/alpha~0.5/lr~1e-4"
OPSD_STEPS = 12
# The names profiles/slurm leaves to the user, as tests/slurm/local-slurm.sh made them.
NAMES = {"YOUR_ACCOUNT": "graftlab", "YOUR_CPU_PARTITION": "cpu", "YOUR_GPU_PARTITION": "gpu"}


def start_cluster() -> None:
    if shutil.which("apt-get") is None:
        pytest.fail("the SLURM test installs Debian's slurm packages: no apt-get here")
    up = subprocess.run(["bash", str(REPO / "tests/slurm/local-slurm.sh"), "up"], capture_output=True, text=True)
    assert up.returncode == 0, up.stdout[-2000:] + up.stderr[-3000:]


def gpu_memory_gb() -> float:
    """The fake GPUs' memory: just enough for an SFT job's share on two GPUs (graftlab.memory), so
    SFT, which shards, runs as two processes, and every other job, which cannot or need not, on one."""
    config = resolve(yaml.safe_load(CONFIG.read_text()))
    sft = job_work("sft", config, Experiment.of(config, "expert"), {"donor": "post"}).memory
    return sft.per_gpu(2) / GPU_SHARE / 1e9 * 1.001


# The GPU rules' model (the fake gres type), constraint (a feature of the local node) and QoS.
GPU_SHAPE = {"gpu_type": "test", "gpu_constraint": "fakegpu", "gpu_qos": "gpuq"}


def write_profile(path: Path) -> Path:
    """profiles/slurm with its placeholder names replaced by the local cluster's, its GPUs' memory by
    `gpu_memory_gb()` and the GPU rules' `GPU_SHAPE` given, nothing else changed but how soon the plugin
    first asks for a job's state (its default, 40 s, is for a busy cluster)."""
    text = (REPO / "profiles/slurm/config.yaml").read_text()
    shape = "".join(f"\n  {key}: {value}" for key, value in GPU_SHAPE.items())
    for placeholder, name in {**NAMES, "gpu_memory_gb: 80": f"gpu_memory_gb: {gpu_memory_gb()!r}{shape}"}.items():
        assert placeholder in text
        text = text.replace(placeholder, name)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.yaml").write_text(text + "slurm-init-seconds-before-status-checks: 2\n")
    return path


def squeue(*args: str) -> list[list[str]]:
    out = subprocess.run(["squeue", "-h", *args], capture_output=True, text=True, check=True).stdout
    return [line.split("|") for line in out.splitlines()]


class Preemption(threading.Thread):
    """Requeues the run's OPSD job once, as a preemption does (`scontrol requeue`: SIGTERM, then back into
    the queue), after it has saved a step and before its last, and lets it start again at once: a requeued
    job otherwise waits two minutes for its begin time. What it did goes to `preemption.json` beside the
    run, for the test, which may run in another pytest-xdist worker than this thread."""

    def __init__(self, workdir: Path) -> None:
        super().__init__(daemon=True)
        self.workdir = workdir

    def run(self) -> None:
        log = self.workdir / "logs" / f"{OPSD_RUN}.log"
        outcome = {"missed": "the run ended before OPSD saved a step"}
        deadline = time.monotonic() + 1800
        # Until the run has ended: conftest.Background writes its exit status beside its directory.
        while not (self.workdir.parent / "exit").exists() and time.monotonic() < deadline:
            saved = re.findall(r"resume: saved OPSD step (\d+)", log.read_text()) if log.exists() else []
            if saved:
                outcome = self.requeue(int(saved[-1]))
                break
            time.sleep(0.2)
        write_json(self.workdir.parent / "preemption.json", outcome)  # whole or absent

    def requeue(self, step: int) -> dict:
        running = squeue("-t", "RUNNING", "-o", "%i|%k|%Z")
        jobs = [j for j, comment, where in running if Path(where) == self.workdir and comment.startswith("rule_opsd")]
        if not jobs:
            return {"missed": f"OPSD had saved step {step} but was no longer running"}
        subprocess.run(["scontrol", "requeue", jobs[0]], check=True)
        for _ in range(600):
            if squeue("-j", jobs[0], "-o", "%T") == [["PENDING"]]:
                subprocess.run(["scontrol", "update", f"JobId={jobs[0]}", "StartTime=now"], check=True)
                break
            time.sleep(0.1)
        return {"requeued": [jobs[0], step]}


# Both runs start with the session, in the background (conftest.Background), beside the smoke run: the
# SLURM run mostly waits for the scheduler, which should cost the suite no time of its own.
@in_background("slurm_run", __file__)
def _slurm_run(workdir: Path):
    start_cluster()
    Preemption(workdir).start()
    return ("--profile", str(write_profile(workdir.parent / f"{workdir.name}-profile")), *TARGETS), (CONFIG,)


@in_background("local_run", __file__)
def _local_run(workdir: Path):
    # The targets after an option of one value: --configfile before and --quiet after take every word.
    return ("--cores", "2", "--max-threads", "1", *TARGETS, "--quiet"), (CONFIG,)


@pytest.fixture(scope="module")
def local_run(background) -> Path:
    return background.wait("local_run")


@pytest.fixture(scope="module")
def slurm_run(background) -> tuple[Path, str]:
    """The run through SLURM, and the jobs a dry run of the same command plans when forced to redo them all."""
    workdir = background.wait("slurm_run")
    profile = workdir.parent / f"{workdir.name}-profile"
    cmd = snakemake_cmd(workdir, "-n", "--forceall", "--profile", str(profile), *TARGETS, configs=(CONFIG,))
    planned = subprocess.run(cmd, capture_output=True, text=True, cwd=workdir)
    assert planned.returncode == 0, planned.stderr[-3000:]
    return workdir, planned.stdout + planned.stderr


def accounted(workdir: Path) -> list[dict]:
    """Every job of the run as SLURM's accounting holds it: its rule (from the plugin's comment), partition,
    requested TRES, time limit, nodes, state, start and end. Only jobs since the run started (conftest.Background
    writes its pid beside its directory then): an earlier run in a directory of the same name is another's."""
    fields = "WorkDir,Comment,Partition,ReqTRES,Timelimit,NNodes,State,Start,End,QOS,Constraints"
    since = datetime.fromtimestamp(int((workdir.parent / "pid").stat().st_mtime)).strftime("%Y-%m-%dT%H:%M:%S")
    query = ["sacct", "-X", "-P", "-n", "--starttime", since, "-o", fields]
    out = subprocess.run(query, capture_output=True, text=True, check=True).stdout
    rows = []
    for line in out.splitlines():
        where, comment, partition, tres, limit, nodes, state, start, end, qos, constraints = line.split("|")
        if Path(where) != workdir:
            continue  # another run's job
        tres = dict(kv.split("=", 1) for kv in tres.split(","))
        rule = re.match(r"rule_(\w+?)(_wildcards_|$)", comment)[1]
        span = (datetime.fromisoformat(start), datetime.fromisoformat(end))
        row = dict(rule=rule, partition=partition, tres=tres, limit=limit, nodes=nodes, state=state, span=span)
        rows.append(row | {"qos": qos, "constraints": constraints})
    return rows


def minutes(limit: str) -> int:
    """A SLURM time limit ([D-]HH:MM:SS) in minutes."""
    days, _, clock = limit.rpartition("-")
    h, m, s = map(int, clock.split(":"))
    return int(days or 0) * 1440 + h * 60 + m + (s > 0)


def test_every_job_asked_slurm_for_what_graftlab_sized(slurm_run):
    workdir, planned = slurm_run
    asked: dict[str, list[tuple]] = defaultdict(list)
    for row in accounted(workdir):
        assert row["state"] == "COMPLETED", row
        tres = row["tres"]
        gpus = int(tres.get("gres/gpu", 0))
        mem = tres["mem"]
        mem_mb = int(float(mem[:-1]) * {"M": 1, "G": 1024}[mem[-1]])
        request = (row["partition"], gpus, mem_mb, minutes(row["limit"]), int(tres["cpu"]), row["nodes"])
        asked[row["rule"]].append(request)
    sized: dict[str, list[tuple]] = defaultdict(list)
    for rule, res in job_requests(planned):
        partition = res.get("slurm_partition")
        # One CPU where no cpus_per_task is sized: the plugin asks for the job's threads, 1 in this config.
        cpus = int(res.get("cpus_per_task", 1))
        request = (partition, int(res.get("gpu", 0)), int(res["mem_mb"]), int(res["runtime"]), cpus)
        sized[rule].append((*request, res["nodes"]))
    assert {r: sorted(v) for r, v in asked.items()} == {r: sorted(v) for r, v in sized.items()}
    assert sum(map(len, asked.values())) == 36  # tests/slurm/cluster.yaml's jobs up to its two summaries
    # The GPU rules went to the GPU partition, the summary to the CPU one; every job on one node.
    assert {p for p, *_ in asked["sft"] + asked["evaluate"]} == {"gpu"} and asked["summary"][0][0] == "cpu"
    assert all(request[-1] == "1" for requests in asked.values() for request in requests)
    # The small GPUs: SFT, which shards, was given two; the on-policy trainers and the Fisher, whose
    # activations (which do not shard) fit no count (the dry run warned), and every sampler one.
    assert {gpus for rule in ("sft", "chain_sft") for _, gpus, *_ in asked[rule]} == {2}
    one = ("opsd", "grpo", "sdpo", "mine", "evaluate", "fisher")
    assert {gpus for rule in one for _, gpus, *_ in asked[rule]} == {1}
    assert re.search(r"graftlab: warning: grpo: no count of up to 8 GPUs dividing its batch of 4 holds it", planned)
    assert re.search(r"graftlab: warning: opsd: no count of up to 8 GPUs dividing its batch of 2 holds it", planned)
    # The GPU rules asked SLURM for the profile's GPU model, constraint and QoS; the CPU rules for none.
    for row in accounted(workdir):
        gpu = row["partition"] == "gpu"
        assert ("gres/gpu:test" in row["tres"]) == gpu and (row["constraints"] == "fakegpu") == gpu, row
        assert row["qos"] == ("gpuq" if gpu else "normal"), row  # normal: the association's default


def planned_logs(planned: str, rules: tuple[str, ...]) -> list[str]:
    """The log of every job of `rules` the dry run printed."""
    jobs = re.findall(r"^rule (\w+):\n(?:    .*\n)*?    log: (\S+)$", planned, re.M)
    return [log for rule, log in jobs if rule in rules]


def test_multi_gpu_sft_ran_as_several_processes_two_jobs_at_once(slurm_run):
    """Each SFT job given two GPUs trained as two processes (accelerate, DDP over gloo on this CPU), on a
    port of its own: two of them ran on the node at the same time."""
    workdir, planned = slurm_run
    logs = planned_logs(planned, ("sft", "chain_sft"))
    assert len(logs) == 5
    for log in logs:
        text = (workdir / log).read_text()
        assert "processes: 2 (no CUDA; 2 GPUs given by SLURM" in text, log
        assert text.count("batch: 8 = 4 x 1 accumulated x 2 processes") == 2, log  # both processes trained
    spans = sorted(row["span"] for row in accounted(workdir) if row["rule"] in ("sft", "chain_sft"))
    assert any(later[0] < earlier[1] for earlier, later in zip(spans, spans[1:])), spans


def test_a_requeued_trainer_resumes_and_ends_bit_identical_to_an_uninterrupted_run(slurm_run, local_run):
    workdir, _ = slurm_run
    outcome = workdir.parent / "preemption.json"
    for _ in range(100):  # written by the Preemption thread once the run has ended, if not before
        if outcome.exists():
            break
        time.sleep(0.1)
    preemption = json.loads(outcome.read_text())
    assert "requeued" in preemption, preemption["missed"]
    job, saved = preemption["requeued"]
    assert 1 <= saved < OPSD_STEPS
    query = ["sacct", "-j", job, "--duplicates", "-X", "-P", "-n", "-o", "State"]
    states = subprocess.run(query, capture_output=True, text=True, check=True).stdout.split()
    assert states == ["REQUEUED", "COMPLETED"]
    log = (workdir / "logs" / f"{OPSD_RUN}.log").read_text()
    resumed = [int(step) for step in re.findall(r"resume: OPSD continues after step (\d+)", log)]
    assert len(resumed) == 1 and saved <= resumed[0] < OPSD_STEPS, log[-3000:]
    ours, theirs = (d / "results" / OPSD_RUN for d in (workdir, local_run))
    weights = sorted(p.relative_to(theirs) for p in theirs.rglob("*.safetensors"))
    assert weights and weights == sorted(p.relative_to(ours) for p in ours.rglob("*.safetensors"))
    assert all((ours / w).read_bytes() == (theirs / w).read_bytes() for w in weights)
    losses = [[json.loads(line)["loss"] for line in (d / "steps.jsonl").open()] for d in (ours, theirs)]
    assert losses[0] == losses[1] and len(losses[0]) == OPSD_STEPS


def test_the_run_through_slurm_equals_a_local_run(slurm_run, local_run):
    workdir, _ = slurm_run
    for target in TARGETS:
        ours, theirs = (pl.read_parquet(d / target) for d in (workdir, local_run))
        keys = [c for c in ("run", "method", "chain", "stage") if c in ours.columns]
        scores = [c for c in ours.columns if ours[c].dtype.is_numeric() and c not in keys]
        assert keys and ours.select(*keys, *scores).equals(theirs.select(*keys, *scores)), target
