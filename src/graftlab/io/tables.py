"""The tables stages hand each other: one place that refuses a table which cannot serve."""

from pathlib import Path

import polars as pl

from graftlab.errors import GraftlabError

PROBLEM_COLUMNS = ("id", "prompt", "answer")
TRACE_COLUMNS = ("prompt", "completion")


def read_table(path, columns, name: str, allow_empty: bool = False, text=()) -> pl.DataFrame:
    """The parquet at `path`, refused with one line naming `name` and the file when it cannot be read,
    lacks any of `columns`, (unless `allow_empty`) holds no rows, or holds in a `text` column anything
    but a string with a word in it."""
    try:
        frame = pl.read_parquet(Path(path))
    except (OSError, pl.exceptions.PolarsError) as err:
        raise GraftlabError(f"{name} ({path}): cannot read: {' '.join(str(err).split())}") from None
    return require_text(require_columns(frame, columns, f"{name} ({path})", allow_empty), text, f"{name} ({path})")


def read_traces(path) -> pl.DataFrame:
    """The prompt/completion parquet SFT trains on: an empty prompt or completion trains on nothing, or
    on an answer to nothing, without a word."""
    return read_table(path, TRACE_COLUMNS, "SFT data", text=TRACE_COLUMNS)


def require_text(frame: pl.DataFrame, columns, name: str) -> pl.DataFrame:
    """`frame`, refused naming the first offending row when a `columns` column is not strings, or holds a
    null or a string of nothing but whitespace."""
    for column in columns:
        if frame.schema[column] != pl.String:
            raise GraftlabError(f"{name}: column {column} is {frame.schema[column]}, not text")
        bad = (frame[column].is_null() | (frame[column].str.strip_chars() == "")).arg_true()
        if len(bad):
            what = "null" if frame[column][bad[0]] is None else "empty"
            raise GraftlabError(f"{name}: row {bad[0]} {column} is {what} ({len(bad)} such row(s))")
    return frame


def within_context(lengths, context: int | None, name: str) -> None:
    """Refuse, naming the first, a sequence longer than the `context` tokens a model attends over: past
    it, training and scoring read positions the model never learned (or fail inside the library)."""
    if context is None:
        return
    over = [i for i, n in enumerate(lengths) if n > context]
    if over:
        raise GraftlabError(
            f"{name}: row {over[0]} is {lengths[over[0]]} tokens, longer than the model's context of {context} "
            f"({len(over)} such row(s))"
        )


def require_columns(frame: pl.DataFrame, columns, name: str, allow_empty: bool = False) -> pl.DataFrame:
    """`frame`, refused with one line naming `name` when it lacks any of `columns` or holds no rows."""
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise GraftlabError(f"{name} lacks columns {missing}; it has {frame.columns}")
    if frame.is_empty() and not allow_empty:
        raise GraftlabError(f"{name} holds no rows")
    return frame
