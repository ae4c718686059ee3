"""Write envs/gpu.lock.txt, envs/gpu.yaml and envs/cpu.yaml from a pip resolution report (`pip install --dry-run
--report`, envs/lock-gpu.sh): every package pip would install, graftlab itself left out (the workflow runs its
own source), as `name==version` lines; the conda environment that installs exactly those; and the CPU one."""

import json
import re
import sys
import tomllib
from pathlib import Path

ENVS = Path(__file__).parent
report, asked = json.loads(Path(sys.argv[1]).read_text()), sys.argv[2]
pins = sorted(
    (i["metadata"]["name"].lower(), i["metadata"]["version"])
    for i in report["install"]
    if i["metadata"]["name"].lower() != "graftlab"
)
versions = dict(pins)
cuda = versions.get("nvidia-cuda-runtime") or versions.get("nvidia-cuda-runtime-cu12")
header = [
    f"# The GPU stack, resolved by pip from PyPI for {asked} and graftlab's dependencies (envs/lock-gpu.sh).",
    f"# Python 3.11, Linux x86_64; torch {versions['torch']} is PyPI's CUDA build, with the CUDA {cuda} runtime",
    "# from its nvidia-* wheels: the node needs an NVIDIA driver that supports that CUDA (R580 or newer for",
    "# CUDA 13). The CPU test suite runs against the transformers, trl and accelerate pinned here (.ci/run).",
]
(ENVS / "gpu.lock.txt").write_text("\n".join(header + [f"{n}=={v}" for n, v in pins]) + "\n")
conda = [
    "# Every GPU job's environment under --sdm conda: exactly envs/gpu.lock.txt (written with it by",
    "# envs/lock-gpu.sh; do not edit). graftlab itself comes from the workflow's own src/ (rules/common.smk",
    "# puts it on PYTHONPATH): an environment file cannot name the checkout, since Snakemake copies it away.",
    "channels: [conda-forge, nodefaults]",
    "dependencies:",
    "  - python=3.11",
    "  - pip",
    "  - pip:",
    *(f"      - {n}=={v}" for n, v in pins),
]
(ENVS / "gpu.yaml").write_text("\n".join(conda) + "\n")
# The CPU rules' environment: graftlab's own dependencies at the lock's versions (pip resolves the rest), with
# PyPI's CUDA torch swapped for the CPU build of the same version.
declared = tomllib.loads((ENVS.parent / "pyproject.toml").read_text())["project"]["dependencies"]
names = [re.split(r"[<>=!~ \[;]", d, maxsplit=1)[0].lower() for d in declared]
cpu = [
    "# The CPU rules' environment under --sdm conda (grafts, analysis, data): graftlab's dependencies at the",
    "# versions of envs/gpu.lock.txt, CPU torch (written with it by envs/lock-gpu.sh; do not edit). graftlab",
    "# itself comes from the workflow's own src/, as in envs/gpu.yaml.",
    "channels: [conda-forge, nodefaults]",
    "dependencies:",
    "  - python=3.11",
    "  - pip",
    "  - pip:",
    "      - --extra-index-url https://download.pytorch.org/whl/cpu",
    *(f"      - {n}=={versions[n]}" + ("+cpu" if n == "torch" else "") for n in names),
]
(ENVS / "cpu.yaml").write_text("\n".join(cpu) + "\n")
print(f"envs/gpu.lock.txt, gpu.yaml, cpu.yaml: {len(pins)} packages, torch {versions['torch']}, CUDA {cuda}")
