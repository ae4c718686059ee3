"""Fisher masks for grafting (docs/methods.md#masks): zero the top-rho fraction of the update's entries by their
predicted rise of the retention loss, here the diagonal one, `score_i = F_i * delta_i^2` (or `F_i` alone);
the KFAC one (graftlab.fisher.kfac_mask) shares the ranking.

A mask is the `project` callable of `graftlab.graft.graft`: it receives each fp32 delta whole and
returns it masked. Ranking is global over all parameters by default, per tensor as an option. The global
threshold is exact at any model size, with memory bounded by the largest tensor: a radix select over the
scores' fp32 bit patterns, recomputed tensor by tensor from the Fisher and the delta, both read from disk
on demand. Pass 1 histograms the high 16 bits of every score, pass 2 the low 16 bits inside the bucket
holding the k-th largest, which fixes it exactly; the graft then masks every score above it and the
first ties in the order tensors are grafted, so exactly round(rho * total) entries are masked.
"""

import math
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from graftlab.errors import GraftlabError
from graftlab.io.safetensors_io import tensor_index, tensor_specs

RADIX = 1 << 16  # buckets of each radix-select pass: the high, then the low, 16 bits of a score
# Pass 1 keeps up to this many scores' keys (int32, 64 MiB) for pass 2, which then need not read and score
# those tensors again: a small model's ranking reads everything once, a large one's memory stays bounded.
KEEP_KEYS = 2**24


def load_diag_fisher(fisher_dir, post_dir, lazy: bool = False) -> Mapping[str, torch.Tensor]:
    """The Fisher of `fisher_dir/diag.safetensors`, checked against the post model's float tensors; `lazy`,
    each tensor read (and checked finite) when it is asked for, as a mask does, instead of all at once."""
    path = Path(fisher_dir) / "diag.safetensors"
    if not path.is_file():
        raise GraftlabError(f"no diagonal Fisher at {path}")
    fisher = TensorFile(path)
    check_fisher(path, post_dir, fisher.shapes, ())
    return fisher if lazy else dict(fisher.items())


class TensorFile(Mapping):
    """The fp32 tensors of one safetensors file, each read when asked for and refused if not finite:
    a mask holds one tensor of a Fisher at a time, never the whole file."""

    def __init__(self, path: Path):
        self.path = path
        with safe_open(str(path), framework="pt") as f:
            self.metadata = f.metadata() or {}
            self.shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self.shapes:
            raise KeyError(key)
        with safe_open(str(self.path), framework="pt") as f:
            tensor = f.get_tensor(key).float()
        if not torch.isfinite(tensor).all():
            raise GraftlabError(f"Fisher {self.path} holds NaN or Inf in {[key]}")
        return tensor

    def __iter__(self):
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


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

    def __init__(self, sizes: dict[str, int], rho: float, *, scope="global", score="fisher_delta", deltas=None):
        """`deltas`: name -> fp32 delta (a dict, or `read_deltas`'s reader), for a global F * delta^2 ranking."""
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
            self._global_threshold(lambda n: self._score(n, None if deltas is None else deltas[n])[0])

    def _score(self, name: str, delta: torch.Tensor | None) -> tuple[torch.Tensor, object]:
        raise NotImplementedError

    def _apply(self, name: str, delta: torch.Tensor, state, drop: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _global_threshold(self, score_of) -> None:
        """The k-th largest score by radix select over its sortable bit pattern (`_keys`), two passes of
        `score_of(name)` tensor by tensor, and how many of the scores equal to it are to be masked."""
        k = round(self.rho * self.total)
        if k == 0:
            self.threshold = math.inf
            return
        high, kept, room, again = torch.zeros(RADIX, dtype=torch.long), [], KEEP_KEYS, []
        for name in self.sizes:
            keys = _keys(score_of(name))
            if keys.numel() <= room:  # kept for pass 2, which need not read and score this tensor again
                kept.append(keys)
                room -= keys.numel()
            else:
                high += _high(keys)
                again.append(name)
        kept = torch.cat(kept) if kept else torch.empty(0, dtype=torch.int32)  # one bincount for small tensors
        bucket, above = _bucket_of(high + _high(kept), k)
        low = _low(kept, bucket)
        for name in again:
            low += _low(_keys(score_of(name)), bucket)
        position, above_low = _bucket_of(low, k - above)
        key = torch.tensor([(bucket - RADIX // 2) * RADIX + position], dtype=torch.int32)
        self.threshold = _flip(key).view(torch.float32).item()
        self.ties_left = k - above - above_low

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

    def __init__(self, fisher: Mapping[str, torch.Tensor], rho: float, **options):
        self.fisher = fisher
        # A lazy file knows its shapes from the header: counting entries must not read the tensors.
        shapes = fisher.shapes if isinstance(fisher, TensorFile) else {n: f.shape for n, f in fisher.items()}
        super().__init__({n: math.prod(s) for n, s in shapes.items()}, rho, **options)

    def _score(self, name, delta):
        return diag_score(self.fisher[name], delta, self.score_kind), None

    def _apply(self, name, delta, state, drop):
        return zero_entries(delta, drop)


def _keys(values: torch.Tensor) -> torch.Tensor:
    """int32 keys ordered as the fp32 `values` (flattened) are: a non-negative float orders like its bit
    pattern, a negative one like its pattern with the magnitude bits flipped. Adding 0.0 first makes -0.0
    the key of 0.0, which it equals."""
    return _flip((values.flatten().float() + 0.0).view(torch.int32))


def _flip(bits: torch.Tensor) -> torch.Tensor:
    """Flip the magnitude bits of negative int32 patterns: fp32 bits <-> sortable key, both ways."""
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def _high(keys: torch.Tensor) -> torch.Tensor:
    """Histogram of the keys' high 16 bits, shifted to 0..RADIX-1."""
    return torch.bincount((keys >> 16).long() + RADIX // 2, minlength=RADIX)


def _low(keys: torch.Tensor, bucket: int) -> torch.Tensor:
    """Histogram of the low 16 bits of the keys whose high bits are `bucket` (as `_high` numbers it)."""
    return torch.bincount(keys[(keys >> 16) == bucket - RADIX // 2].long() & (RADIX - 1), minlength=RADIX)


def _bucket_of(histogram: torch.Tensor, k: int) -> tuple[int, int]:
    """The bucket holding the k-th largest of the values counted, and how many lie in buckets above it."""
    from_top = histogram.flip(0).cumsum(0)
    i = int(torch.searchsorted(from_top, k))
    bucket = len(histogram) - 1 - i
    return bucket, int(from_top[i] - histogram[bucket])


def read_deltas(donor, donor_tuned, names) -> Mapping[str, torch.Tensor]:
    """fp32 `donor_tuned - donor` for the named tensors, each read from disk when asked for: the passes
    of an exact global ranking hold one delta at a time."""
    return _Deltas(tensor_index(donor), tensor_index(donor_tuned), list(names))


class _Deltas(Mapping):
    def __init__(self, donor_index: dict[str, Path], tuned_index: dict[str, Path], names: list[str]):
        self.donor_index, self.tuned_index, self.names = donor_index, tuned_index, names

    def __getitem__(self, name: str) -> torch.Tensor:
        with (
            safe_open(str(self.tuned_index[name]), framework="pt") as t,
            safe_open(str(self.donor_index[name]), framework="pt") as d,
        ):
            return t.get_tensor(name).float() - d.get_tensor(name).float()

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)
