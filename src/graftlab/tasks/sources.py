"""Problems and benchmarks from real data: local parquet / JSON / JSONL files, directories written by
`datasets`' `save_to_disk`, or Hugging Face dataset ids, mapped onto the frame every stage reads
(`id`, `task`, `prompt`, `answer`, plus `solution` when mapped).

Bad input is refused, or skipped out loud, never silently:
- a mapped column the data lacks -> GraftlabError naming the data set, the column and the columns present;
- a row whose answer the task cannot grade against (empty, or nothing math-verify can read) -> skipped,
  logged and counted in the returned stats (`on_unparsable: skip`, the default: real sets such as MATH
  hold a few such rows, and refusing the whole set would force hand-cleaning before any run), or a
  GraftlabError listing the offending ids (`on_unparsable: error`);
- duplicate ids from an id column -> GraftlabError (the column is not an id); rows whose problem text
  repeats, when ids are hashes, are the same problem and are dropped after the first, counted;
- nothing left -> GraftlabError.
"""

import hashlib
import logging
from dataclasses import dataclass, field, fields
from pathlib import Path

import polars as pl

from graftlab.errors import GraftlabError
from graftlab.io.atomic import write_table_with_stats
from graftlab.io.fetch import DATA_SUFFIXES, looks_local
from graftlab.tasks import get_task

log = logging.getLogger(__name__)

FILE_READERS = {".parquet": pl.read_parquet, ".jsonl": pl.read_ndjson, ".ndjson": pl.read_ndjson, ".json": pl.read_json}
assert tuple(FILE_READERS) == DATA_SUFFIXES, "every data file a source may name has a reader"
ON_UNPARSABLE = ("skip", "error")
SHOWN_IDS = 20  # ids listed in messages and stats; the counts are always complete


@dataclass(frozen=True)
class ProblemSource:
    """Where one data set lives and how its columns map onto problems.

    `source` is a local file (.parquet, .jsonl/.ndjson, .json holding an array of records), a local
    directory (written by `save_to_disk`, or of data files `datasets` can read), or a hub dataset id.
    `columns` maps the roles `prompt` and `answer` (required), `id` and `solution` (optional) to column
    names; without an `id` column each problem's id is a hash of its text, stable across file moves."""

    name: str
    source: str
    task: str = "math"
    columns: dict = field(default_factory=lambda: {"prompt": "problem", "answer": "answer"})
    split: str | None = None
    subset: str | None = None  # the hub dataset's configuration name
    revision: str | None = None
    limit: int | None = None  # keep the first N usable problems
    on_unparsable: str = "skip"

    def __post_init__(self):
        get_task(self.task)
        roles = set(self.columns)
        if not {"prompt", "answer"} <= roles or not roles <= {"prompt", "answer", "id", "solution"}:
            raise GraftlabError(
                f"dataset {self.name}: columns must map prompt and answer (optionally id, solution), got {self.columns}"
            )
        if self.on_unparsable not in ON_UNPARSABLE:
            raise GraftlabError(
                f"dataset {self.name}: on_unparsable must be one of {ON_UNPARSABLE}, got {self.on_unparsable!r}"
            )
        if self.limit is not None and self.limit < 1:
            raise GraftlabError(f"dataset {self.name}: limit must be >= 1, got {self.limit}")

    @classmethod
    def from_config(cls, name: str, cfg: dict) -> "ProblemSource":
        allowed = {f.name for f in fields(cls)} - {"name"}
        unknown = set(cfg) - allowed
        if unknown or "source" not in cfg:
            raise GraftlabError(
                f"dataset {name}: needs `source`; unknown keys {sorted(unknown)}; allowed {sorted(allowed)}"
            )
        return cls(name=name, **cfg)


def _pick_split(data, src: ProblemSource):
    """One split of a DatasetDict: the configured one, else the only one there is."""
    from datasets import DatasetDict

    if not isinstance(data, DatasetDict):
        return data
    if src.split is None and len(data) == 1:
        return next(iter(data.values()))
    if src.split not in data:
        raise GraftlabError(f"dataset {src.name} ({src.source}): split {src.split!r} not found; splits: {sorted(data)}")
    return data[src.split]


