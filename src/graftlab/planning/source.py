"""Where every job imports graftlab from when its environment does not hold it (Snakemake's conda
environments, envs/: an environment file cannot name the checkout, since Snakemake copies it away)."""

import os
from pathlib import Path


def import_from(src: Path) -> None:
    """Put `src` (the workflow's own `src/`) first on PYTHONPATH, which every job's process inherits."""
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(src), os.environ.get("PYTHONPATH")]))
