"""Where a workflow run's time went: job count and summed wall time per rule, from a Snakemake log.

    python benchmarks/job_times.py .snakemake/log/<run>.snakemake.log

Each job's time is from the timestamp before its `rule ...:` block to the one before its `Finished
jobid` line (second resolution); the sum over rules exceeds the run's wall time by the parallelism.
"""

import re
import sys
from collections import Counter, defaultdict
from datetime import datetime

STAMP = re.compile(r"\[(\w{3} \w{3} +\d+ [\d:]+ \d{4})\]")
RULE = re.compile(r"(?:local)?rule (\w+):")
JOBID = re.compile(r"\s+jobid: (\d+)")
DONE = re.compile(r"Finished jobid: (\d+)")


def job_times(lines) -> tuple[Counter, dict[str, float]]:
    stamp, rule, started, rule_of = None, None, {}, {}
    count, seconds = Counter(), defaultdict(float)
    for line in lines:
        if m := STAMP.match(line):
            stamp = datetime.strptime(m.group(1), "%a %b %d %H:%M:%S %Y")
        elif m := RULE.match(line):
            rule = m.group(1)
        elif (m := JOBID.match(line)) and rule:
            started[m.group(1)], rule_of[m.group(1)], rule = stamp, rule, None
        elif (m := DONE.match(line)) and m.group(1) in started:
            job = m.group(1)
            count[rule_of[job]] += 1
            seconds[rule_of[job]] += (stamp - started[job]).total_seconds()
    return count, seconds


if __name__ == "__main__":
    count, seconds = job_times(open(sys.argv[1]).read().splitlines())
    print("| rule | jobs | seconds | per job |\n| --- | ---: | ---: | ---: |")
    for rule, s in sorted(seconds.items(), key=lambda kv: -kv[1]):
        print(f"| {rule} | {count[rule]} | {s:.0f} | {s / count[rule]:.1f} |")
    print(f"| all jobs | {sum(count.values())} | {sum(seconds.values()):.0f} | |")
