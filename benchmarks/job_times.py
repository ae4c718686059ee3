"""Where a workflow run's time went: job count, summed wall and CPU seconds per rule, from the `benchmark:`
file every rule of the workflow writes under benchmarks/jobs/.

    rm -rf benchmarks/jobs && snakemake --cores all     # a run of its own
    python benchmarks/job_times.py [benchmarks/jobs]
    python benchmarks/job_times.py COLD/benchmarks/jobs WARM/benchmarks/jobs    # two runs, rule by rule

Given two runs (say one with `--config warm_jobs=False` and one warm, graftlab.io.warm), it prints both
runs' seconds per job of each rule and their ratio, second to first.

A job's time is the `s` column of its benchmark file: the wall seconds of its script, Snakemake's own
scheduling left out. Its CPU seconds are the warm worker's that ran it, where one did, else the file's
`cpu_time` (`graftlab.commands.inspect_results.job_usage`): a run cannot take less wall time than its
jobs' CPU seconds over its cores, whatever its parallelism. Its rule is the file's `rule_name` column,
which Snakemake writes with `--benchmark-extended` (on in the workflow profile, profiles/default). A file
holds the latest run of its job, so clear benchmarks/jobs/ before the run to be timed alone; the sum over
rules exceeds the run's wall time by the parallelism.
"""

import sys
from collections import Counter, defaultdict
from pathlib import Path

from graftlab.commands.inspect_results import job_usage

UNKNOWN = "(no rule_name)"  # a file written without --benchmark-extended


def job_times(root: Path) -> tuple[Counter, dict[str, float], dict[str, float]]:
    """Job count, summed wall seconds and summed CPU seconds per rule over every benchmark file under `root`."""
    count, seconds, cpu = Counter(), defaultdict(float), defaultdict(float)
    for path in sorted(root.rglob("*.tsv")):
        timed = job_usage(path)
        rule = timed["rule"] or UNKNOWN
        count[rule] += 1
        seconds[rule] += timed["s"]
        cpu[rule] += timed["cpu_time"]
    return count, seconds, cpu


def table(count: Counter, seconds: dict[str, float], cpu: dict[str, float]) -> str:
    lines = ["| rule | jobs | seconds | per job | CPU s |", "| --- | ---: | ---: | ---: | ---: |"]
    for rule, s in sorted(seconds.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {rule} | {count[rule]} | {s:.0f} | {s / count[rule]:.1f} | {cpu[rule]:.0f} |")
    lines.append(f"| all jobs | {sum(count.values())} | {sum(seconds.values()):.0f} | | {sum(cpu.values()):.0f} |")
    return "\n".join(lines)


def paired(first: tuple[Counter, dict, dict], second: tuple[Counter, dict, dict]) -> str:
    """Two runs' wall seconds per job of each rule, and the second's over the first's."""
    (count1, seconds1, _), (count2, seconds2, _) = first, second
    lines = [
        "| rule | jobs | s per job, first | s per job, second | second / first |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for rule in sorted(seconds1.keys() | seconds2.keys(), key=lambda r: -seconds1.get(r, 0.0)):
        a = seconds1[rule] / count1[rule] if count1[rule] else None
        b = seconds2[rule] / count2[rule] if count2[rule] else None
        jobs = count1[rule] if count1[rule] == count2[rule] else f"{count1[rule]} / {count2[rule]}"
        ratio = f"{b / a:.2f}" if a and b is not None else ""
        lines.append(
            f"| {rule} | {jobs} | {'' if a is None else f'{a:.1f}'} | {'' if b is None else f'{b:.1f}'} | {ratio} |"
        )
    total1, total2 = sum(seconds1.values()), sum(seconds2.values())
    lines.append(
        f"| all jobs, summed s | {sum(count1.values())} | {total1:.0f} | {total2:.0f} | {total2 / total1:.2f} |"
    )
    return "\n".join(lines)


def timed_runs(roots: list[Path]) -> list[tuple[Counter, dict, dict]]:
    runs = []
    for root in roots:
        if not root.is_dir():
            sys.exit(f"{root}: not a directory of benchmark files (the workflow writes them to benchmarks/jobs/)")
        count, seconds, cpu = job_times(root)
        if not count:
            sys.exit(f"{root}: no benchmark files")
        if count[UNKNOWN]:
            print(
                f"{root}: {count[UNKNOWN]} file(s) without rule_name: run Snakemake with --benchmark-extended",
                file=sys.stderr,
            )
        runs.append((count, seconds, cpu))
    return runs


if __name__ == "__main__":
    runs = timed_runs([Path(a) for a in sys.argv[1:3]] or [Path("benchmarks/jobs")])
    print(table(*runs[0]) if len(runs) == 1 else paired(*runs))
