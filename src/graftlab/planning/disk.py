"""Disk a finished run uses, per rule, and the most its temporary grafts held at once.

Snakemake keeps a record of every output it made (`.snakemake/metadata/`, one JSON per output named by the
output's path in URL-safe base64, holding the rule that wrote it): each output that still exists is charged to
that rule, a directory at the size of its files. Grafted models never outlive their job (rules/graft.smk),
so they are read from their jobs' `seconds.json`: when each model was written and deleted, and its size.
`graftlab plan` estimates the same rules before a run (`graftlab.planning.plan.render`).

Standard library only, like `graftlab.planning.plan`: the workflow's `onsuccess` handler calls `write_report`.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from pathlib import Path

TEMP_GRAFTS = "graft (temporary, peak)"  # the row of the grafts' peak, beside the rules' rows


def size_of(path: Path) -> int:
    """Bytes of a file, or of every file under a directory (links not followed)."""
    if not path.is_dir():
        return path.stat().st_size
    return sum((Path(root) / f).lstat().st_size for root, _, files in os.walk(path) for f in files)


def outputs_by_rule(workdir: Path) -> dict[str, list[Path]]:
    """{rule: [output path]} of every output Snakemake recorded in `workdir` that still exists."""
    by_rule: dict[str, list[Path]] = {}
    metadata = workdir / ".snakemake" / "metadata"
    # A long name is split into directories, each part but the last prefixed with "@".
    records = [Path(root) / f for root, _, files in os.walk(metadata) for f in files]
    for record in sorted(records):
        try:
            name = "".join(part.removeprefix("@") for part in record.relative_to(metadata).parts)
            path = Path(base64.urlsafe_b64decode(name).decode())
            rule = json.loads(record.read_text())["rule"]
        except (binascii.Error, UnicodeDecodeError, ValueError, KeyError):
            continue  # not a record of an output (Snakemake keeps other files beside them)
        if (workdir / path).exists():
            by_rule.setdefault(rule, []).append(workdir / path)
    return by_rule


def graft_peak(workdir: Path) -> tuple[int, int]:
    """(grafts, bytes) on disk together at the worst moment, from every graft's `seconds.json`."""
    events = []
    for record in (workdir / "results").glob("**/graft/**/seconds.json"):
        seconds = json.loads(record.read_text())
        if "model_written_at" in seconds:
            size = seconds.get("model_bytes", 0)
            events += [(seconds["model_written_at"], 1, size), (seconds["model_deleted_at"], -1, -size)]
    count = peak_count = total = peak_bytes = 0
    for _, step, size in sorted(events, key=lambda e: (e[0], e[1])):  # a deletion first at a tie
        count, total = count + step, total + size
        peak_count, peak_bytes = max(peak_count, count), max(peak_bytes, total)
    return peak_count, peak_bytes


def usage(workdir: Path) -> list[dict]:
    """One row per rule, largest first: its outputs and their bytes; then the grafts' peak."""
    rows = [
        {"rule": rule, "outputs": len(paths), "bytes": sum(size_of(p) for p in paths)}
        for rule, paths in outputs_by_rule(workdir).items()
    ]
    rows.sort(key=lambda row: -row["bytes"])
    count, peak = graft_peak(workdir)
    return rows + ([{"rule": TEMP_GRAFTS, "outputs": count, "bytes": peak}] if count else [])


def human(size: float) -> str:
    """Bytes in the largest unit that keeps a number of at least 1: 4.2 MB, 16 GB."""
    for unit in ("B", "kB", "MB", "GB"):
        if size < 1000:
            return f"{size:.3g} {unit}"
        size /= 1000
    return f"{size:.3g} TB"


def render(rows: list[dict]) -> str:
    lines = ["| rule | outputs | disk |", "|---|---:|---:|"]
    lines += [f"| {r['rule']} | {r['outputs']} | {human(r['bytes'])} |" for r in rows]
    kept = sum(r["bytes"] for r in rows if r["rule"] != TEMP_GRAFTS)
    return "\n".join(lines + [f"| **kept** | | **{human(kept)}** |"])


def write_report(workdir: Path, out: Path) -> str:
    """Write `out` (TSV: rule, outputs, bytes) atomically; return the table as Markdown."""
    from graftlab.io.atomic import atomic_file

    rows = usage(workdir)
    with atomic_file(out) as tmp:
        tmp.write_text("rule\toutputs\tbytes\n" + "".join(f"{r['rule']}\t{r['outputs']}\t{r['bytes']}\n" for r in rows))
    return render(rows)
