"""Warm jobs: a local workflow run imports torch, transformers and graftlab once, in one process, and every
job of the run is forked from it instead of starting a cold interpreter.

Why by hand: most of a tiny-world job is start-up (`benchmarks/startup_bench.py`: about 5 s of an evaluation
job's 9 on 2 cores), and Snakemake starts every `script:` job as a fresh interpreter. The standard library's
forkserver preloads modules for the children of one Python program only; a Snakemake job is a process of
its own, so it hands its work over a Unix socket instead:

- `start()` (the Snakefile's `onstart`, local runs with `warm_jobs` on) starts `python -m graftlab.io.warm`,
  which imports what the workflow scripts import and then forks one worker per job it is sent. It dies with
  Snakemake (PR_SET_PDEATHSIG) and stays in Snakemake's process group, so a kill of the group takes it and
  its workers along. It prints a line on Snakemake's output for every job it sends back cold.
- `hand_off()`, the first statement of every workflow script, sends the job's argv, working directory,
  environment and standard streams to that process and waits for the worker's exit status, which it
  exits with. The worker runs the same script file from its first line, with everything imported;
  there, and wherever no warm process of the same interpreter, environment, graftlab code and host is
  listening (a cluster job, a conda or container job, a fetch job, a job started after an edit to
  graftlab), `hand_off()` returns and the script runs in the process Snakemake started.

A worker lives no longer than its job's process: a signal that process gets (Snakemake cancelling the
job) is forwarded, and a job process killed outright closes the socket, on which the worker kills itself.
Snakemake's `benchmark:` file times the job's process: its wall seconds are the job's, its CPU seconds
and peak memory the waiting process's. The worker writes its own beside it (`usage_file`), which
`graftlab inspect` reads instead.
"""

from __future__ import annotations

import ast
import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from graftlab.io.joblog import benchmark_of

ENV = "GRAFTLAB_WARM"  # the socket's path, in the environment Snakemake gives its jobs
WORKER = "GRAFTLAB_WARM_WORKER"  # set in a worker: hand_off() returns there
# What is imported lazily, past the workflow scripts' own imports: by transformers at a model's first load
# (torch's distributed and compiler modules, sympy: 1,100 modules, 2.4 s of `benchmarks/startup_bench.py`,
# found by diffing sys.modules around AutoModelForCausalLM.from_pretrained and a tokenizer's load), and by
# graftlab's plots (matplotlib, about 1 s of each analysis job).
LAZY = (
    "transformers.models.auto.modeling_auto",
    "transformers.models.qwen3.modeling_qwen3",
    "transformers.integrations.tensor_parallel",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "torch._dynamo",
    "sympy",
    "accelerate",
    "matplotlib.figure",
    "matplotlib.backends.backend_agg",
)
PACKAGE = Path(__file__).resolve().parents[1]  # graftlab's source
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# The thread counts Snakemake sets per job (snakemake.shell). The warm process imports with one thread
# each (no thread pool may exist when it forks: a forked OpenMP pool hangs); a worker gives torch its
# job's count, as a cold process's OpenMP would have read it.
THREADS = (
    "OMP_NUM_THREADS",
    "GOTO_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "MKL_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "NUMEXPR_NUM_THREADS",
)
# What a job's environment may hold apart from the warm process's: its thread counts, its temporary
# directory (which a worker reads anew), and the bookkeeping of the shell Snakemake runs each job through
# (bash sets `_`, SHLVL and PWD, and unsets PS1 in a script). Any other variable may be read at import
# (HF_HUB_OFFLINE by huggingface_hub, say), so a job whose environment differs in one runs cold.
PER_JOB = {
    *THREADS,
    "TMPDIR",
    "TMP",
    "TEMPDIR",
    "TEMP",
    *("_", "SHLVL", "PWD", "OLDPWD", "PS1", "PS2"),
}


def identity() -> dict:
    """What a job and the warm process must share: the interpreter, the environment its imports read
    (all of it but PER_JOB), graftlab's code as it is on disk (an edit during a run reaches the jobs
    started after it, as it would cold) and the host."""
    env = {k: v for k, v in os.environ.items() if k not in PER_JOB and k not in (ENV, WORKER)}
    python = {"python": os.path.realpath(sys.executable), "prefix": sys.prefix}
    return python | {"env": env, "code": _code_stamp(), "host": socket.gethostname()}


