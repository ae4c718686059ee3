"""Atomic outputs: a file or directory under its final name is always complete. Snakemake decides what to
re-run by what exists, so a killed job must never leave a half-written output that looks finished.

Standard library only: analysis jobs use this and must not pay for importing torch.
"""

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_file(out: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling of the file ``out`` to write; rename it to ``out`` on success, delete it
    on any exception."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
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
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
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
        old = out.parent / f".{out.name}.old-{os.getpid()}"
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
