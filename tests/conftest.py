"""Shared fixtures: pico Qwen3 models built locally (no hub access), small enough for unit tests."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from graftlab.io.atomic import atomic_file

# One torch thread in the tests and in the processes they start (os.environ is inherited): the whole
# workflow runs go on beside them (`background`), and torch processes that spin on more threads than
# the cores left to them run several times slower (docs/methods.md#jobs-threads-and-start-up).
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def build_pico_model(
    out: Path,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    max_shard_size: int | str | None = None,
    base: Path | None = None,
    noise: float = 0.0,
    **config: object,
) -> Path:
    """Save a tiny random Qwen3ForCausalLM (hidden 16, 2 layers, vocab 32 unless ``config`` overrides).

    With ``base``, start from that saved model instead and add ``noise``-scaled Gaussian noise to every
    parameter: a stand-in for fine-tuning that keeps the shapes and config of ``base``.
    """
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    if base is not None:
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(noise * torch.randn_like(param))
    else:
        defaults = dict(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            vocab_size=32,
            max_position_embeddings=64,
        )
        model = Qwen3ForCausalLM(Qwen3Config(**{**defaults, **config}))
        with torch.no_grad():
            # Random norms too (they initialise to ones), so every tensor differs between models.
            for param in model.parameters():
                param.add_(0.02 * torch.randn_like(param))
    model.to(dtype)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out, **kwargs)
    return out


@pytest.fixture
def pico_model(tmp_path: Path) -> Callable[..., Path]:
    """Factory: ``pico_model("name", seed=..., dtype=..., max_shard_size=..., base=..., noise=...,
    **qwen3_config)`` saves a pico model under ``tmp_path/name`` and returns its directory."""

    def make(name: str = "model", **kwargs: object) -> Path:
        return build_pico_model(tmp_path / name, **kwargs)

    return make


REPO = Path(__file__).resolve().parents[1]
SMOKE = REPO / "configs" / "smoke.yaml"


def new_data(exp: str, part: str, config: Path = SMOKE) -> str:
    """Where `config`'s experiment `exp` keeps its new-task problems (`train`, `heldout`): mined ones in the
    mining home it shares with the experiments that mine alike (graftlab.planning.layout)."""
    import yaml

    from graftlab.planning.config import resolve
    from graftlab.planning.layout import Experiment

    return Experiment.of(resolve(yaml.safe_load(config.read_text())), exp).new_data(part)


# The tiny world's architecture at its smallest, with the world's character tokenizer: what a trainer test
# trains in seconds (SFT, OPSD, the teacher, resume).
WORLD_PICO = dict(hidden_size=16, intermediate_size=32, layers=1, heads=2, kv_heads=1, max_positions=256)


@pytest.fixture(scope="session")
def world_pico(tmp_path_factory) -> Path:
    """A model directory of WORLD_PICO at seed 0, with its tokenizer; tests only read it."""
    from graftlab.world import build
    from graftlab.world.tokenizer import build_tokenizer

    path = tmp_path_factory.mktemp("world-pico")
    tok = build_tokenizer()
    build.init_model(tok, WORLD_PICO, seed=0).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def model_weights(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a model directory's single `model.safetensors`."""
    from safetensors.torch import load_file

    return load_file(path / "model.safetensors")


def assert_same_weights(a: Path, b: Path, atol: float | None = None) -> None:
    """Two model directories hold the same tensors: bit for bit, or within `atol` (and torch's default rtol)."""
    x, y = model_weights(a), model_weights(b)
    assert x.keys() == y.keys()
    for name in x:
        same = torch.equal(x[name], y[name]) if atol is None else torch.allclose(x[name], y[name], atol=atol)
        assert same, (a, b, name, (x[name] - y[name]).abs().max())