def _code_stamp(package: Path = PACKAGE) -> str:
    """The size and modification time of every source file of `package` (graftlab's), hashed: a stat
    each, no file is read."""
    import hashlib

    stats = sorted((str(p.relative_to(package)), p.stat()) for p in package.rglob("*.py"))
    return hashlib.sha1(repr([(name, st.st_mtime_ns, st.st_size) for name, st in stats]).encode()).hexdigest()


def start(scripts: Path):
    """Start the warm process, preloading what the workflow scripts in `scripts` import, and point this
    process's jobs at it (os.environ, which they inherit). Returns the process once it listens (a job that
    connects while it still imports waits, as it would have for its own imports), or None if it failed
    to start (its error is on stderr; the jobs start cold)."""
    import subprocess
    import tempfile

    # Under /tmp: a socket's path has at most 107 bytes, and a workflow's directory may be deeper.
    sock = Path(tempfile.mkdtemp(prefix="graftlab-warm-")) / "socket"
    proc = subprocess.Popen(
        [sys.executable, "-m", "graftlab.io.warm", str(sock), str(scripts), str(os.getpid())],
        stdin=subprocess.DEVNULL,
        # os.environ, as Snakemake gives its jobs (snakemake.shell), not the C library's environment:
        # a library may have set a variable there that os.environ never saw (a terminal's COLUMNS).
        env=dict(os.environ),
    )
    while not sock.exists():
        if proc.poll() is not None:
            return None
        time.sleep(0.01)
    os.environ[ENV] = str(sock)
    return proc


def stop(proc) -> None:
    """End the warm process `start` returned, and remove its socket's directory (one per run, under /tmp)."""
    import shutil

    proc.kill()
    proc.wait()
    if sock := os.environ.pop(ENV, None):
        shutil.rmtree(Path(sock).parent, ignore_errors=True)


def _die_with(parent: int) -> None:
    """Be killed when `parent` dies (set here, not in a preexec_fn: Snakemake's process has threads)."""
    import ctypes

    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before the line above
        os._exit(1)


def hand_off() -> None:
    """Run this job in the warm process and exit with its status; return if there is none to use."""
    path = os.environ.get(ENV)
    if not path or os.environ.get(WORKER):
        return
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
    except OSError:
        return  # no warm process here (it has stopped, or this is another host)
    request = json.dumps({"identity": identity(), "argv": sys.argv, "cwd": os.getcwd(), "env": dict(os.environ)})
    data = request.encode()
    try:
        socket.send_fds(conn, [len(data).to_bytes(8, "big") + data], [0, 1, 2])
    except OSError:  # a standard stream closed (nothing to pass on), or the warm process gone: cold
        conn.close()
        return
    replies = conn.makefile("rb")  # the worker's pid, then its exit status: a line each
    reply = replies.readline().strip()
    if not reply.isdigit():  # "cold": another interpreter or host; nothing: the warm process is gone
        conn.close()
        return
    worker, forwarded = int(reply), []

    def forward(sig, _frame):
        forwarded.append(sig)
        os.kill(worker, sig)

    for sig in SIGNALS:
        signal.signal(sig, forward)
    status = replies.readline().strip()
    if not status and forwarded:  # the worker died of the signal it was sent: so does this process
        signal.signal(forwarded[-1], signal.SIG_DFL)
        os.kill(os.getpid(), forwarded[-1])
    # No status otherwise: the worker was killed (the OOM killer, a segfault) before it could send one.
    os._exit(int(status) if status else 1)


def usage_file(benchmark: Path) -> Path:
    """Where a worker writes its CPU seconds and peak memory: beside the job's Snakemake benchmark file."""
    return benchmark.with_name(benchmark.name + ".worker.json")


