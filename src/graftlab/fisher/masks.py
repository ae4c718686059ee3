"""Fisher masks for grafting (docs/methods.md#masks): zero the top-rho fraction of the update's entries by their
predicted rise of the retention loss, here the diagonal one, `score_i = F_i * delta_i^2` (or `F_i` alone);
the KFAC one (graftlab.fisher.kfac_mask) shares the ranking.

A mask is the `project` callable of `graftlab.graft.graft`: it receives each fp32 delta whole and
returns it masked. Ranking is global over all parameters by default, per tensor as an option. The global
threshold is exact (every score held at once, ties broken in the order tensors are grafted, so exactly
round(rho * total) entries are masked) up to `exact_limit` entries; beyond it, the threshold is the
quantile of a seeded random subsample and the count masked is whatever it gives, reported either way.
"""

import math
from pathlib import Path

import torch
from safetensors import safe_open

from graftlab.errors import GraftlabError
from graftlab.safetensors_io import tensor_index, tensor_specs

# Up to this many entries the global threshold is exact (scores and deltas held in fp32: 8 bytes each).
EXACT_LIMIT = 2**28


def load_diag_fisher(fisher_dir, post_dir) -> dict[str, torch.Tensor]:
    """The Fisher of `fisher_dir/diag.safetensors`, checked against the post model's float tensors."""
    path = Path(fisher_dir) / "diag.safetensors"
    if not path.is_file():
        raise GraftlabError(f"no diagonal Fisher at {path}")
    with safe_open(str(path), framework="pt") as f:
        fisher = {name: f.get_tensor(name).float() for name in f.keys()}
    check_fisher(path, post_dir, {n: tuple(f.shape) for n, f in fisher.items()}, fisher.items())
    return fisher


def check_fisher(path, post_dir, shapes: dict[str, tuple], tensors) -> None:
    """A Fisher file must describe exactly the post model's float tensors (`shapes`: the weight shape each
    entry describes) and hold only finite numbers (`tensors`: (name, tensor) pairs)."""
    specs = {n: s for n, s in tensor_specs(post_dir).items() if s.dtype.is_floating_point}
    missing, extra = sorted(specs.keys() - shapes.keys()), sorted(shapes.keys() - specs.keys())
    wrong = [n for n in specs.keys() & shapes.keys() if shapes[n] != tuple(specs[n].shape)]
    if missing or extra or wrong:
        raise GraftlabError(
            f"Fisher {path} was computed for another architecture than {post_dir}: "
            f"missing {missing[:3]}, unexpected {extra[:3]}, shapes differ for {sorted(wrong)[:3]}"
        )
    bad = [n for n, t in tensors if not torch.isfinite(t).all()]
    if bad:
        raise GraftlabError(f"Fisher {path} holds NaN or Inf in {bad[:3]}")


def diag_score(fisher: torch.Tensor, delta: torch.Tensor, score_kind: str) -> torch.Tensor:
    """Entry-wise predicted rise of the retention loss, `F * delta^2`, or the curvature `F` alone."""
    return fisher * delta.square() if score_kind == "fisher_delta" else fisher


def zero_entries(delta: torch.Tensor, drop: torch.Tensor) -> torch.Tensor:
    delta.view(-1)[drop] = 0
    return delta


