"""The tables stages hand each other: one place that refuses a table which cannot serve."""

from pathlib import Path

import polars as pl

from graftlab.errors import GraftlabError

PROBLEM_COLUMNS = ("id", "prompt", "answer")


def read_table(path, columns, name: str, allow_empty: bool = False) -> pl.DataFrame:
    """The parquet at `path`, refused with one line naming `name` and the file when it cannot be read,
    lacks any of `columns`, or (unless `allow_empty`) holds no rows."""
    try:
        frame = pl.read_parquet(Path(path))
    except (OSError, pl.exceptions.PolarsError) as err:
        raise GraftlabError(f"{name} ({path}): cannot read: {' '.join(str(err).split())}") from None
    return require_columns(frame, columns, f"{name} ({path})", allow_empty)


def require_columns(frame: pl.DataFrame, columns, name: str, allow_empty: bool = False) -> pl.DataFrame:
    """`frame`, refused with one line naming `name` when it lacks any of `columns` or holds no rows."""
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise GraftlabError(f"{name} lacks columns {missing}; it has {frame.columns}")
    if frame.is_empty() and not allow_empty:
        raise GraftlabError(f"{name} holds no rows")
    return frame