def _preload(scripts: Path) -> None:
    """Import the libraries and every graftlab module a workflow script imports."""
    import importlib

    import torch

    torch.set_num_threads(1)
    for name in LAZY:
        importlib.import_module(name)
    for script in sorted(scripts.glob("*.py")):
        for node in ast.walk(ast.parse(script.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("graftlab"):
                importlib.import_module(node.module)


def serve(sock: Path, scripts: Path, parent: int) -> None:
    """Listen at `sock`, preload, then fork a worker for every job that connects, until `parent` dies."""
    _die_with(parent)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    umask = os.umask(0o177)  # the socket is the user's alone
    server.bind(str(sock))
    os.umask(umask)
    server.listen(64)
    own, before = identity(), dict(os.environ)  # what a cold job would import under
    os.environ.update(dict.fromkeys(THREADS, "1"))
    _preload(scripts)
    # What the imports set in the environment, as they would have in the job's own process.
    imported = {k: v for k, v in os.environ.items() if before.get(k) != v and k not in PER_JOB}
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the workers
    while True:
        conn, _ = server.accept()
        request, fds = _receive(conn)
        if request is not None and request["identity"] != own:
            conn.sendall(b"cold\n")
            print(
                f"graftlab.io.warm: {request['argv'][0]} runs cold: {_difference(own, request['identity'])}",
                file=sys.stderr,
            )
        elif request is not None and os.fork() == 0:
            server.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            _work(conn, fds, request | {"env": request["env"] | imported})
        conn.close()
        for fd in fds:
            os.close(fd)


def _difference(own: dict, job: dict) -> str:
    if own["env"] != job["env"]:
        keys = sorted(k for k in own["env"].keys() | job["env"].keys() if own["env"].get(k) != job["env"].get(k))
        return "its environment differs in " + ", ".join(
            f"{k} ({job['env'].get(k)!r}, not {own['env'].get(k)!r})" for k in keys
        )
    if own["code"] != job["code"]:
        return "graftlab's code has changed since the warm process imported it"
    return ", ".join(f"its {k} is {job[k]}, not {own[k]}" for k in own if own[k] != job[k])


def _receive(conn: socket.socket) -> tuple[dict | None, list[int]]:
    """A job's request and its three standard streams; None if its process died while sending it."""
    try:
        msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    except OSError:
        return None, []
    try:
        while msg and len(msg) < 8 + int.from_bytes(msg[:8].ljust(8, b"\0"), "big"):
            chunk = conn.recv(1 << 20)
            if not chunk:
                return None, fds
            msg += chunk
        return (json.loads(msg[8:]) if len(fds) == 3 else None), fds
    except (OSError, ValueError):
        return None, fds


def _work(conn: socket.socket, fds: list[int], request: dict) -> None:
    """In the forked worker: become the job's process, run its script, send its exit status."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    os.environ[WORKER] = "1"
    import tempfile

    tempfile.tempdir = None  # read again from this job's TMPDIR
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    sys.argv = request["argv"]
    sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))  # as `python script.py` has it
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    conn.sendall(f"{os.getpid()}\n".encode())

    def orphaned() -> None:  # the job's process is gone (killed outright): so is its work
        conn.recv(1)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=orphaned, daemon=True).start()
    import atexit
    import runpy
    import traceback

    status, script = 0, {}
    try:
        script = runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as exit:
        status = exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
        if not isinstance(exit.code, int | None):
            print(exit.code, file=sys.stderr)
    except BaseException as error:
        traceback.print_exc()
        status = 1
        if isinstance(error, KeyboardInterrupt):  # Python dies of the SIGINT it did not handle: so does this
            atexit._run_exitfuncs()
            sys.stderr.flush()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
    # The exit handlers an interpreter runs as it ends, which os._exit below would skip: vLLM's shuts its
    # engine's processes down there (without it each sampling job left a 1 GB worker process behind).
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    _record_usage(script.get("snakemake"))
    conn.sendall(f"{status}\n".encode())
    os._exit(status)


def _record_usage(job) -> None:
    """The worker's CPU seconds and peak RSS beside its job's benchmark file (`graftlab inspect` reads it)."""
    logs = list(getattr(job, "log", None) or [])
    if getattr(job, "bench_iteration", None) is None or not logs or benchmark_of(str(logs[0])) is None:
        return  # a job without a benchmark file
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    path = usage_file(Path(benchmark_of(str(logs[0]))))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"cpu_s": usage.ru_utime + usage.ru_stime, "max_rss_mb": usage.ru_maxrss / 1024}))
    except OSError as err:  # a record the job's outcome does not hang on
        print(f"graftlab.io.warm: no usage record at {path}: {err}", file=sys.stderr)


if __name__ == "__main__":
    serve(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]))
