"""benchmarks/memory_bench.py: a trainer's and a Fisher's measured peak on this CPU within 25% of the memory model."""

import subprocess
import sys

import pytest

from tests.conftest import REPO


@pytest.mark.workflow  # two whole jobs in fresh processes: the slow tier
def test_measured_peaks_are_within_a_quarter_of_the_memory_model(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "memory_bench.py"), "--kinds", "sft", "fisher_diag"]
        + ["--out", str(tmp_path), "--threads", "1"],  # one: the suite's other processes share the cores
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = [line.split(" | ") for line in proc.stdout.splitlines() if line.startswith(("| sft |", "| fisher_diag |"))]
    ratios = {row[0].strip("| "): float(row[3]) for row in rows}
    assert set(ratios) == {"sft", "fisher_diag"} and all(0.75 <= r <= 1.25 for r in ratios.values()), ratios
