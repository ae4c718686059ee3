"""The identity graft's numpy kernel writes exactly the bits the torch kernel writes: rounding ties,
NaN, infinities, signed zeros, subnormals, every stored dtype, scale 0 and negative scales."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import graftlab.graft_numpy as graft_numpy
from graftlab.graft import graft
from graftlab.graft_numpy import PASS_ELEMENTS, STORAGE, NumpyKernel

DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}
INT_VIEW = {
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
    torch.float32: torch.int32,
    torch.float64: torch.int64,
}


@pytest.fixture(autouse=True, params=["fused", "numpy"])
def bf16_path(request, monkeypatch):
    """Every test runs twice: with bf16 blocks in the compiled fused loop (graftlab/_kernel.c), and with
    that loop absent, as where it did not build, in numpy's passes."""
    if request.param == "numpy":
        monkeypatch.setattr(graft_numpy, "_fused_bf16", None)
    return request.param


def test_the_fused_loop_is_built_and_writes_torchs_bits_for_every_bf16_pattern(bf16_path):
    """All 65,536 bf16 bit patterns as post, against donor and tuned patterns drawn from all of them
    (NaNs of every payload, infinities, subnormals included), at three scales. The loop must be built:
    a silent fall-back to numpy would cost a real graft 3x its time."""
    from graftlab._kernel import graft_bf16

    g = torch.Generator().manual_seed(0)
    post = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    donor, tuned = (
        torch.randint(-(2**15), 2**15, (2**16,), generator=g, dtype=torch.int32).to(torch.int16) for _ in "dt"
    )
    p, d, t = (x.view(torch.bfloat16) for x in (post, donor, tuned))
    for scale in (0.5, 1.0, 1e-3):
        want = (p.float() + (t.float() - d.float()).mul_(scale)).to(torch.bfloat16).view(torch.int16)
        out = np.empty(2**16, dtype=np.uint16)
        graft_bf16(*(x.numpy().view(np.uint16) for x in (post, donor, tuned)), out, scale)
        assert np.array_equal(out.view(np.int16), want.numpy()), scale


def special_values(dtype: torch.dtype) -> torch.Tensor:
    """Values whose handling could differ between two implementations of the same arithmetic."""
    info = torch.finfo(dtype)
    values = [
        0.0,
        -0.0,
        1.0,
        -1.0,
        info.max,
        -info.max,
        info.tiny,
        -info.tiny,
        info.tiny / 4,
        -info.smallest_normal / 8,
    ]
    values += [float("inf"), float("-inf"), float("nan"), -float("nan"), 1 + 2**-8, 1 + 3 * 2**-8, 2**-133, 3e38]
    return torch.tensor(values, dtype=torch.float32).to(dtype)


def trio_tensors(dtype: torch.dtype, seed: int) -> list[dict[str, torch.Tensor]]:
    """post, donor, donor_tuned: random weights with special values scattered through all three, a
    tensor larger than one numpy pass, bf16 rounding ties, a 0-d, an empty and an integer tensor."""
    g = torch.Generator().manual_seed(seed)
    models = []
    for role in range(3):
        big = torch.randn(3, PASS_ELEMENTS + 1000, generator=g) * 0.02  # passes read as uint32 pairs
        odd = torch.randn(5, 7, generator=g)  # an odd count: bf16 cannot be read as pairs
        small = torch.randn(40, 17, generator=g)
        specials = special_values(dtype).float()
        for tensor in (big, small, odd):  # specials at random places, different in each model
            flat = tensor.view(-1)
            flat[torch.randint(0, flat.numel(), (200,), generator=g)] = specials[
                torch.randint(0, len(specials), (200,), generator=g)
            ]
        # Ties: post 1 + k * 2**-7 plus a delta of 2**-8 (scale 1) is halfway between two bf16
        # neighbours; k odd or even decides which way round-to-even goes.
        k = torch.arange(64, dtype=torch.float32)
        ties = [1 + k * 2**-7, torch.zeros(64), torch.full((64,), 2**-8)][role]
        models.append(
            {
                "big": big.to(dtype),
                "small": small.to(dtype),
                "odd": odd.to(dtype),
                "clean": torch.randn(2, 4000, generator=g).to(dtype),  # no NaN: every pass takes the fast way
                "ties": ties.to(dtype),
                "scalar": torch.randn((), generator=g).to(dtype),
                "empty": torch.empty(0, 5, dtype=dtype),
                "ids": torch.randint(0, 100, (9,), generator=g),
            }
        )
    return models


def write_trio(root: Path, dtype: torch.dtype, seed: int) -> list[Path]:
    dirs = []
    for role, tensors in zip(("post", "donor", "tuned"), trio_tensors(dtype, seed)):
        (root / role).mkdir(parents=True)
        save_file(tensors, root / role / "model.safetensors", metadata={"format": "pt"})
        (root / role / "config.json").write_text("{}")  # graft refuses a directory without one
        dirs.append(root / role)
    return dirs


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(INT_VIEW[tensor.dtype]) if tensor.dtype in INT_VIEW else tensor


