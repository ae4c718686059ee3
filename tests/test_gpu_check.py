"""benchmarks/gpu_check.py, the GPU check, runs every stage end to end on a CPU at its pico size."""

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO

STAGES = ["sampling", "sft (20 steps)", "diag Fisher (16 rollouts)", "graft", "evaluation", "grpo (1 warm step)"]


@pytest.mark.workflow  # the whole GPU check: the slow tier
def test_the_gpu_check_runs_every_stage_at_pico_size(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--size", "pico", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [s["name"] for s in record["stages"]] == STAGES and record["failed"] == []
    assert record["versions"]["transformers"] and record["versions"]["trl"]
    by_name = {s["name"]: s for s in record["stages"]}
    # 16 rollouts of up to 16 tokens each, and 19 timed SFT steps of 4 x 32 tokens.
    assert 0 < by_name["sampling"]["tokens"] <= 16 * 16
    assert by_name["sft (20 steps)"]["tokens"] == 19 * 4 * 32
    # The warm GRPO step: 16 problems x 8 completions of up to 8 tokens.
    assert 0 < by_name["grpo (1 warm step)"]["tokens"] <= 16 * 8 * 8
    assert all(s["seconds"] > 0 for s in record["stages"])
    # The graft is a real model: it loads and its weights are finite.
    from safetensors.torch import load_file

    weights = load_file(tmp_path / "graft" / "model.safetensors")
    assert all(t.float().isfinite().all() for t in weights.values())
    assert "| sampling |" in proc.stdout and "| evaluation |" in proc.stdout
