"""The config arguments that graftlab's commands take as Snakemake takes them (`--configfile`,
`--config`), and the same arguments handed on to a Snakemake they start."""

from __future__ import annotations

import argparse
from pathlib import Path

from graftlab.errors import GraftlabError


def add_config_args(p: argparse.ArgumentParser, configfile_help: str = "config files, as given to snakemake") -> None:
    p.add_argument("--configfile", nargs="+", default=[], help=configfile_help)
    p.add_argument("--config", nargs="+", default=[], help="KEY=VALUE overrides, as given to snakemake")


def snakemake_config_args(args: argparse.Namespace) -> list[str]:
    """`args`' config arguments for a Snakemake command line; config files made absolute, since that
    Snakemake may run in another directory (a workdir)."""
    for path in args.configfile:
        if not Path(path).is_file():
            raise GraftlabError(f"--configfile {path}: no such file")
    out = ["--configfile", *(str(Path(p).resolve()) for p in args.configfile)] if args.configfile else []
    return out + (["--config", *args.config] if args.config else [])
