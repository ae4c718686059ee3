"""Two whole runs of configs/smoke.yaml on the CPU, in two directories, give bit-identical tables: the
first with warm jobs (the default, graftlab.io.warm), the second with every job started cold.

`python -m pytest --determinism tests/test_determinism.py`: the second run doubles the suite's critical
path, so a plain `pytest` deselects these tests.

Every job seeds its own randomness from the config (docs/methods.md), runs on one thread in the suite
(conftest.WHOLE_RUN) and writes its tables with the same libraries, so nothing may differ but the time a
job took. The summary tables hold no timing column. The latency tables' timing columns are the `*_s`
seconds (`graftlab.analysis.latency.COSTS` and their `total_s`) and `best`, which breaks a tie in accuracy
by the lower `total_s`; they are compared apart from those.
"""

from pathlib import Path

import polars as pl
import pytest
from compare_runs import differences
from conftest import SMOKE, WHOLE_RUN, in_background

from graftlab.analysis.latency import COSTS

pytestmark = [pytest.mark.workflow, pytest.mark.determinism]


@in_background("smoke_again", __file__)
def _second_smoke_run(workdir: Path) -> tuple[tuple[str, ...], tuple[Path, ...]]:
    return (*WHOLE_RUN, "--config", "warm_jobs=False"), (SMOKE,)


@pytest.fixture(scope="session")
def smoke_again(background) -> Path:
    """configs/smoke.yaml run whole a second time, every job cold, in a directory of its own, beside the
    first."""
    return background.wait("smoke_again")


def tables(workdir: Path, pattern: str) -> list[Path]:
    return sorted(p.relative_to(workdir) for p in workdir.glob(pattern))


def test_two_smoke_runs_write_bit_identical_summaries(smoke, smoke_again):
    summaries = tables(smoke, "results/**/summary.parquet") + tables(smoke, "results/*/continual.parquet")
    assert len(summaries) == 8  # the seven experiments' summaries and the continual table
    assert summaries == tables(smoke_again, "results/**/summary.parquet") + tables(
        smoke_again, "results/*/continual.parquet"
    )
    for table in summaries:
        assert (smoke / table).read_bytes() == (smoke_again / table).read_bytes(), table


def test_two_smoke_runs_differ_in_timings_only(smoke, smoke_again):
    latencies = tables(smoke, "results/*/latency.parquet")
    assert latencies and latencies == tables(smoke_again, "results/*/latency.parquet")
    for table in latencies:
        first, second = pl.read_parquet(smoke / table), pl.read_parquet(smoke_again / table)
        timing = [c for c in first.columns if c.endswith("_s")] + ["best"]
        assert set(COSTS) | {"total_s", "best"} == set(timing), table
        assert first.drop(timing).equals(second.drop(timing)), table


def test_two_smoke_runs_write_the_same_tables_throughout(smoke, smoke_again):
    """Every table under results/, each experiment's and the world's, as `tests/compare_runs.py` compares
    the runs of two commits."""
    assert not differences(smoke, smoke_again)