def dead_pid() -> int:
    """The pid of a process that has just ended: dead on this host (pids are reused only after wrapping)."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def snakemake_cmd(workdir: Path, *args: str, configs: tuple[Path, ...] = (SMOKE,)) -> list[str]:
    cmd = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--directory", str(workdir)]
    cmd += ["--configfile", *map(str, configs)] if configs else []
    return cmd + list(args)


def snakemake(workdir: Path, *args: str, configs: tuple[Path, ...] = (SMOKE,)) -> subprocess.CompletedProcess:
    return subprocess.run(snakemake_cmd(workdir, *args, configs=configs), capture_output=True, text=True, cwd=workdir)


def job_requests(dry_run_output: str) -> list[tuple[str, dict[str, str]]]:
    """(rule, resources) of every job a dry-run printed, in its order."""
    jobs = re.findall(r"^(?:local)?rule (\w+):\n(?:    .*\n)*?    resources: (.*)$", dry_run_output, re.M)
    return [(rule, dict(kv.split("=", 1) for kv in res.split(", "))) for rule, res in jobs]


# Whole workflow runs are most of the suite's time, and a run's jobs are mostly process start-up and tiny
# models on one thread: they are started in the background when the session starts and run beside the
# other tests, each test that reads one waiting for it (`Background.wait`). Every job gets one thread
# (--max-threads 1) so that no torch process spins on a core another process holds.
# One temporary graft at a time: the cap's test (test_workflow) reads that none overlapped.
WHOLE_RUN = ("--cores", "2", "--max-threads", "1", "--resources", "temp_grafts=1", "--quiet")
# fixture name -> (module file that defines the fixture, or None for conftest's; prepare(workdir) -> the
# snakemake arguments after the workdir, as `snakemake` takes them).
BACKGROUND: dict[str, tuple[str | None, Callable[[Path], tuple[tuple[str, ...], tuple[Path, ...]]]]] = {}


def in_background(fixture: str, module: str | None = None):
    """Register ``prepare(workdir) -> (args, configs)`` as the whole run behind ``fixture``: started when
    the session starts if a selected test uses that fixture (of that module: its ``__file__``)."""

    def register(prepare):
        BACKGROUND[fixture] = (module, prepare)
        return prepare

    return register


@in_background("smoke")
def _smoke_run(workdir: Path) -> tuple[tuple[str, ...], tuple[Path, ...]]:
    return WHOLE_RUN, (SMOKE,)


class Background:
    """The whole runs some selected test needs, each started once a session, at its start.

    Under pytest-xdist the workers share them: a run lives in a directory beside the workers' own
    (`shared`), the first worker to create it starts the run, and a thread of that worker writes the
    run's exit status there when it ends (`exit`). Any worker's test waits for that file, so the worker
    that started a run waits for it too before it ends (another may still need it)."""

    def __init__(self, shared: Path) -> None:
        self.shared = shared
        self.runs: dict[str, tuple[subprocess.Popen, threading.Thread]] = {}

    def start(self, fixture: str) -> None:
        home = self.shared / f"background-{fixture}"
        try:
            home.mkdir()
        except FileExistsError:
            return  # started by this worker or another
        workdir = home / "work"
        workdir.mkdir()
        args, configs = BACKGROUND[fixture][1](workdir)
        with open(home / "stderr.txt", "w") as stderr:
            proc = subprocess.Popen(
                snakemake_cmd(workdir, *args, configs=configs),
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                cwd=workdir,
                start_new_session=True,
            )

        (home / "pid").write_text(str(proc.pid))

        def reap() -> None:
            code = proc.wait()
            with atomic_file(home / "exit") as tmp:  # whole or absent: another worker may be reading it
                tmp.write_text(str(code))

        self.runs[fixture] = (proc, threading.Thread(target=reap, daemon=True))
        self.runs[fixture][1].start()

    def wait(self, fixture: str) -> Path:
        """The run's workdir once it has finished, asserting that it succeeded."""
        self.start(fixture)  # not started at the session's start (a fixture of another module): now
        home = self.shared / f"background-{fixture}"
        while not (home / "exit").exists():
            time.sleep(0.5)
            if not (home / "exit").exists() and not _alive(home / "pid"):
                time.sleep(2)  # reaped a moment ago: its status is being written
                assert (home / "exit").exists(), f"the {fixture} run ended and its starter wrote no status: {home}"
        assert (home / "exit").read_text() == "0", (home / "stderr.txt").read_text()[-3000:]
        return home / "work"

    def stop(self, interrupted: bool) -> None:
        """Kill this worker's runs if the session was cut short; otherwise wait for them to end."""
        for proc, reaper in self.runs.values():
            if interrupted and proc.poll() is None:
                os.killpg(proc.pid, 9)
            reaper.join()


