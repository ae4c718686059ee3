"""The pinned GPU stack: envs/gpu.lock.txt, the conda environments written from it, and the CPU suite's own
installs held to the versions it pins."""

import os
import re
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
ENVS = REPO / "envs"
PIN = re.compile(r"^([a-z0-9][a-z0-9._-]*)==([0-9][^\s]*)$")


def lock() -> dict[str, str]:
    """name -> version of every line of the lock, each an exact pin."""
    lines = [line for line in (ENVS / "gpu.lock.txt").read_text().splitlines() if not line.startswith("#")]
    pins = [PIN.match(line) for line in lines]
    assert all(pins), [line for line, pin in zip(lines, pins) if not pin]
    return {m[1]: m[2] for m in pins}


def pip_entries(env: str) -> list[str]:
    spec = yaml.safe_load((ENVS / env).read_text())
    (pip,) = [d["pip"] for d in spec["dependencies"] if isinstance(d, dict)]
    return pip


def test_the_lock_pins_the_whole_gpu_stack_exactly():
    pins = lock()
    assert {"torch", "vllm", "transformers", "trl", "accelerate", "safetensors", "datasets"} <= set(pins)
    assert "graftlab" not in pins  # the workflow runs its own source
    assert pins["torch"].startswith("2.14.") and "cpu" not in pins["torch"]  # PyPI's CUDA build
    assert any(name.startswith("nvidia-cuda-runtime") for name in pins)  # the CUDA it needs, as wheels


@pytest.mark.parametrize("env", ["gpu.yaml", "cpu.yaml"])
def test_no_environment_names_a_path_snakemake_would_break(env):
    """Snakemake copies an environment file into .snakemake/conda/ before pip reads it: `-e ..` or any other
    path would point into that copy. Only pins and index options."""
    for entry in pip_entries(env):
        assert entry.startswith("--extra-index-url https://") or PIN.match(entry), f"{env}: {entry!r}"


def test_the_environments_are_the_lock():
    pins = lock()
    gpu = dict(PIN.match(e).groups() for e in pip_entries("gpu.yaml"))
    assert gpu == pins
    # The CPU rules: graftlab's own dependencies, each at the lock's version, torch as its CPU build.
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    names = [re.split(r"[<>=!~ \[;]", d, maxsplit=1)[0].lower() for d in declared]
    cpu = dict(PIN.match(e).groups() for e in pip_entries("cpu.yaml") if PIN.match(e))
    assert cpu == {n: pins[n] + ("+cpu" if n == "torch" else "") for n in names}


@pytest.mark.parametrize("package", ["transformers", "trl", "accelerate"])
def test_the_suite_runs_on_the_locks_versions(package):
    """.ci/run installs these at the lock's versions: an API the GPU stack lacks fails here, on the CPU."""
    assert version(package) == lock()[package]


def test_conda_jobs_import_graftlab_from_the_workflows_source(monkeypatch, tmp_path):
    from graftlab.planning.source import import_from

    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    import_from(tmp_path / "src")
    assert os.environ["PYTHONPATH"] == f"{tmp_path / 'src'}{os.pathsep}/elsewhere"
    monkeypatch.delenv("PYTHONPATH")
    import_from(tmp_path / "src")
    assert os.environ["PYTHONPATH"] == str(tmp_path / "src")
