"""Jobs of a finished run that recomputed another job's outputs (issue 34, item 2): every job Snakemake
recorded (`.snakemake/metadata/`: each output's rule, log and times), its outputs' bytes hashed (a directory's
files by their path inside it), and the jobs whose outputs are the same bytes as an earlier job's of the same
rule, under other names. Files that name their own path or time (provenance, logs) are left out, so a job
that differs only in those counts as a repeat; a repeat's seconds are what sharing it would save.

    python benchmarks/duplicate_jobs.py WORKDIR [--show 10]

Prints a Markdown table per rule (jobs, repeats, seconds repeated) and the largest groups of repeats.
"""

import argparse
import base64
import hashlib
import json
from collections import defaultdict
from pathlib import Path

# Written beside a job's outputs and naming that job's own paths or times: never the same twice.
OWN = {"provenance.json", "seconds.json", "steps.jsonl", "stats.json"}


def digest(path: Path) -> str | None:
    """The bytes of an output: a file's, or a directory's files with their paths inside it; None if gone."""
    if path.is_file():
        return hashlib.sha256(path.read_bytes()).hexdigest()
    if not path.is_dir():
        return None
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file() and p.name not in OWN):
        h.update(str(f.relative_to(path)).encode() + b"\0" + hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()


def jobs(workdir: Path) -> dict[str, dict]:
    """Each recorded job, by its log: rule, seconds, and its outputs' digests (in output order, names left out)."""
    found: dict[str, dict] = {}
    for record in sorted((workdir / ".snakemake/metadata").iterdir()):
        meta = json.loads(record.read_text())
        output = base64.urlsafe_b64decode(record.name).decode()
        key = ",".join(meta.get("log") or [output])
        job = found.setdefault(key, {"rule": meta["rule"], "outputs": {}, "seconds": 0.0})
        job["seconds"] = max(job["seconds"], (meta.get("endtime") or 0) - (meta.get("starttime") or 0))
        if Path(output).name not in OWN:
            job["outputs"][output] = digest(workdir / output)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--show", type=int, default=10, help="groups of repeats listed")
    args = parser.parse_args()
    groups: dict[tuple, list[tuple[str, dict]]] = defaultdict(list)
    for key, job in jobs(args.workdir).items():
        if job["outputs"] and None not in job["outputs"].values():
            groups[(job["rule"], tuple(sorted(job["outputs"].values())))].append((key, job))
    per_rule: dict[str, list] = defaultdict(lambda: [0, 0, 0.0])
    for (rule, _), members in groups.items():
        per_rule[rule][0] += len(members)
        per_rule[rule][1] += len(members) - 1
        per_rule[rule][2] += sum(job["seconds"] for _, job in members[1:])
    print("| rule | jobs | repeats | seconds repeated |")
    print("| --- | ---: | ---: | ---: |")
    for rule, (count, repeats, seconds) in sorted(per_rule.items(), key=lambda kv: -kv[1][2]):
        if repeats:
            print(f"| {rule} | {count} | {repeats} | {seconds:.1f} |")
    print()
    repeated = sorted((m for m in groups.values() if len(m) > 1), key=lambda m: -sum(j["seconds"] for _, j in m[1:]))
    for members in repeated[: args.show]:
        print(f"- {members[0][1]['rule']}: " + ", ".join(key for key, _ in members))


if __name__ == "__main__":
    main()
