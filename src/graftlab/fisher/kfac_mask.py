"""KFAC masks for grafting (docs/methods.md#masks): rotate a linear layer's update into the Kronecker eigenbasis,
`D = U_G^T dW U_A`, score each direction by its predicted rise of the retention loss
`l_G[i] * l_A[j] * D_ij^2` (or by the EKFAC diagonal re-fitted in that basis, when the file has it; or by
the curvature `l_G[i] * l_A[j]` alone), zero the top-rho directions and map back `dW' = U_G (M * D) U_A^T`.
Parameters the KFAC file holds a diagonal for (norms, embeddings, tied or very wide layers) are masked
entry-wise as with the diagonal Fisher, in the same global ranking.
"""

import json
import math
from collections.abc import Mapping
from pathlib import Path

import torch

from graftlab.errors import GraftlabError
from graftlab.fisher.kfac import A_PARTS, FACTORS, FORMAT, FORMATS
from graftlab.fisher.masks import FisherMask, TensorFile, check_fisher, diag_score, zero_entries


def load_kfac_fisher(fisher_dir, post_dir, lazy: bool = False) -> Mapping[str, dict[str, torch.Tensor]]:
    """Per parameter of the post model, its KFAC tensors (`A_eigvals`, ..., maybe `ekfac`) or `{"diag": F}`;
    a shared A factor is one tensor for all its layers. `lazy`: `KfacEntries`, read on access."""
    path = Path(fisher_dir) / "kfac.safetensors"
    if not path.is_file():
        raise GraftlabError(f"no KFAC Fisher at {path}")
    file = TensorFile(path)
    if file.metadata.get("format") not in FORMATS:
        raise GraftlabError(f"{path} is not a {FORMAT} file (metadata format: {file.metadata.get('format')})")
    entries = KfacEntries(file)
    check_fisher(path, post_dir, entries.shapes, ())
    if lazy:
        return entries
    tensors = {key: file[key] for key in file}  # each stored tensor read once: a shared A stays one object
    return {name: {part: tensors[key] for part, key in parts.items()} for name, parts in entries.index.items()}


class KfacEntries(Mapping):
    """A KFAC file's entries by parameter, each read when asked for, without the factors `A` and `G`
    themselves (the mask needs only their eigen-pairs); the last one read is kept, as a graft asks for
    one tensor's entry several times in a row."""

    def __init__(self, file: TensorFile):
        self.file = file
        self.index: dict[str, dict[str, str]] = {}  # parameter -> part -> the key holding it
        for key in file:
            name, part = key.rsplit(".", 1)  # "<parameter>.<part>", e.g. "...q_proj.weight.A_eigvecs"
            self.index.setdefault(name, {})[part] = key
        for name, owner in json.loads(file.metadata.get("shared_A", "{}")).items():
            for part in A_PARTS:
                if f"{owner}.{part}" not in file.shapes:
                    raise GraftlabError(f"{file.path}: {name} shares the A factor of {owner}, which it lacks")
                self.index.setdefault(name, {})[part] = f"{owner}.{part}"
        self.shapes = {n: _shape({p: file.shapes[k] for p, k in parts.items()}) for n, parts in self.index.items()}
        self.ekfac = any("ekfac" in parts for parts in self.index.values())
        self._last: tuple[str, dict] = ("", {})

    def __getitem__(self, name: str) -> dict[str, torch.Tensor]:
        if self._last[0] != name:
            parts = self.index[name]
            self._last = (name, {p: self.file[k] for p, k in parts.items() if p not in ("A", "G")})
        return self._last[1]

    def __iter__(self):
        return iter(self.index)

    def __len__(self) -> int:
        return len(self.index)


def _shape(shapes: dict[str, tuple]) -> tuple[int, ...]:
    """The weight shape an entry describes (from its parts' shapes); a KFAC entry missing a factor describes
    none."""
    if "diag" in shapes:
        return tuple(shapes["diag"])
    if not all(p in shapes for p in FACTORS):
        return ()
    shape = shapes["G"][0], shapes["A"][0]
    return shape if "ekfac" not in shapes or tuple(shapes["ekfac"]) == shape else ()


class KfacMask(FisherMask):
    kind = "kfac"

    def __init__(self, entries: Mapping[str, dict[str, torch.Tensor]], rho: float, **options):
        self.entries = entries
        if isinstance(entries, KfacEntries):  # sizes from the header: counting must not read the file
            self.ekfac, shapes = entries.ekfac, entries.shapes
        else:
            self.ekfac = any("ekfac" in e for e in entries.values())
            shapes = {n: _shape({p: tuple(t.shape) for p, t in e.items()}) for n, e in entries.items()}
        super().__init__({n: math.prod(s) for n, s in shapes.items()}, rho, **options)

    def _curvature(self, e: dict[str, torch.Tensor]) -> torch.Tensor:
        return e["ekfac"] if "ekfac" in e else torch.outer(e["G_eigvals"], e["A_eigvals"])

    def _score(self, name, delta):
        e = self.entries[name]
        if "diag" in e:
            return diag_score(e["diag"], delta, self.score_kind), None
        if self.score_kind == "fisher":
            return self._curvature(e), None
        rotated = e["G_eigvecs"].T @ delta @ e["A_eigvecs"]
        return self._curvature(e) * rotated.square(), rotated

    def _apply(self, name, delta, rotated, drop):
        e = self.entries[name]
        if "diag" in e:
            return zero_entries(delta, drop)
        if rotated is None:  # ranked by curvature alone: the update was not rotated yet
            rotated = e["G_eigvecs"].T @ delta @ e["A_eigvecs"]
        rotated.view(-1)[drop] = 0
        return e["G_eigvecs"] @ rotated @ e["A_eigvecs"].T

    def report(self) -> dict:
        # For a KFAC layer, an entry masked is one eigen-direction (i, j) of the Kronecker basis.
        return super().report() | {"ekfac": self.ekfac}
