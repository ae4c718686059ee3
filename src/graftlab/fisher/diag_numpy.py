"""The diagonal Fisher `DIR/diag.safetensors` (docs/formats.md) as fp32 numpy arrays, without torch, checked
as `graftlab.fisher.masks.load_diag_fisher` checks it (names and shapes those of the post model's float
tensors; finite), and refused if negative anywhere, which a diagonal Fisher (a mean of squares) never is.

For jobs that only read the Fisher and sum with it (the sensitivity analysis): for them importing torch
would cost more than the work.
"""

import math
from pathlib import Path

import numpy as np

from graftlab.errors import GraftlabError
from graftlab.io.fp32_numpy import Fp32Reader
from graftlab.io.safetensors_io import TensorSpec, read_header, tensor_specs


def load_diag_fisher_numpy(
    fisher_dir: str | Path, post_dir: str | Path, post_specs: dict[str, TensorSpec] | None = None
) -> dict[str, np.ndarray]:
    """Every tensor of the Fisher, fp32, in file order. `post_specs`: the post model's tensor_specs, when
    the caller has read them already."""
    path = Path(fisher_dir) / "diag.safetensors"
    if not path.is_file():
        raise GraftlabError(f"no diagonal Fisher at {path}")
    index = {name: path for name in read_header(path) if name != "__metadata__"}
    specs = tensor_specs(path.parent, index)
    _check_shapes(path, post_dir, tensor_specs(post_dir) if post_specs is None else post_specs, specs)
    fisher = {}
    with Fp32Reader(index, specs) as read:
        for name in index:
            fisher[name] = _checked(path, name, read(name))
    return fisher


def _check_shapes(path: Path, post_dir, post_specs: dict[str, TensorSpec], specs: dict[str, TensorSpec]) -> None:
    """The Fisher describes exactly the post model's float tensors (masks.check_fisher's message)."""
    want = {n: s.shape for n, s in post_specs.items() if s.is_floating_point}
    missing, extra = sorted(want.keys() - specs.keys()), sorted(specs.keys() - want.keys())
    wrong = sorted(n for n in want.keys() & specs.keys() if specs[n].shape != want[n])
    if missing or extra or wrong:
        raise GraftlabError(
            f"Fisher {path} was computed for another architecture than {post_dir}: "
            f"missing {missing[:3]}, unexpected {extra[:3]}, shapes differ for {wrong[:3]}"
        )


def _checked(path: Path, name: str, f: np.ndarray) -> np.ndarray:
    """`f`, refused if it holds NaN, Inf or a negative number: min and max, two passes without a
    temporary (either is NaN when any element is)."""
    if f.size:
        low, high = float(f.min()), float(f.max())
        if not (math.isfinite(low) and math.isfinite(high)):
            raise GraftlabError(f"Fisher {path} holds NaN or Inf in {[name]}")
        if low < 0:
            raise GraftlabError(f"Fisher {path} holds negative values in {name}: not a diagonal Fisher")
    return f
