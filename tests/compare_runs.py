"""Two workflow runs compared table by table: every parquet under `results/` bit-identical, but for the
latency tables, whose timing columns no rerun reproduces and which are compared without them.

    python tests/compare_runs.py WORKDIR_A WORKDIR_B

A change that must leave results as they were runs configs/smoke.yaml at the commit before it and at the
commit after it, on one machine (a tiny world is a machine's as well as a seed's), and compares the two
workdirs so: `tests/test_determinism.py` compares two runs of one commit the same way.
"""

from __future__ import annotations

import sys
from pathlib import Path

import polars as pl

from graftlab.analysis.latency import COSTS

# Seconds and what is chosen or computed from them, per table that holds any.
TIMING = {
    "latency.parquet": (*COSTS, "total_s", "best"),
    "latency_steps.parquet": ("sample_s", "update_s", "sampling_share"),
}


def tables(workdir: Path) -> list[Path]:
    return sorted(p.relative_to(workdir) for p in (workdir / "results").rglob("*.parquet"))


def differences(a: Path, b: Path) -> list[str]:
    """What differs between the workdirs `a` and `b`: tables only one has, and tables that differ."""
    ours, theirs = tables(a), tables(b)
    found = [f"only in {a}: {t}" for t in sorted(set(ours) - set(theirs))]
    found += [f"only in {b}: {t}" for t in sorted(set(theirs) - set(ours))]
    for table in sorted(set(ours) & set(theirs)):
        timing = TIMING.get(table.name)
        if timing is None:
            same = (a / table).read_bytes() == (b / table).read_bytes()
        else:
            first, second = pl.read_parquet(a / table), pl.read_parquet(b / table)
            drop = [c for c in timing if c in first.columns]
            same = first.columns == second.columns and first.drop(drop).equals(second.drop(drop))
        if not same:
            found.append(f"differs: {table}")
    return found


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    a, b = map(Path, argv)
    found = differences(a, b)
    print("\n".join(found) or f"{len(tables(a))} tables, the same (latency tables without their timings)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
