"""Warm jobs (graftlab.io.warm): a job handed to the warm process behaves as the same script run cold, in
everything Snakemake and the script can see (exit status, streams, working directory, environment, argv,
signals), and only jobs of the same interpreter and environment are handed over."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graftlab.io import warm

# What the job script reports of its process; then it exits with the status its first argument names,
# raises (`raise`) or sleeps (`sleep:PIDFILE`, writing its pid there first). The job's own variation is in
# its arguments: Snakemake's jobs get theirs in the pickled `snakemake`, and share Snakemake's environment.
JOB = """
from graftlab.io.warm import hand_off

hand_off()

import atexit, json, os, sys, tempfile

code, *args = sys.argv[1:]
# As vLLM shuts its engine's processes down: an exit handler runs as the job ends, warm or cold.
atexit.register(lambda: sys.stderr.write("exit handler\\n"))
sys.stderr.write("to stderr " + " ".join(args) + "\\n")
print(json.dumps({
    "pid": os.getpid(),
    "ppid": os.getppid(),
    "cwd": os.getcwd(),
    "argv": args,
    "tmp": tempfile.gettempdir(),
    "warm": "torch" in sys.modules,
    "path0": sys.path[0],
    "threads": sys.modules["torch"].get_num_threads() if "torch" in sys.modules else None,
}))
sys.stdout.flush()
if code.startswith("sleep:"):
    open(code.removeprefix("sleep:"), "w").write(str(os.getpid()))
    import time
    time.sleep(60)
if code == "raise":
    raise ValueError("the job's own error")
sys.exit(int(code))
"""


# The environment the warm process and every job here start with, as Snakemake's jobs share Snakemake's
# (pytest's own per-test variable left out: it changes from test to test).
BASE = {k: v for k, v in os.environ.items() if k not in (warm.ENV, "PYTEST_CURRENT_TEST")}
BASE["PYTHONPATH"] = str(Path(warm.__file__).resolve().parents[2]) + os.pathsep + BASE.get("PYTHONPATH", "")
BASE["PS1"] = "(venv) $ "  # as an activated virtualenv exports it; the shell of a job drops it


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A warm process, started as the Snakefile starts it, with the job script's directory as the scripts
    it preloads for (the script imports nothing of graftlab but hand_off)."""
    scripts = tmp_path_factory.mktemp("scripts")
    (scripts / "job.py").write_text(JOB)
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(BASE)
    try:
        proc = warm.start(scripts)
        sock = os.environ[warm.ENV]
    finally:
        os.environ.clear()
        os.environ.update(saved)
    assert proc is not None
    yield proc, scripts / "job.py", sock
    proc.kill()
    proc.wait()


def run_job(script: Path, cwd: Path, env: dict, *args: str, python: str = sys.executable):
    proc = subprocess.run([python, str(script), *args], cwd=cwd, env=env, capture_output=True, text=True)
    report = json.loads(proc.stdout.splitlines()[0]) if proc.stdout.strip() else None
    return proc, report


def job_env(sock: str | None, **extra: str) -> dict:
    return BASE | ({warm.ENV: sock} if sock else {}) | extra


def test_a_handed_off_job_runs_forked_from_the_warm_process_as_its_own_job(server, tmp_path):
    proc, script, sock = server
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    done, report = run_job(script, tmp_path, job_env(sock, TMPDIR=str(tmp)), "3", "a b", "c")
    assert done.returncode == 3
    assert report["warm"] and report["ppid"] == proc.pid  # forked from the warm process, torch imported
    assert report["cwd"] == str(tmp_path) and report["argv"] == ["a b", "c"]
    assert report["tmp"] == str(tmp)  # the job's TMPDIR, which Snakemake sets per job
    assert report["path0"] == str(script.parent)  # as `python script.py` has it
    assert done.stderr == "to stderr a b c\nexit handler\n"