def _load_with_datasets(src: ProblemSource, path: Path | None) -> pl.DataFrame:
    import datasets

    try:
        if path is not None and ((path / "dataset_dict.json").exists() or (path / "state.json").exists()):
            data = datasets.load_from_disk(str(path))
        else:
            # Hub ids and local directories of data files take the same call; revision pins a hub commit.
            data = datasets.load_dataset(src.source, src.subset, split=src.split, revision=src.revision)
    except (OSError, ValueError, datasets.exceptions.DatasetNotFoundError) as e:
        raise GraftlabError(f"dataset {src.name}: cannot load {src.source!r}: {e}") from e
    return _pick_split(data, src).to_polars()


def read_table(src: ProblemSource) -> pl.DataFrame:
    """The raw table of `src`, all columns as stored."""
    path = Path(src.source).expanduser()
    if path.exists() and src.revision is not None:
        raise GraftlabError(f"dataset {src.name}: revision {src.revision!r} pins hub ids only; {path} is local")
    if path.is_file():
        reader = FILE_READERS.get(path.suffix)
        if reader is None:
            raise GraftlabError(f"dataset {src.name}: {path} is not one of {sorted(FILE_READERS)}")
        try:
            return reader(path)
        except (pl.exceptions.PolarsError, OSError) as e:
            # polars' messages ("ExpectedNull at character 0") name no file.
            message = " ".join(str(e).split())
            raise GraftlabError(f"dataset {src.name}: cannot read {path} as {path.suffix[1:]}: {message}") from None
    if path.is_dir():
        return _load_with_datasets(src, path)
    if looks_local(src.source):
        raise GraftlabError(f"dataset {src.name}: no such file or directory {src.source}")
    return _load_with_datasets(src, None)


def _check_columns(table: pl.DataFrame, src: ProblemSource) -> None:
    for role, column in src.columns.items():
        if column not in table.columns:
            raise GraftlabError(
                f"dataset {src.name} ({src.source}): no column {column!r} (mapped as {role}); "
                f"columns present: {table.columns}"
            )


def _text(cell) -> str:
    # Answers are often integers (AIME) and must become the same strings whatever the file type.
    return "" if cell is None else str(cell).strip()


def _problem_ids(table: pl.DataFrame, src: ProblemSource) -> list[str]:
    if "id" not in src.columns:
        return [hashlib.sha256(_text(p).encode()).hexdigest()[:16] for p in table[src.columns["prompt"]]]
    ids = [_text(i) for i in table[src.columns["id"]]]
    seen, repeated = set(), []
    for i in ids:
        if not i or i in seen:
            repeated.append(i)
        seen.add(i)
    if repeated:
        raise GraftlabError(
            f"dataset {src.name}: id column {src.columns['id']!r} has {len(repeated)} empty or repeated values "
            f"(first: {repeated[:SHOWN_IDS]}); map a unique column or leave `id` out to hash the problem text"
        )
    return ids


def _rows(table: pl.DataFrame, src: ProblemSource) -> tuple[list[dict], dict[str, list[str]]]:
    """Usable problems in table order, and the ids of the rows left out, by reason."""
    task = get_task(src.task)
    cols = src.columns
    skipped: dict[str, list[str]] = {"empty": [], "unparsable": [], "duplicate": []}
    rows, seen = [], set()
    for pid, row in zip(_problem_ids(table, src), table.iter_rows(named=True)):
        problem, answer = _text(row[cols["prompt"]]), _text(row[cols["answer"]])
        if not problem or not answer:
            skipped["empty"].append(pid)
            continue
        if pid in seen:
            skipped["duplicate"].append(pid)
            continue
        reference = task.reference(answer)
        if reference is None:
            skipped["unparsable"].append(pid)
            continue
        seen.add(pid)
        out = {"id": pid, "task": task.name, "prompt": task.prompt(problem), "answer": reference}
        if "solution" in cols:
            out["solution"] = _text(row[cols["solution"]])
        rows.append(out)
    return rows, skipped


