"""benchmarks/job_times.py: job count, wall and CPU seconds per rule from Snakemake's benchmark files."""

import importlib.util
import json
import os
from pathlib import Path

import pytest

from graftlab.errors import GraftlabError

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "job_times.py"
spec = importlib.util.spec_from_file_location("job_times", SCRIPT)
job_times = importlib.util.module_from_spec(spec)
spec.loader.exec_module(job_times)

EXTENDED = (
    "s\th:m:s\tmax_rss\tmax_vms\tmax_uss\tmax_pss\tio_in\tio_out\tmean_load\tcpu_time\t"
    "jobid\trule_name\twildcards\tparams\tthreads\tcpu_usage\tresources\tinput_size_mb"
)


def write(path: Path, rule: str, *seconds: float, extended: bool = True, cpu: float = 1.0) -> None:
    """A benchmark file as Snakemake writes it, one row per repeat; a tab inside the params column."""
    header = EXTENDED if extended else "\t".join(EXTENDED.split("\t")[:10])
    rows = [f"{s}\t0:00:0{int(s)}\t1\t2\t3\t4\t0\t0\t50\t{cpu}" for s in seconds]
    if extended:
        rows = [f"{row}\t7\t{rule}\t{{'exp': 'x'}}\t{{'note': 'a\tb'}}\t1\t90\t{{}}\t0" for row in rows]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join([header, *rows]) + "\n")


def test_a_benchmark_file_gives_its_rule_and_mean_seconds(tmp_path):
    write(tmp_path / "x/sft/post/lr~1e-3.tsv", "sft", 10.0, 14.0)
    assert job_times.job_times(tmp_path) == ({"sft": 1}, {"sft": 12.0}, {"sft": 1.0})


def test_jobs_are_summed_per_rule_over_the_tree(tmp_path):
    write(tmp_path / "x/eval/post.tsv", "evaluate", 8.0, cpu=6.0)
    write(tmp_path / "x/eval/sft/post/lr~1/epoch~1.tsv", "evaluate", 4.0, cpu=3.5)
    write(tmp_path / "world/pretrain.tsv", "world_pretrain", 90.0, cpu=170.0)
    count, seconds, cpu = job_times.job_times(tmp_path)
    assert count == {"evaluate": 2, "world_pretrain": 1} and seconds == {"evaluate": 12.0, "world_pretrain": 90.0}
    assert cpu == {"evaluate": 9.5, "world_pretrain": 170.0}
    lines = job_times.table(count, seconds, cpu).splitlines()
    assert lines[2] == "| world_pretrain | 1 | 90 | 90.0 | 170 |" and lines[-1] == "| all jobs | 3 | 102 | | 180 |"


def test_a_warm_job_counts_its_workers_cpu_not_the_waiting_process(tmp_path):
    """A warm job's benchmark times the process that waited (graftlab.io.warm): its worker's usage file
    beside it holds the job's CPU seconds; one older than the job's run is a colder rerun's, and is ignored."""
    bench = tmp_path / "x/eval/post.tsv"
    write(bench, "evaluate", 5.0, cpu=0.2)
    usage = bench.with_name(bench.name + ".worker.json")
    usage.write_text(json.dumps({"cpu_s": 4.5, "max_rss_mb": 300.0}))
    os.utime(bench, (usage.stat().st_mtime + 0.5,) * 2)  # Snakemake writes the benchmark as the job ends
    assert job_times.job_times(tmp_path)[2] == {"evaluate": 4.5}
    os.utime(usage, (bench.stat().st_mtime - 60,) * 2)  # written by a run before this one
    assert job_times.job_times(tmp_path)[2] == {"evaluate": 0.2}


def test_a_file_without_its_rule_is_counted_apart(tmp_path):
    write(tmp_path / "moe.tsv", "moe", 2.0, extended=False)
    assert job_times.job_times(tmp_path)[:2] == ({job_times.UNKNOWN: 1}, {job_times.UNKNOWN: 2.0})
    (tmp_path / "empty.tsv").write_text(EXTENDED + "\n")
    with pytest.raises(GraftlabError, match="without a row"):
        job_times.job_times(tmp_path)


def test_every_rule_that_does_work_writes_a_benchmark_file():
    """job_times reads only benchmark files: a rule without `benchmark:` would drop out of the table."""
    import re

    repo = SCRIPT.parents[1]
    missing, working = [], 0
    for path in [repo / "Snakefile", *sorted((repo / "rules").glob("*.smk"))]:
        for name, body in re.findall(r"^rule (\w+):\n((?:[ \t]+.*\n|\n)*)", path.read_text(), re.M):
            if re.search(r"^\s+(script|shell|run|wrapper|notebook):", body, re.M):
                working += 1
                if not re.search(r"^\s+benchmark:", body, re.M):
                    missing.append(f"{path.name}:{name}")
    assert working >= 25 and not missing


def test_two_runs_are_paired_rule_by_rule_as_the_second_over_the_first(tmp_path):
    write(tmp_path / "cold/x/eval/post.tsv", "evaluate", 8.0)
    write(tmp_path / "cold/x/eval/sft.tsv", "evaluate", 10.0)
    write(tmp_path / "cold/world/pretrain.tsv", "world_pretrain", 90.0)
    write(tmp_path / "warm/x/eval/post.tsv", "evaluate", 2.0)
    write(tmp_path / "warm/x/eval/sft.tsv", "evaluate", 4.0)
    write(tmp_path / "warm/world/pretrain.tsv", "world_pretrain", 81.0)
    write(tmp_path / "warm/x/summary.tsv", "summary", 1.0)  # a rule only the second run has
    lines = job_times.paired(*job_times.timed_runs([tmp_path / "cold", tmp_path / "warm"])).splitlines()
    assert lines[2] == "| world_pretrain | 1 | 90.0 | 81.0 | 0.90 |"
    assert lines[3] == "| evaluate | 2 | 9.0 | 3.0 | 0.33 |"
    assert lines[4] == "| summary | 0 / 1 |  | 1.0 |  |"
    assert lines[-1] == "| all jobs, summed s | 3 | 108 | 88 | 0.81 |"
