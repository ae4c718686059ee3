"""Where a workflow run's time went: job count and summed wall time per rule, from the `benchmark:` file
every rule of the workflow writes under benchmarks/jobs/.

    rm -rf benchmarks/jobs && snakemake --cores all     # a run of its own
    python benchmarks/job_times.py [benchmarks/jobs]

A job's time is the `s` column of its benchmark file: the wall seconds of its script, Snakemake's own
scheduling left out. Its rule is the file's `rule_name` column, which Snakemake writes with
`--benchmark-extended` (on in the workflow profile, profiles/default). A file holds the latest run of its
job, so clear benchmarks/jobs/ before the run to be timed alone; the sum over rules exceeds the run's wall
time by the parallelism.
"""

import sys
from collections import Counter, defaultdict
from pathlib import Path

from graftlab.commands.inspect_results import read_benchmark

UNKNOWN = "(no rule_name)"  # a file written without --benchmark-extended


def job_times(root: Path) -> tuple[Counter, dict[str, float]]:
    """Job count and summed seconds per rule over every benchmark file under `root`."""
    count, seconds = Counter(), defaultdict(float)
    for path in sorted(root.rglob("*.tsv")):
        timed = read_benchmark(path)
        rule = timed["rule"] or UNKNOWN
        count[rule] += 1
        seconds[rule] += timed["s"]
    return count, seconds


def table(count: Counter, seconds: dict[str, float]) -> str:
    lines = ["| rule | jobs | seconds | per job |", "| --- | ---: | ---: | ---: |"]
    for rule, s in sorted(seconds.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {rule} | {count[rule]} | {s:.0f} | {s / count[rule]:.1f} |")
    lines.append(f"| all jobs | {sum(count.values())} | {sum(seconds.values()):.0f} | |")
    return "\n".join(lines)


if __name__ == "__main__":
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/jobs")
    if not root.is_dir():
        sys.exit(f"{root}: not a directory of benchmark files (the workflow writes them to benchmarks/jobs/)")
    count, seconds = job_times(root)
    if not count:
        sys.exit(f"{root}: no benchmark files")
    print(table(count, seconds))
    if count[UNKNOWN]:
        print(f"\n{count[UNKNOWN]} file(s) without rule_name: run Snakemake with --benchmark-extended", file=sys.stderr)