def _alive(pid_file: Path) -> bool:
    """Whether the process named in `pid_file` exists (a run being started has not written it yet)."""
    try:
        os.kill(int(pid_file.read_text()), 0)
    except (FileNotFoundError, ValueError):
        return True
    except ProcessLookupError:
        return False
    return True


def _uses(item: pytest.Item, fixture: str, module: str | None) -> bool:
    defs = item._fixtureinfo.name2fixturedefs.get(fixture)
    if not defs:
        return False
    return Path(defs[-1].func.__code__.co_filename).resolve() == Path(module or __file__).resolve()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--determinism",
        action="store_true",
        help="also run the tests marked determinism: configs/smoke.yaml run whole a second time, beside the first",
    )


def pytest_collection_modifyitems(config, items: list[pytest.Item]) -> None:
    """Deselect the determinism tests unless asked for (a second whole smoke run doubles the suite's
    critical path); then tests that wait for a whole run go last, in their order: one early in the file
    order would hold every later unit test until the run is done, when they should run beside it."""
    if not config.getoption("--determinism"):
        skipped = [item for item in items if item.get_closest_marker("determinism")]
        if skipped:
            config.hook.pytest_deselected(items=skipped)
            items[:] = [item for item in items if not item.get_closest_marker("determinism")]
    waits = {id(item) for item in items if any(_uses(item, f, m) for f, (m, _) in BACKGROUND.items())}
    items.sort(key=lambda item: id(item) in waits)


@pytest.fixture(scope="session", autouse=True)
def background(request, tmp_path_factory):
    """Starts, before the first test, every registered whole run that a selected test uses."""
    base = tmp_path_factory.getbasetemp()
    runs = Background(base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base)
    for fixture, (module, _) in BACKGROUND.items():
        if any(_uses(item, fixture, module) for item in request.session.items):
            runs.start(fixture)
    yield runs
    session = request.session
    cut_short = session.shouldstop or session.shouldfail or session.exitstatus == pytest.ExitCode.INTERRUPTED
    runs.stop(interrupted=bool(cut_short))


@contextlib.contextmanager
def kept_environment():
    """os.environ as it was on entry, restored on exit."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


# Each test and each module starts from the session's environment. Code under test sets process-wide
# variables (an in-process engine's rendezvous: RANK, WORLD_SIZE, MASTER_PORT; accelerate's precision; a
# tracker's directory) that would otherwise reach the later tests of its worker and every process they
# start: a workflow job that inherited a rendezvous joined a process group on its port, which a test in
# another worker held. A module's fixtures set some of them, hence the module scope too.
@pytest.fixture(autouse=True, scope="module")
def module_environment():
    with kept_environment():
        yield


@pytest.fixture(autouse=True)
def environment():
    with kept_environment():
        yield


@pytest.fixture(scope="session")
def smoke(background) -> Path:
    """configs/smoke.yaml run once, whole, for every workflow test module."""
    return background.wait("smoke")


def graft_args(post: Path, donor: Path, tuned: Path, scale: str, out: Path) -> list[str]:
    """The arguments of `graftlab graft` for one graft, after the subcommand."""
    return [
        "--post",
        str(post),
        "--donor",
        str(donor),
        "--donor-tuned",
        str(tuned),
        "--scale",
        scale,
        "--out",
        str(out),
    ]


def mul_traces(count: int) -> list[dict]:
    """`count` multiplication problems of the world with their whole chat completions: SFT and OPSD data."""
    from graftlab.tasks import arith, chat_completion

    problems = arith.sample_problems("mul", count, "t", 0)
    return [dict(p, completion=chat_completion(p["thinking"], p["answer"])) for p in problems]
