"""Retention Fisher of the post model on its own rollouts (diagonal or KFAC) and the graft masks built from it.

`write_fisher` and `make_mask` are the two entry points the CLI and the workflow share; each kind lives in
its own module (`diag`, `kfac`) and is imported only when asked for.
"""

import time
from pathlib import Path

from graftlab.atomic import write_json

KINDS = ("diag", "kfac")


def write_fisher(kind: str, model_dir, rollouts_path, out_dir, batch_size: int = 16, **kfac_options) -> None:
    """`out_dir/{kind}.safetensors` (format: docs/formats.md), written atomically, and `out_dir/seconds.json`,
    the seconds it took (`fisher_s`, loading the model included). `kfac_options`:
    `max_dim` (wider linear layers get the diagonal), `ekfac` (re-fit the diagonal in the eigenbasis) and
    `positions` (`completion` or `all`: the token positions the Kronecker factors count)."""
    if kind == "diag":
        from graftlab.fisher.diag import write_diag_fisher as write
    elif kind == "kfac":
        from graftlab.fisher.kfac import write_kfac_fisher as write
    else:
        from graftlab.errors import GraftlabError

        raise GraftlabError(f"unknown Fisher kind {kind!r}: expected one of {list(KINDS)}")
    if kfac_options and kind != "kfac":
        from graftlab.errors import GraftlabError

        raise GraftlabError(f"options {sorted(kfac_options)} apply to kind kfac only, not {kind}")
    start = time.perf_counter()
    write(model_dir, rollouts_path, Path(out_dir), batch_size, **kfac_options)
    # Beside the Fisher, for the latency analysis: a masked graft is charged the Fisher it ranks by.
    write_json(Path(out_dir) / "seconds.json", {"fisher_s": time.perf_counter() - start})


def make_mask(kind: str, fisher_dir, post, donor, donor_tuned, rho: float, scope="global", score="fisher_delta",
              exact_limit: int | None = None):
    """The `project` callable of `graftlab.graft.graft` for one masked graft; its `report()` goes to graftlab.json."""
    if kind == "diag":
        from graftlab.fisher.masks import diag_mask as build
    elif kind == "kfac":
        from graftlab.fisher.kfac_mask import kfac_mask as build
    else:
        from graftlab.errors import GraftlabError

        raise GraftlabError(f"unknown mask kind {kind!r}: expected one of {list(KINDS)}")
    if exact_limit is None:
        from graftlab.fisher.masks import EXACT_LIMIT as exact_limit
    return build(fisher_dir, post, donor, donor_tuned, rho, scope, score, exact_limit)