def torch_formula(post: torch.Tensor, donor: torch.Tensor, tuned: torch.Tensor, scale: float) -> torch.Tensor:
    """The graft as torch computes it, written out independently of graftlab: fp32, one cast."""
    return (post.float() + (tuned.float() - donor.float()) * scale).to(post.dtype)


def identity(name: str, delta: torch.Tensor) -> torch.Tensor:
    return delta  # a projection: sends the graft down the torch kernel


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("scale", [0.0, 0.5, 1.0, 2.75, 1e-3])
def test_numpy_graft_matches_torch_graft_bit_for_bit(tmp_path, dtype_name, scale):
    dtype = DTYPES[dtype_name]
    post, donor, tuned = write_trio(tmp_path, dtype, seed=len(dtype_name) * 7 + int(scale * 100))
    # Small row blocks on one thread; blocks of several passes on two threads; torch on whole tensors.
    # NaN and Inf are planted on purpose: the kernels must agree on them too.
    graft(post, donor, tuned, scale, tmp_path / "blocks", chunk_bytes=4096, threads=1, allow_nonfinite=True)
    graft(post, donor, tuned, scale, tmp_path / "threads", threads=2, allow_nonfinite=True)
    graft(post, donor, tuned, scale, tmp_path / "torch", project=identity, allow_nonfinite=True)
    blocks, threads, theirs = (load_file(tmp_path / d / "model.safetensors") for d in ("blocks", "threads", "torch"))
    inputs = [load_file(d / "model.safetensors") for d in (post, donor, tuned)]
    assert blocks.keys() == threads.keys() == theirs.keys() == inputs[0].keys()
    for name, got in [*blocks.items(), *threads.items()]:
        assert got.dtype == inputs[0][name].dtype and got.shape == inputs[0][name].shape, name
        assert torch.equal(bits(got), bits(theirs[name])), name
        if scale == 0 or name == "ids":
            want = inputs[0][name]  # copied, -0.0 and NaN payloads included
        else:
            want = torch_formula(*(m[name] for m in inputs), scale)
        assert torch.equal(bits(got), bits(want)), name
    assert torch.isnan(blocks["big"].float()).any() and torch.isinf(blocks["big"].float()).any()


def test_bf16_ties_round_to_even():
    # Computed by hand: 1 + k * 2**-7 + 2**-8 sits halfway between bf16 neighbours 2**-7 apart; the
    # even one is k's when k is even, k + 1's when k is odd. A truncating cast would always keep k.
    k = np.arange(64)
    post = ((1 + k * 2.0**-7).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    tuned = np.full(64, np.float32(2**-8).view(np.uint32) >> 16, dtype=np.uint16)
    donor = np.zeros(64, dtype=np.uint16)
    got = NumpyKernel(1.0).graft("BF16", post, donor, tuned)
    want = 1 + (k + k % 2) * 2.0**-7
    assert np.array_equal(got, (want.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16))


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("scale", [-0.7, -3.0])
def test_kernel_with_negative_scale_matches_torch(dtype_name, scale):
    # graft() refuses scale < 0; the kernel itself must still be the same arithmetic as torch's.
    dtype = DTYPES[dtype_name]
    post, donor, tuned = (m["big"].reshape(-1) for m in trio_tensors(dtype, seed=11))
    arrays = [t.view(INT_VIEW[dtype]).numpy().view(STORAGE[dtype_name]) for t in (post, donor, tuned)]
    got = NumpyKernel(scale).graft(dtype_name, *arrays)
    want = torch_formula(post, donor, tuned, scale)
    assert np.array_equal(got.view(bits(want).numpy().dtype), bits(want).numpy())


def test_inputs_stored_in_other_dtypes_match_torch(tmp_path):
    # A bf16 post and donor tuned and saved in fp32 (and a donor in fp16): each input is widened from
    # its own dtype, the result stored as post's.
    dirs = []
    for role, dtype in enumerate((torch.bfloat16, torch.float16, torch.float32)):
        (tmp_path / str(role)).mkdir()
        save_file(trio_tensors(dtype, seed=5)[role], tmp_path / str(role) / "model.safetensors")
        (tmp_path / str(role) / "config.json").write_text("{}")
        dirs.append(tmp_path / str(role))
    graft(*dirs, 0.5, tmp_path / "numpy", allow_nonfinite=True)
    graft(*dirs, 0.5, tmp_path / "torch", project=identity, allow_nonfinite=True)
    ours, theirs = (load_file(tmp_path / d / "model.safetensors") for d in ("numpy", "torch"))
    inputs = [load_file(d / "model.safetensors") for d in dirs]
    for name, got in ours.items():
        want = inputs[0][name] if name == "ids" else torch_formula(*(m[name] for m in inputs), 0.5)
        assert got.dtype == inputs[0][name].dtype, name
        assert torch.equal(bits(got), bits(want)) and torch.equal(bits(got), bits(theirs[name])), name
