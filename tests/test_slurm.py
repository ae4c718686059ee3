"""The cluster path through a real SLURM (tests/slurm/local-slurm.sh: Debian's slurmctld, slurmd, slurmdbd and
munge on this machine, four fake GPUs as gres) and the real snakemake-executor-plugin-slurm, under
profiles/slurm with only its placeholder names replaced: a cluster-shaped tiny run (tests/slurm/cluster.yaml)
whose every job's request, read back from the scheduler's accounting, is what graftlab.planning.resources
sized, whose GPU jobs ran on the `gpu` partition and whose results equal a local run's.

Marked `slurm`: `.ci/run` runs it (it starts the daemons as root); `pytest -m "not slurm"` leaves it out."""

import re
import shutil
import subprocess
from collections import defaultdict
from pathlib import Path

import polars as pl
import pytest
from conftest import REPO, in_background, job_requests, snakemake_cmd

pytestmark = [pytest.mark.slurm, pytest.mark.workflow]
CONFIG = REPO / "tests/slurm/cluster.yaml"
TARGET = "results/expert/summary.parquet"
# The names profiles/slurm leaves to the user, as tests/slurm/local-slurm.sh made them.
NAMES = {"YOUR_ACCOUNT": "graftlab", "YOUR_CPU_PARTITION": "cpu", "YOUR_GPU_PARTITION": "gpu"}


def start_cluster() -> None:
    if shutil.which("apt-get") is None:
        pytest.fail("the SLURM test installs Debian's slurm packages: no apt-get here")
    up = subprocess.run(["bash", str(REPO / "tests/slurm/local-slurm.sh"), "up"], capture_output=True, text=True)
    assert up.returncode == 0, up.stdout[-2000:] + up.stderr[-3000:]


def write_profile(path: Path) -> Path:
    """profiles/slurm with its placeholder names replaced by the local cluster's, nothing else changed but
    how soon the plugin first asks for a job's state (its default, 40 s, is for a busy cluster)."""
    text = (REPO / "profiles/slurm/config.yaml").read_text()
    for placeholder, name in NAMES.items():
        assert placeholder in text
        text = text.replace(placeholder, name)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.yaml").write_text(text + "slurm-init-seconds-before-status-checks: 2\n")
    return path


# Both runs start with the session, in the background (conftest.Background), beside the smoke run: the
# SLURM run mostly waits for the scheduler, which should cost the suite no time of its own.
@in_background("slurm_run", __file__)
def _slurm_run(workdir: Path):
    start_cluster()
    return ("--profile", str(write_profile(workdir.parent / f"{workdir.name}-profile")), TARGET), (CONFIG,)


@in_background("local_run", __file__)
def _local_run(workdir: Path):
    # The target after an option of one value: --configfile before and --quiet after take every word.
    return ("--cores", "2", "--max-threads", "1", TARGET, "--quiet"), (CONFIG,)


@pytest.fixture(scope="module")
def local_run(background) -> Path:
    return background.wait("local_run")


@pytest.fixture(scope="module")
def slurm_run(background) -> tuple[Path, str]:
    """The run through SLURM, and the jobs a dry run of the same command plans when forced to redo them all."""
    workdir = background.wait("slurm_run")
    profile = workdir.parent / f"{workdir.name}-profile"
    cmd = snakemake_cmd(workdir, "-n", "--forceall", "--profile", str(profile), TARGET, configs=(CONFIG,))
    planned = subprocess.run(cmd, capture_output=True, text=True, cwd=workdir)
    assert planned.returncode == 0, planned.stderr[-3000:]
    return workdir, planned.stdout + planned.stderr


def accounted(workdir: Path) -> list[dict]:
    """Every job of the run as SLURM's accounting holds it: its rule (from the plugin's comment), partition,
    requested TRES, time limit and state."""
    fields = "WorkDir,Comment,Partition,ReqTRES,Timelimit,NNodes,State"
    query = ["sacct", "-X", "-P", "-n", "--starttime", "now-1days", "-o", fields]
    out = subprocess.run(query, capture_output=True, text=True, check=True).stdout
    rows = []
    for line in out.splitlines():
        where, comment, partition, tres, limit, nodes, state = line.split("|")
        if Path(where) != workdir:
            continue  # another run's job
        tres = dict(kv.split("=", 1) for kv in tres.split(","))
        rule = re.match(r"rule_(\w+?)(_wildcards_|$)", comment)[1]
        rows.append(dict(rule=rule, partition=partition, tres=tres, limit=limit, nodes=nodes, state=state))
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
    assert sum(map(len, asked.values())) == 21  # tests/slurm/cluster.yaml's jobs up to the summary
    # The GPU rules went to the GPU partition, the summary to the CPU one; every job on one node.
    assert {p for p, *_ in asked["sft"] + asked["evaluate"]} == {"gpu"} and asked["summary"][0][0] == "cpu"
    assert all(request[-1] == "1" for requests in asked.values() for request in requests)


def test_the_run_through_slurm_equals_a_local_run(slurm_run, local_run):
    workdir, _ = slurm_run
    ours, theirs = (pl.read_parquet(d / TARGET) for d in (workdir, local_run))
    scores = [c for c in ours.columns if ours[c].dtype.is_numeric()]
    assert ours.select("run", *scores).equals(theirs.select("run", *scores))