def load_problems(src: ProblemSource) -> tuple[pl.DataFrame, dict]:
    """The problems of `src` as a frame (`id`, `task`, `prompt`, `answer`[, `solution`]) and stats:
    rows read, problems kept, and every skipped row counted by reason with its first ids."""
    table = read_table(src)
    _check_columns(table, src)
    rows, skipped = _rows(table, src)
    ungradable = skipped["empty"] + skipped["unparsable"]
    if ungradable and src.on_unparsable == "error":
        raise GraftlabError(
            f"dataset {src.name} ({src.source}): {len(ungradable)} of {table.height} rows have an answer "
            f"task {src.task} cannot grade (empty or unparsable), ids {ungradable[:SHOWN_IDS]}; "
            f"fix them or set on_unparsable: skip"
        )
    for reason, ids in skipped.items():
        if ids:
            log.warning("dataset %s: skipped %d %s row(s), first ids %s", src.name, len(ids), reason, ids[:SHOWN_IDS])
    usable = len(rows)
    rows = rows[: src.limit] if src.limit else rows
    if not rows:
        raise GraftlabError(
            f"dataset {src.name} ({src.source}): no usable problems in {table.height} rows "
            f"(skipped: { {k: len(v) for k, v in skipped.items()} })"
        )
    stats = {
        "dataset": src.name,
        "source": src.source,
        "task": src.task,
        "split": src.split,
        "revision": src.revision,
        "rows": table.height,
        "usable": usable,
        "kept": len(rows),
        "skipped": {k: len(v) for k, v in skipped.items()},
        "skipped_ids": {k: v[:SHOWN_IDS] for k, v in skipped.items() if v},
    }
    return pl.DataFrame(rows, schema={k: pl.String for k in rows[0]}), stats


def write_problems(src: ProblemSource, out, stats_out) -> dict:
    """Write the problems of `src` to the parquet `out` and its stats to the JSON `stats_out`; the parquet
    is written last, so its presence means both are complete."""
    problems, stats = load_problems(src)
    write_table_with_stats(problems, stats, out, stats_out)
    print(f"dataset {src.name}: {stats['kept']} problems of {stats['rows']} rows; skipped {stats['skipped']}")
    return stats


def normalised(text) -> str:
    # A benchmark and a training set may wrap or space the same problem differently.
    return " ".join(str(text).split())


def check_problems(frame: pl.DataFrame, name: str) -> pl.DataFrame:
    """`frame` (a problems table: id, prompt, answer), refused with the row named when an id repeats or
    a prompt or answer is empty. Mining keeps what the model never solves, so an ungradable problem
    would be kept as "hard", and a repeated one could land in training and the held-out set at once."""
    ids = frame["id"].cast(pl.String)
    for column in ("id", "prompt", "answer"):
        empty = (frame[column].cast(pl.String).str.strip_chars().fill_null("") == "").arg_true()
        if len(empty):
            row = empty[0]
            raise GraftlabError(f"{name}: row {row} (id {ids[row]!r}) has an empty {column} ({len(empty)} such rows)")
    repeated = ids.is_duplicated().arg_true()
    if len(repeated):
        rows = list(repeated[:SHOWN_IDS])
        raise GraftlabError(f"{name}: id {ids[repeated[0]]!r} repeats (rows {rows}); problem ids must be unique")
    return frame


def find_leaks(problems: pl.DataFrame, benchmark_files) -> list[tuple[str, int, str, int]]:
    """(benchmark file, first row, its id, rows) for each benchmark holding some of the training
    `problems`, by id or by prompt text up to white space."""
    from graftlab.io.tables import read_table as read_parquet_table

    found = []
    for file in benchmark_files:
        bench = read_parquet_table(file, ("id", "prompt"), "benchmark")
        ids, prompts = set(bench["id"].cast(pl.String)), {normalised(p) for p in bench["prompt"]}
        leaks = [
            (i, pid)
            for i, (pid, prompt) in enumerate(zip(problems["id"].cast(pl.String), problems["prompt"]))
            if pid in ids or normalised(prompt) in prompts
        ]
        if leaks:
            found.append((str(file), *leaks[0], len(leaks)))
    return found


def refuse_leaks(problems: pl.DataFrame, benchmark_files, name: str, report: bool = False) -> None:
    """Refuse training `problems` that a benchmark holds: a model trained on a benchmark's problems
    scores its memory of them. Names the first such row. With `report`, keep them and say so loudly on
    stderr instead (for a check of mechanics that trains on a benchmark on purpose)."""
    import sys

    for file, row, pid, count in find_leaks(problems, benchmark_files):
        what = f"{name}: row {row} (id {pid!r}) is also a problem of the benchmark {file} ({count} such rows)"
        if not report:
            raise GraftlabError(f"{what}: training on it leaks the benchmark; remove them from the training data")
        print(
            f"WARNING: {what}: kept (mining.leaks: report); that benchmark's scores are not held out", file=sys.stderr
        )
