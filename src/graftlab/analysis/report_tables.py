"""The run's summary tables as HTML pages for `snakemake --report`, which shows an HTML result inline but
offers a CSV or parquet only as a download: one self-contained page per table, every row and column.

    results/tables/{category}/{name}.html    the table `name` of experiment (or `study`, `moe`) `category`

Light at import: polars and pandas load inside the functions that need them.
"""

from __future__ import annotations

import html
import math
from pathlib import Path

from graftlab.errors import GraftlabError
from graftlab.io.atomic import atomic_dir

# Small and plain, so a wide table scrolls inside the report's frame rather than being squeezed.
STYLE = """
body { font-family: sans-serif; font-size: 12px; margin: 8px; }
table { border-collapse: collapse; white-space: nowrap; }
th, td { border: 1px solid #ccc; padding: 2px 6px; text-align: right; }
th { background: #eee; position: sticky; top: 0; }
td.text { text-align: left; }
tr:nth-child(even) td { background: #f8f8f8; }
"""


def cell(value) -> tuple[str, bool]:
    """A value as the table shows it, and whether it is text (left-aligned): floats at 4 significant
    digits (bootstrap intervals and accuracies carry no more), nulls blank, lists and structs as written."""
    if value is None:
        return "", False
    if isinstance(value, float):
        return ("nan" if math.isnan(value) else f"{value:.4g}"), False
    if isinstance(value, bool | int):
        return str(value), False
    return str(value), True


def table_html(frame, title: str) -> str:
    """`frame` (a polars DataFrame) as one HTML page titled `title`."""
    head = "".join(f"<th>{html.escape(c)}</th>" for c in frame.columns)
    rows = []
    for row in frame.iter_rows():
        cells = [cell(v) for v in row]
        rows.append("".join(f"<td{' class=text' if text else ''}>{html.escape(s)}</td>" for s, text in cells))
    body = "".join(f"<tr>{r}</tr>" for r in rows) or f'<tr><td colspan="{len(frame.columns)}">no rows</td></tr>'
    return (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{STYLE}</style></head><body><p><b>{html.escape(title)}</b>: {frame.height} rows</p>"
        f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></body></html>"
    )


def write_report_tables(tables: list[dict], out_dir) -> list[Path]:
    """Each of `tables` ({category, name, path}: a parquet) as `out_dir/{category}/{name}.html`, the
    directory written at once. A table that cannot be read stops with one line naming it, and no page."""
    import polars as pl

    seen = set()
    for t in tables:
        key = (t["category"], t["name"])
        if key in seen:
            raise GraftlabError(f"report table {t['category']}/{t['name']} listed twice")
        seen.add(key)
    written = []
    with atomic_dir(Path(out_dir)) as tmp:
        for t in tables:
            try:
                frame = pl.read_parquet(t["path"])
            except (OSError, pl.exceptions.PolarsError) as err:
                raise GraftlabError(f"report table {t['path']}: cannot read: {' '.join(str(err).split())}") from None
            page = tmp / t["category"] / f"{t['name']}.html"
            page.parent.mkdir(parents=True, exist_ok=True)
            page.write_text(table_html(frame, f"{t['category']}: {t['path']}"))
            written.append(Path(out_dir) / t["category"] / f"{t['name']}.html")
    return written
