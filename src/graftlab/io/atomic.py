"""Atomic outputs: a file or directory under its final name is always complete. Snakemake decides what to
re-run by what exists, so a killed job must never leave a half-written output that looks finished.

Standard library only: analysis jobs use this and must not pay for importing torch.
"""

import contextlib
import glob
import os
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path

# Temporary siblings are named after the host and process writing them: a kill -9 leaves its sibling
# behind, and only a writer on the same host can tell whether that process is dead (pids are per host,
# and a results directory may be shared by a cluster's nodes).
HOST = socket.gethostname().replace("/", "_")
KINDS = ("tmp", "old")


def _sibling(out: Path, kind: str) -> Path:
    return out.parent / f".{out.name}.{kind}-{HOST}-{os.getpid()}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return True


def clean_stale(out: str | Path) -> list[Path]:
    """Remove the temporary siblings of `out` that killed writers on this host left behind (their
    process is gone); return them. A rerun calls this first, so kills never pile up copies."""
    out = Path(out)
    stale = []
    for kind in KINDS:
        prefix = f".{out.name}.{kind}-"
        for path in out.parent.glob(glob.escape(prefix) + "*"):
            # Exactly this host's: a host whose name extends ours (`node1-b` beside `node1`) matches the glob.
            host, _, pid = path.name[len(prefix) :].rpartition("-")
            if host == HOST and pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
                stale.append(path)
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
    return stale


@contextlib.contextmanager
def atomic_file(out: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling of the file ``out`` to write; rename it to ``out`` on success, delete it
    on any exception."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(out)
    tmp = _sibling(out, "tmp")
    try:
        yield tmp
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, out)


@contextlib.contextmanager
def atomic_dir(out: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling of ``out`` to fill; rename it to ``out`` on success (replacing an
    existing ``out``), delete it on any exception. A directory named ``out`` is thus always complete."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(out)
    tmp = _sibling(out, "tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # left by a killed earlier run with a recycled pid
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        # A directory cannot be renamed over a non-empty one: move the old one aside first, so the
        # window in which `out` is absent is two renames long and never shows a partial directory.
        old = _sibling(out, "old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)


def write_json(out: str | Path, record) -> None:
    """`record` as indented JSON, atomically."""
    import json

    with atomic_file(out) as tmp:
        tmp.write_text(json.dumps(record, indent=2) + "\n")


def write_table_with_stats(table, stats: dict, out: str | Path, stats_out: str | Path) -> None:
    """A data stage's two outputs, each atomic: the stats JSON first, then the table (anything with a
    `write_parquet`, e.g. a polars frame), so a table under its final name always has its stats."""
    write_json(stats_out, stats)
    with atomic_file(out) as tmp:
        table.write_parquet(tmp)


def remove_tree(path: str | Path) -> None:
    """Remove a finished job's working tree (its resume state, its chunk store) and the folders above it that
    this leaves empty, up to the working directory: a sweep's would pile up. Jobs finishing at once share
    those folders, so one may be gone or filled again between two steps; either ends the walk."""
    shutil.rmtree(path, ignore_errors=True)
    for parent in Path(path).parents:
        if parent == Path("."):
            break
        try:
            parent.rmdir()  # an empty folder only
        except OSError:  # not empty, or already removed by another job
            break