def test_a_job_started_through_a_shell_as_snakemake_starts_it_runs_warm(server, tmp_path):
    """Snakemake runs `python script` through bash, which sets `_`, SHLVL and PWD and unsets PS1."""
    proc, script, sock = server
    done = subprocess.run(
        ["bash", "-c", f"{sys.executable} {script} 6 x"],
        cwd=tmp_path,
        env=job_env(sock),
        capture_output=True,
        text=True,
    )
    assert done.returncode == 6, done.stderr
    assert json.loads(done.stdout)["ppid"] == proc.pid


def test_a_job_that_raises_exits_1_with_its_traceback(server, tmp_path):
    _, script, sock = server
    done, report = run_job(script, tmp_path, job_env(sock), "raise")
    assert report["warm"] and done.returncode == 1
    assert "ValueError: the job's own error" in done.stderr


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    code=st.integers(0, 255),
    args=st.lists(st.text(st.characters(blacklist_categories=["Cs"], blacklist_characters="\0"), max_size=8)),
)
def test_warm_and_cold_jobs_are_alike_in_status_streams_and_arguments(server, tmp_path, code, args):
    _, script, sock = server
    results = []
    for where in (sock, None):
        done, report = run_job(script, tmp_path, job_env(where), str(code), *args)
        assert report["warm"] == (where is not None)
        results.append((done.returncode, done.stderr, {k: report[k] for k in ("cwd", "argv", "tmp", "path0")}))
    assert results[0] == results[1]


def test_jobs_of_another_interpreter_or_environment_run_cold(server, tmp_path):
    _, script, sock = server
    # An environment variable an import may read (not one Snakemake sets per job): cold.
    done, report = run_job(script, tmp_path, job_env(sock, HF_HUB_OFFLINE="0"), "4")
    assert done.returncode == 4 and not report["warm"] and report["ppid"] != server[0].pid
    # The thread counts Snakemake sets per job do not matter: the worker gives torch the job's own.
    _, report = run_job(script, tmp_path, job_env(sock, OMP_NUM_THREADS="3", MKL_NUM_THREADS="3"), "0")
    assert report["warm"] and report["threads"] == 3
    # Another interpreter (the machine's own Python, not this virtualenv's): cold.
    other = "/usr/bin/python3"
    if Path(other).resolve() == Path(sys.executable).resolve() or sys.prefix == sys.base_prefix:
        pytest.skip("no second interpreter here")
    done, report = run_job(script, tmp_path, job_env(sock), "5", python=other)
    assert done.returncode == 5 and not report["warm"]


