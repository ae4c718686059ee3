"""The provenance file every output directory carries (`graftlab.json`): its inputs, parameters,
package versions, git revision and time of creation."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

PROVENANCE_NAME = "graftlab.json"


def _package_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for package in ("torch", "transformers", "safetensors", "graftlab"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return versions


def _git_revision() -> str | None:
    try:
        done = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
            cwd=Path(__file__).parent,  # graftlab's checkout, not the workflow's working directory
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None


def write_provenance(
    out_dir: str | Path, inputs: dict[str, Any], params: dict[str, Any], extra: dict[str, Any] | None = None
) -> Path:
    """Write ``out_dir/graftlab.json``: what produced this directory, with which code."""
    record = {
        "inputs": {key: str(value) if isinstance(value, os.PathLike) else value for key, value in inputs.items()},
        "params": params,
        "versions": _package_versions(),
        "git_revision": _git_revision(),
        "created_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    if extra:
        record.update(extra)
    path = Path(out_dir) / PROVENANCE_NAME
    path.write_text(json.dumps(record, indent=2, default=str) + "\n")
    return path


def refuse_foreign_dir(out: str | Path, flag: str = "--out") -> None:
    """Refuse an output directory that exists, is not empty and has no graftlab.json: the command
    writes its output atomically, which replaces the directory whole, and a user's own directory
    given as --out by mistake must not vanish. One that graftlab wrote (a re-run) is replaced."""
    from graftlab.errors import UsageError

    path = Path(out)
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        raise UsageError(f"{flag} {out} exists and is not a directory; choose another {flag}")
    if path.is_dir() and any(path.iterdir()) and not (path / PROVENANCE_NAME).is_file():
        raise UsageError(
            f"{flag} {out} is a non-empty directory without {PROVENANCE_NAME}, so not graftlab's output, and "
            f"writing it would replace it whole; choose another {flag} or remove it"
        )
