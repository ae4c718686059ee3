#!/usr/bin/env bash
# Re-resolve envs/gpu.lock.txt, the one GPU stack every GPU job runs in: graftlab's dependencies with vLLM,
# exact versions as pip resolves them (a dry run: nothing is installed), then the conda environments built
# from it (envs/gpu.yaml, envs/cpu.yaml). Run it with a Python 3.11 on Linux x86_64, the lock's platform:
#   bash envs/lock-gpu.sh [vllm version]
set -euo pipefail
cd "$(dirname "$0")/.."
vllm=${1:-0.33.0}
report=$(mktemp)
# No local constraint may cap the resolution: the lock is PyPI's.
PIP_CONSTRAINT=/dev/null python -m pip install --dry-run --ignore-installed --quiet --report "$report" "vllm==$vllm" .
python envs/lock.py "$report" "vllm==$vllm"
rm -f "$report"