def test_the_code_stamp_moves_with_any_edit_to_a_source_file(tmp_path):
    """An edit to graftlab during a run sends the jobs after it cold, to the code on disk."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    for name in ("a.py", "sub/b.py"):
        (package / name).write_text("x = 1\n")
        os.utime(package / name, ns=(10**18, 10**18))
    stamp = warm._code_stamp(package)
    assert warm._code_stamp(package) == stamp
    os.utime(package / "sub/b.py", ns=(10**18, 10**18 + 1))  # touched
    assert warm._code_stamp(package) != stamp
    os.utime(package / "sub/b.py", ns=(10**18, 10**18))
    (package / "sub/b.py").write_text("x = 12\n")  # rewritten, the time set back
    os.utime(package / "sub/b.py", ns=(10**18, 10**18))
    assert warm._code_stamp(package) != stamp
    (package / "sub/b.py").unlink()  # removed
    assert warm._code_stamp(package) != stamp


def test_no_warm_process_listening_means_a_cold_job(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    done, report = run_job(script, tmp_path, job_env(str(tmp_path / "no-socket")), "2")
    assert done.returncode == 2 and not report["warm"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(") ")[1].startswith("Z"))


def _wait_for(check, seconds: float = 10.0) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if check():
            return True
        time.sleep(0.05)
    return check()


def _start_sleeping_job(script: Path, tmp_path: Path, sock: str) -> tuple[subprocess.Popen, int]:
    pidfile = tmp_path / "worker.pid"
    proc = subprocess.Popen(
        [sys.executable, str(script), f"sleep:{pidfile}"], cwd=tmp_path, env=job_env(sock), stdout=subprocess.DEVNULL
    )
    assert _wait_for(lambda: pidfile.exists() and pidfile.read_text().strip())
    return proc, int(pidfile.read_text())


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_job_stops_its_worker_and_the_job_dies_of_it(server, tmp_path, sig):
    _, script, sock = server
    proc, worker = _start_sleeping_job(script, tmp_path, sock)
    assert worker != proc.pid
    proc.send_signal(sig)
    assert proc.wait(timeout=10) == -sig
    assert _wait_for(lambda: not _alive(worker))


def test_a_job_killed_outright_takes_its_worker_along(server, tmp_path):
    _, script, sock = server
    proc, worker = _start_sleeping_job(script, tmp_path, sock)
    proc.kill()
    proc.wait()
    assert _wait_for(lambda: not _alive(worker)), "the worker outlived its killed job"


def test_the_warm_process_dies_with_the_process_that_started_it(tmp_path):
    """Snakemake killed -9 leaves no warm process behind (PR_SET_PDEATHSIG)."""
    code = (
        "import sys; from pathlib import Path; from graftlab.io import warm; "
        f"p = warm.start(Path({str(tmp_path)!r})); print(p.pid, flush=True); import time; time.sleep(60)"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=job_env(None))
    pid = int(parent.stdout.readline())
    assert _alive(pid)
    parent.kill()
    parent.wait()
    assert _wait_for(lambda: not _alive(pid)), "the warm process outlived the process that started it"


def test_stopping_the_warm_process_at_the_runs_end_leaves_neither_it_nor_its_socket(tmp_path, monkeypatch):
    """One socket directory per run under /tmp: they piled up before the Snakefile's onsuccess and onerror
    stopped the warm process."""
    monkeypatch.delenv(warm.ENV, raising=False)
    proc = warm.start(tmp_path)
    sock = Path(os.environ[warm.ENV])
    assert proc is not None and sock.exists()
    warm.stop(proc)
    assert proc.poll() is not None and not sock.parent.exists() and warm.ENV not in os.environ


def test_a_worker_records_its_own_cpu_and_memory_beside_the_jobs_benchmark(server, tmp_path):
    """`graftlab inspect` reads the worker's usage: Snakemake's benchmark measures the waiting process."""
    from graftlab.commands.inspect_results import job_usage

    _, _, sock = server
    script = tmp_path / "spin.py"
    script.write_text(
        "from graftlab.io.warm import hand_off\nhand_off()\n"
        "import time\nfrom types import SimpleNamespace\n"
        "snakemake = SimpleNamespace(log=['logs/x/job.log'], bench_iteration=0)\n"
        "end = time.process_time() + 0.5\nwhile time.process_time() < end: pass\n"
    )
    start = time.time()
    done, _ = run_job(script, tmp_path, job_env(sock))
    assert done.returncode == 0, done.stderr
    usage = json.loads(warm.usage_file(tmp_path / "benchmarks/jobs/x/job.tsv").read_text())
    assert usage["cpu_s"] >= 0.5 and usage["max_rss_mb"] > 50  # torch's libraries are resident
    bench = tmp_path / "benchmarks/jobs/x/job.tsv"
    bench.write_text(f"s\th:m:s\tmax_rss\tcpu_time\n{time.time() - start + 0.1:.2f}\t0\t12.0\t0.01\n")
    read = job_usage(bench)
    assert read["cpu_time"] == usage["cpu_s"] and read["max_rss"] == usage["max_rss_mb"]
    # A benchmark written later than its job's span (a cold rerun's) keeps Snakemake's own figures.
    later = time.time() + 100
    os.utime(bench, (later, later))
    assert job_usage(bench)["cpu_time"] == 0.01
