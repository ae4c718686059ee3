"""KFAC masks for grafting (docs/methods.md#masks): rotate a linear layer's update into the Kronecker eigenbasis,
`D = U_G^T dW U_A`, score each direction by its predicted rise of the retention loss
`l_G[i] * l_A[j] * D_ij^2` (or by the EKFAC diagonal re-fitted in that basis, when the file has it; or by
the curvature `l_G[i] * l_A[j]` alone), zero the top-rho directions and map back `dW' = U_G (M * D) U_A^T`.
Parameters the KFAC file holds a diagonal for (norms, embeddings, tied or very wide layers) are masked
entry-wise as with the diagonal Fisher, in the same global ranking.
"""

from pathlib import Path

import torch
from safetensors import safe_open

from graftlab.errors import GraftlabError
from graftlab.fisher.kfac import FACTORS, FORMAT
from graftlab.fisher.masks import FisherMask, check_fisher, diag_score, zero_entries


def load_kfac_fisher(fisher_dir, post_dir) -> dict[str, dict[str, torch.Tensor]]:
    """Per parameter of the post model, its KFAC tensors (`A_eigvals`, ..., maybe `ekfac`) or `{"diag": F}`."""
    path = Path(fisher_dir) / "kfac.safetensors"
    if not path.is_file():
        raise GraftlabError(f"no KFAC Fisher at {path}")
    with safe_open(str(path), framework="pt") as f:
        if (f.metadata() or {}).get("format") != FORMAT:
            raise GraftlabError(
                f"{path} is not a {FORMAT} file (metadata format: {(f.metadata() or {}).get('format')})"
            )
        entries: dict[str, dict[str, torch.Tensor]] = {}
        for key in f.keys():
            name, part = key.rsplit(".", 1)  # "<parameter>.<part>", e.g. "...q_proj.weight.A_eigvecs"
            entries.setdefault(name, {})[part] = f.get_tensor(key).float()
    shapes = {n: _shape(parts) for n, parts in entries.items()}
    check_fisher(path, post_dir, shapes, ((f"{n}.{p}", t) for n, parts in entries.items() for p, t in parts.items()))
    return entries


def _shape(parts: dict[str, torch.Tensor]) -> tuple[int, ...]:
    """The weight shape an entry describes; a KFAC entry missing a factor describes none."""
    if "diag" in parts:
        return tuple(parts["diag"].shape)
    if not all(p in parts for p in FACTORS):
        return ()
    shape = parts["G"].shape[0], parts["A"].shape[0]
    return shape if "ekfac" not in parts or tuple(parts["ekfac"].shape) == shape else ()


class KfacMask(FisherMask):
    kind = "kfac"

    def __init__(self, entries: dict[str, dict[str, torch.Tensor]], rho: float, **options):
        self.entries = entries
        self.ekfac = any("ekfac" in e for e in entries.values())
        sizes = {
            n: (e["diag"].numel() if "diag" in e else e["G"].shape[0] * e["A"].shape[0]) for n, e in entries.items()
        }
        super().__init__(sizes, rho, **options)

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
