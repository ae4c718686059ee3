"""Retention Fisher of the post model on its own rollouts (diagonal or KFAC) and the graft masks built from it.

`FISHERS` is the one registry of Fisher kinds: the masks, the command line and the workflow read their
kinds from it. `write_fisher` and `make_mask` are the entry points they share. Each kind's code lives in
its own modules (`diag`/`masks`, `kfac`/`kfac_mask`), named here as strings and imported only when that
kind is used: this package is imported by every workflow parse, which must not pay for torch.
"""

import importlib
import time
from dataclasses import dataclass

from graftlab.errors import GraftlabError
from graftlab.io.atomic import atomic_dir, write_json


@dataclass(frozen=True)
class FisherKind:
    """One Fisher approximation. `writer`, `loader` and `mask` are "module:name" references: the function
    writing `{name}.safetensors`, the one reading it back checked against the post model, and the
    `FisherMask` class ranking a graft's update by it. `options` are the writer's own keyword options."""

    name: str
    writer: str
    loader: str
    mask: str
    options: tuple[str, ...] = ()


def _resolve(reference: str):
    module, name = reference.split(":")
    return getattr(importlib.import_module(module), name)


FISHERS = {
    "diag": FisherKind(
        "diag",
        "graftlab.fisher.diag:write_diag_fisher",
        "graftlab.fisher.masks:load_diag_fisher",
        "graftlab.fisher.masks:DiagMask",
    ),
    "kfac": FisherKind(
        "kfac",
        "graftlab.fisher.kfac:write_kfac_fisher",
        "graftlab.fisher.kfac_mask:load_kfac_fisher",
        "graftlab.fisher.kfac_mask:KfacMask",
        options=("max_dim", "ekfac", "positions"),
    ),
}
KINDS = tuple(FISHERS)  # the names, as the workflow's wildcards and the schema's enum list them


def fisher_kind(kind: str) -> FisherKind:
    try:
        return FISHERS[kind]
    except KeyError:
        raise GraftlabError(f"unknown Fisher kind {kind!r}: expected one of {list(KINDS)}") from None


def write_fisher(
    kind: str, model_dir, rollouts_path, out_dir, batch_size: int = 16, processes: int = 1, **options
) -> None:
    """`out_dir/{kind}.safetensors` (format: docs/formats.md), written atomically, and `out_dir/seconds.json`,
    the seconds it took (`fisher_s`, loading the model included). `options` are the kind's own (kfac:
    `max_dim`, wider linear layers get the diagonal; `ekfac`, re-fit the diagonal in the eigenbasis;
    `positions`, `completion` or `all`, the token positions the Kronecker factors count). `processes`: one per
    GPU, over which every kind's writer shards the model (`graftlab.train.shard`)."""
    spec = fisher_kind(kind)
    unknown = sorted(set(options) - set(spec.options))
    if unknown:
        raise GraftlabError(f"options {unknown} do not apply to Fisher kind {kind} (its options: {list(spec.options)})")
    if processes > 1:
        options = options | {"processes": processes}
    start = time.perf_counter()
    # The seconds go inside the same atomic directory as the Fisher (a kill between the two must not leave
    # a Fisher without them), for the latency analysis: a masked graft is charged the Fisher it ranks by.
    with atomic_dir(out_dir) as tmp:
        _resolve(spec.writer)(model_dir, rollouts_path, tmp, batch_size, **options)
        write_json(tmp / "seconds.json", {"fisher_s": time.perf_counter() - start})


def make_mask(
    kind: str,
    fisher_dir,
    post,
    donor,
    donor_tuned,
    rho: float,
    scope="global",
    score="fisher_delta",
):
    """The `project` callable of `graftlab.graft.graft` for one masked graft, its Fisher checked against
    the post model; its `report()` goes to graftlab.json. The Fisher and, for a global F * delta^2 ranking,
    the deltas are read tensor by tensor when needed: the global threshold takes two passes over them
    before the streamed graft applies it (graftlab.fisher.masks)."""
    from graftlab.fisher.masks import read_deltas

    spec = fisher_kind(kind)
    entries = _resolve(spec.loader)(fisher_dir, post, lazy=True)
    deltas = read_deltas(donor, donor_tuned, entries) if scope == "global" and score == "fisher_delta" else None
    return _resolve(spec.mask)(entries, rho, scope=scope, score=score, deltas=deltas)
