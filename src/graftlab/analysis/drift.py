"""Weight-space geometry of the updates a world is built from (the fidelity study, issue 6).

Two numbers say whether a tiny world can show grafting's mechanism (grafting paper §3):

    drift ratio   |post - base| / |base - init|    how far post-training moved the base model, against
                                                   how far pretraining moved it from its initialisation
    cosine        cos(donor_tuned - donor, post_sft - post)
                                                   whether a donor's update points where the post model's
                                                   own SFT update does; the paper's account predicts an
                                                   earlier donor writes the new signal elsewhere

Norms and inner products are over every parameter (one flat vector per delta) and per kind of tensor
(`sensitivity.tensor_kind`), accumulated in fp64 while the models are streamed one tensor at a time.
"""

from collections.abc import Mapping
from contextlib import ExitStack
from itertools import combinations
from pathlib import Path

import polars as pl

from graftlab.analysis.sensitivity import KINDS, tensor_kind
from graftlab.errors import GraftlabError
from graftlab.io.atomic import atomic_file
from graftlab.io.safetensors_io import open_tensors, spec_differences, tensor_specs

Delta = tuple[str | Path, str | Path]  # (from, to) model directories


def _common_specs(dirs: list[Path]) -> dict:
    """The tensors every model holds, with one shape each; any difference is an error naming the model."""
    first = tensor_specs(dirs[0])
    for d in dirs[1:]:
        missing, extra, shapes = spec_differences(first, tensor_specs(d))
        diff = sorted(missing + extra) + shapes
        if diff:
            raise GraftlabError(f"{d} and {dirs[0]} are not one architecture: tensors {diff[:3]} differ")
    return first


def delta_geometry(deltas: Mapping[str, Delta]) -> tuple[dict, dict]:
    """Squared norms of every delta and inner products of every pair, by tensor kind and `all`.

    Returns `(sq[name][kind], dot[(a, b)][kind])` for the pairs of `deltas` in their given order.
    """
    dirs = sorted({Path(p) for pair in deltas.values() for p in pair})
    specs = _common_specs(dirs)
    kinds = (*KINDS, "all")
    sq = {n: dict.fromkeys(kinds, 0.0) for n in deltas}
    dot = {pair: dict.fromkeys(kinds, 0.0) for pair in combinations(deltas, 2)}
    with ExitStack() as stack:
        get = {d: stack.enter_context(open_tensors(d)) for d in dirs}
        for name, spec in specs.items():
            if not spec.dtype.is_floating_point:
                continue
            kind = tensor_kind(name)
            flat = {
                n: (get[Path(b)](name).double() - get[Path(a)](name).double()).flatten() for n, (a, b) in deltas.items()
            }
            for n, v in flat.items():
                s = float(v @ v)
                sq[n][kind] += s
                sq[n]["all"] += s
            for (a, b), acc in dot.items():
                d = float(flat[a] @ flat[b])
                acc[kind] += d
                acc["all"] += d
    return sq, dot


def cosine(dot: float, sq_a: float, sq_b: float) -> float | None:
    """None where a delta is zero: its direction is undefined, not orthogonal."""
    return dot / (sq_a * sq_b) ** 0.5 if sq_a > 0 and sq_b > 0 else None


def drift_ratio(init, base, post) -> float:
    """|post - base| / |base - init| over every parameter."""
    sq, _ = delta_geometry({"post": (base, post), "pretrain": (init, base)})
    if sq["pretrain"]["all"] == 0:
        raise GraftlabError(f"{init} and {base} are identical: pretraining moved nothing, the ratio is undefined")
    return (sq["post"]["all"] / sq["pretrain"]["all"]) ** 0.5


def update_cosines(post_sft: Delta, donors: Mapping[str, Delta]) -> list[dict]:
    """Per donor: its update's norm, the post SFT update's norm, and their cosine, overall and per kind."""
    sq, dot = delta_geometry({"post_sft": post_sft, **donors})
    rows = []
    for name in donors:
        ab = dot[("post_sft", name)]
        row = {"donor": name, "donor_norm": sq[name]["all"] ** 0.5, "post_sft_norm": sq["post_sft"]["all"] ** 0.5}
        row |= {f"cos_{k}" if k != "all" else "cos": cosine(ab[k], sq["post_sft"][k], sq[name][k]) for k in ab}
        rows.append(row)
    return rows


def drift_table(init, base, post, updates: list[dict]) -> pl.DataFrame:
    """One row per donor update: its keys (`donor`, `lr`, `epoch`), the world's drift ratio, and the
    cosine of the donor's update (`donor_dir` to `tuned_dir`) with the post model's SFT update at the same
    learning rate and epoch (`post_sft_dir`), overall and per kind."""
    ratio = drift_ratio(init, base, post)
    rows = []
    by_post_sft: dict[str, list[dict]] = {}
    for u in updates:
        by_post_sft.setdefault(str(u["post_sft_dir"]), []).append(u)
    for post_sft, group in by_post_sft.items():
        donors = {str(i): (u["donor_dir"], u["tuned_dir"]) for i, u in enumerate(group)}
        for u, row in zip(group, update_cosines((post, post_sft), donors)):
            keys = {"donor": u["donor"], "lr": str(u["lr"]), "epoch": str(u["epoch"])}
            rows.append(keys | {"drift_ratio": ratio} | {k: v for k, v in row.items() if k != "donor"})
    return pl.DataFrame(rows).sort("donor", "lr", "epoch")


def write_drift(init, base, post, updates: list[dict], out) -> pl.DataFrame:
    """`drift_table` as parquet, atomically."""
    table = drift_table(init, base, post, updates)
    print(table)
    with atomic_file(out) as tmp:
        table.write_parquet(tmp)
    return table