class FisherMask:
    """Zero the top-rho scored entries of each delta; `report()` says how many, per tensor.

    Subclasses say how a tensor is scored (`_score`, flat scores and whatever `_apply` needs again) and
    how the dropped entries leave the delta (`_apply`); ranking, ties and counting are shared.
    """

    kind = ""

    def __init__(
        self,
        sizes: dict[str, int],
        rho: float,
        *,
        scope="global",
        score="fisher_delta",
        deltas=None,
        exact_limit: int = EXACT_LIMIT,
        sample: int = 2**22,
        seed: int = 0,
    ):
        if not 0 <= rho <= 1:
            raise GraftlabError(f"rho must be in [0, 1], got {rho}")
        if scope not in ("global", "tensor") or score not in ("fisher_delta", "fisher"):
            raise GraftlabError(f"unknown mask scope {scope!r} or score {score!r}")
        self.sizes, self.rho, self.scope, self.score_kind = sizes, rho, scope, score
        self.masked: dict[str, int] = {}
        self.total = sum(sizes.values())
        self.threshold, self.ties_left = None, 0
        if scope == "global":
            if score == "fisher_delta" and deltas is None:
                raise GraftlabError("a global F * delta^2 ranking needs every delta up front (read_deltas)")
            scores = {n: self._score(n, None if deltas is None else deltas[n])[0] for n in sizes}
            self._global_threshold(scores, exact_limit, sample, seed)

    def _score(self, name: str, delta: torch.Tensor | None) -> tuple[torch.Tensor, object]:
        raise NotImplementedError

    def _apply(self, name: str, delta: torch.Tensor, state, drop: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _global_threshold(self, scores, exact_limit, sample, seed) -> None:
        k = round(self.rho * self.total)
        if k == 0:
            self.threshold = math.inf
            return
        if self.total <= exact_limit:
            flat = torch.cat([s.flatten() for s in scores.values()])
            self.threshold = flat.kthvalue(self.total - k + 1).values.item()  # the k-th largest score
            self.ties_left = k - int((flat > self.threshold).sum())
            return
        gen = torch.Generator().manual_seed(seed)
        picks = [
            s.flatten()[torch.randint(s.numel(), (max(1, sample * s.numel() // self.total),), generator=gen)]
            for s in scores.values()
        ]
        self.threshold = torch.quantile(torch.cat(picks), 1 - self.rho).item()

    def __call__(self, name: str, delta: torch.Tensor) -> torch.Tensor:
        if name not in self.sizes:
            raise GraftlabError(f"tensor {name} has no Fisher entry: refusing to graft it unmasked")
        score, state = self._score(name, delta)
        score = score.flatten()
        if self.scope == "tensor":
            k = round(self.rho * score.numel())
            drop = score.topk(k).indices if k else torch.empty(0, dtype=torch.long)
        else:
            above = score > self.threshold
            ties = (score == self.threshold).nonzero()[:, 0][: self.ties_left]
            self.ties_left -= len(ties)
            drop = torch.cat([above.nonzero()[:, 0], ties])
        self.masked[name] = len(drop)
        return self._apply(name, delta, state, drop) if len(drop) else delta

    def report(self) -> dict:
        # JSON has no infinity: "nothing masked" (rho = 0) is a null threshold, as per-tensor ranking's.
        threshold = self.threshold if self.threshold is not None and math.isfinite(self.threshold) else None
        return {
            "kind": self.kind,
            "rho": self.rho,
            "scope": self.scope,
            "score": self.score_kind,
            "threshold": threshold,
            "masked": sum(self.masked.values()),
            "total": self.total,
            "masked_per_tensor": self.masked,
        }


class DiagMask(FisherMask):
    """`score_i = F_i * delta_i^2` (or `F_i`); the dropped entries of the delta are zeroed."""

    kind = "diag"

    def __init__(self, fisher: dict[str, torch.Tensor], rho: float, **options):
        self.fisher = fisher
        super().__init__({n: f.numel() for n, f in fisher.items()}, rho, **options)

    def _score(self, name, delta):
        return diag_score(self.fisher[name], delta, self.score_kind), None

    def _apply(self, name, delta, state, drop):
        return zero_entries(delta, drop)


def read_deltas(donor, donor_tuned, names) -> dict[str, torch.Tensor]:
    """fp32 `donor_tuned - donor` for the named tensors: the first pass of an exact global ranking."""
    donor_index, tuned_index = tensor_index(donor), tensor_index(donor_tuned)
    deltas = {}
    for name in names:
        with (
            safe_open(str(tuned_index[name]), framework="pt") as t,
            safe_open(str(donor_index[name]), framework="pt") as d,
        ):
            deltas[name] = t.get_tensor(name).float() - d.get_tensor(name).float()
    return deltas
