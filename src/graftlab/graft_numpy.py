"""The identity graft's elementwise kernel in numpy: ``post + scale * (donor_tuned - donor)`` for one
block of a bf16, fp16, fp32 or fp64 tensor, bit for bit what the torch kernel in graftlab.graft writes.

No torch: importing torch took 2 s of the 4.5 s a torch graft took at Qwen3-0.6B here, while
the arithmetic needs nothing numpy lacks. numpy has no bfloat16, but bf16 is the top half of an fp32:
widening is a 16-bit shift of the bits, and narrowing rounds the fp32 bit pattern to nearest, ties to
even, as torch's cast does. Every step is the same IEEE single-precision operation, in the same order,
as torch's (subtract, multiply by the fp32 scale, add; no fused multiply-add), so the results agree
to the bit; tests/test_graft_numpy.py checks it against torch on special values.
"""

from __future__ import annotations

import math

import numpy as np

from graftlab.io.fp32_numpy import STORAGE, widen_bf16

# torch's vectorised fp32 -> bf16 cast writes every NaN as 0xFFFF (its scalar cast would write 0x7FC0;
# torch's contiguous copies take the vectorised one, tail elements included).
BF16_NAN = 0xFFFF

# Elements per pass over the scratch: each block goes through about a dozen numpy operations, and at
# 128 Ki elements the three fp32 buffers (1.5 MiB) stay in cache between them while the per-call
# overhead of numpy (about a microsecond) stays small. 32 Ki elements took 1.3x as long.
PASS_ELEMENTS = 1 << 17

# Measured and rejected for the bf16 pass (Qwen3-0.6B, one core here; the pairs pass below takes
# 2.6-3.0 ns an element, 1.7 s of a 3.0 s graft, the rest being reads and writes). Every numpy
# operation streams its buffers through L2 at about 0.15 ns per 4-byte element, plus ~0.6 us a call,
# so only fewer passes help, and these give no fewer or no cheaper ones:
#   ml_dtypes casts: bf16 -> fp32 0.45 ns an element (pairs: 0.15), fp32 -> bf16 1.3 ns (the rounding
#     below: ~0.8); and it writes NaN as 0x7FC0/0xFFC0, not torch's 0xFFFF, so a fix-up stays.
#   a (n, 2) uint16 buffer with zero low halves, filled by ``buf[:, 1] = x``: 0.36 ns (strided copy).
#   both halves' results in one (2, m) buffer, one NaN check and one rounding over both (20 numpy
#     calls a pass instead of 25): no faster (2.7-2.8 against 2.5-2.7 ns, best of runs).
#   numexpr fusing ``p + s * (t - d)`` (bit-identical in fp32): 115-145 us per 64 Ki elements against
#     24-38 us for numpy's three calls.
#   PASS_ELEMENTS 2**15, 2**16, 2**18: 3.9, 3.5, 3.8 ns against 3.5 at 2**17 (a busy machine).
# A fused compiled loop (numba, cached) runs at 0.33 ns an element, but importing numba and loading
# its cache cost 0.8 s a process: the whole 0.6B graft took 2.1-2.5 s against 2.7-2.8 s (byte floor
# 0.8-0.9 s), for a 200 MB dependency; not taken.

# The fused loop of all-bf16 blocks, compiled from graftlab/_kernel.c when the package is installed (one
# pass, 0.26-0.40 ns an element against the passes here at 2.8): the same bits. Optional at install, so
# a machine without a C compiler takes numpy's path.
try:
    from graftlab._kernel import graft_bf16 as _fused_bf16
except ImportError:
    _fused_bf16 = None

# uint32 constants, made once: numpy converts a Python int operand anew on every call.
_1, _16, _BIAS, _HIGH = (np.uint32(x) for x in (1, 16, 0x7FFF, 0xFFFF0000))
# A 16-bit float without its sign bit, and the smallest such bits of a NaN or Inf in bf16 and fp16.
_MAGNITUDE, _BF16_INF, _F16_INF = np.uint16(0x7FFF), 0x7F80, 0x7C00


def narrow_bf16(value: np.ndarray, scratch: np.ndarray, out: np.ndarray, has_nan: bool | None = None) -> np.ndarray:
    """fp32 to bf16 bit patterns as torch casts them: round to nearest, ties to even, on the bit pattern
    (_round_bf16_bits), and every NaN as BF16_NAN. ``scratch`` is uint32 of ``value``'s size; ``out`` uint16;
    ``has_nan`` whether ``value`` has a NaN, when the caller knows."""
    np.right_shift(_round_bf16_bits(value.view(np.uint32), scratch), 16, out=out, casting="unsafe")
    if has_nan is None:
        has_nan = _has_nan(value)
    if has_nan:
        out[np.isnan(value)] = BF16_NAN
    return out


class NumpyKernel:
    """Grafts blocks into a reused output buffer, through three fp32 buffers of PASS_ELEMENTS that each
    pass of numpy operations runs in, so that they stay in cache from one operation to the next."""

    def __init__(self, scale: float) -> None:
        self.scale = np.float32(scale)  # torch multiplies an fp32 tensor by a Python float in fp32
        self._out = np.empty(0, dtype=np.uint8)
        self._inputs = [np.empty(0, dtype=np.uint8) for _ in range(3)]
        self._fp32 = np.empty((3, PASS_ELEMENTS), dtype=np.float32)
        self._u32 = self._fp32.view(np.uint32)

    def input_buffers(self, sizes: list[int]) -> list[np.ndarray]:
        """Reused uint8 buffers of ``sizes`` bytes for the three inputs' blocks to be read into; each
        a separate allocation, so aligned as numpy aligns them."""
        for i, size in enumerate(sizes):
            if self._inputs[i].size < size:
                self._inputs[i] = np.empty(size, dtype=np.uint8)
        return [buffer[:size] for buffer, size in zip(self._inputs, sizes)]

    def graft(self, dtype: str, post: np.ndarray, donor: np.ndarray, tuned: np.ndarray) -> np.ndarray:
        """The grafted block, stored as ``dtype`` (post's), from the inputs' blocks: arrays (e.g. in
        input_buffers, left unchanged) of each one's STORAGE type, which may differ (a tuned donor saved
        in fp32 next to a bf16 post); returned as stored, valid until the next call."""
        n = post.size
        storage = np.dtype(STORAGE[dtype])
        if self._out.size < n * storage.itemsize:
            self._out = np.empty(n * storage.itemsize, dtype=np.uint8)
        out = self._out[: n * storage.itemsize].view(storage)
        if _fused_bf16 is not None and all(x.dtype == np.uint16 for x in (post, donor, tuned, out)):
            _fused_bf16(post, donor, tuned, out, float(self.scale))
            return out
        # 4-byte aligned even counts (PASS_ELEMENTS is even) of bf16 can be read as uint32 pairs.
        arrays = (post, donor, tuned, out)
        pairs = n % 2 == 0 and all(x.dtype == np.uint16 and x.ctypes.data % 4 == 0 for x in arrays)
        with np.errstate(all="ignore"):  # inf - inf, overflow in a cast: torch warns of neither
            for start in range(0, n, PASS_ELEMENTS):
                part = slice(start, min(start + PASS_ELEMENTS, n))
                arrays = post[part], donor[part], tuned[part], out[part]
                if not (pairs and self._bf16_pairs(*arrays)):
                    self._pass(dtype, *arrays)
        return out

    def finite(self, block: np.ndarray) -> bool:
        """Whether every element of ``block``, a stored block (STORAGE's type), is finite. A NaN or Inf
        in any input reaches its output element (``x - inf``, ``nan * s``), so checking the output alone
        covers the three inputs in one pass; the graft names the culprit only on failure. In slices of
        PASS_ELEMENTS, so the scratch stays in cache: at 2**20 elements one slice took 1.2 ns an
        element against 1.9 for the whole block, the fused kernel 2.0 (a busy machine). A graft of
        0.75B bf16 parameters took 4.75 s of CPU checked against 4.15 s unchecked (median of 5,
        alternated in one process, load ~12 on 2 cores)."""
        for start in range(0, block.size, PASS_ELEMENTS):
            part = block[start : start + PASS_ELEMENTS]
            if part.itemsize == 2:  # bf16, fp16: NaN and Inf are the patterns with every exponent bit set
                # (on the bits: numpy's fp16 min and max convert each element, 30x slower)
                scratch = self._u32.view(np.uint16)[0, : part.size]
                magnitude = np.bitwise_and(part.view(np.uint16), _MAGNITUDE, out=scratch)
                if magnitude.max() >= (_F16_INF if part.dtype == np.float16 else _BF16_INF):
                    return False
            elif not (math.isfinite(part.min()) and math.isfinite(part.max())):  # min propagates NaN
                return False
        return True

    def _pass(self, dtype: str, post: np.ndarray, donor: np.ndarray, tuned: np.ndarray, out: np.ndarray) -> None:
        """``out = post + scale * (tuned - donor)``, in torch's order of fp32 operations."""
        a, b, c = (buffer[: post.size] for buffer in self._fp32)
        theta = self._theta(dtype, post, donor, tuned, a, b, c, exact_nans=False)
        has_nan = _has_nan(theta)
        if has_nan and dtype != "BF16":  # bf16 writes every NaN alike
            theta = self._theta(dtype, post, donor, tuned, a, b, c, exact_nans=True)
        if dtype == "BF16":
            narrow_bf16(theta, c.view(np.uint32), out, has_nan)
        else:  # numpy's fp16 and fp64 casts round to nearest even, as torch's do
            np.copyto(out, theta, casting="same_kind")

    def _bf16_pairs(self, post: np.ndarray, donor: np.ndarray, tuned: np.ndarray, out: np.ndarray) -> bool:
        """The bf16 pass on pairs of elements, each pair read as one uint32 whose low half is the even
        element: ``x << 16`` is the even element's fp32, ``x & 0xFFFF0000`` the odd one's. This widens
        without numpy's casts between integer widths, the slowest operations of the general pass:
        2.6 ns an element against 3.7 on one core here. Returns False, writing nothing, when a result is
        NaN: the general pass writes those. (Written out flat: numpy's per-call overhead counts here.)"""
        p, d, t, o = (x.view(np.uint32) for x in (post, donor, tuned, out))
        a, b, c = self._u32[0, : p.size], self._u32[1, : p.size], self._u32[2, : p.size]
        delta, theta = self._fp32[1, : p.size], self._fp32[2, : p.size]
        for odd in (False, True):
            widen = _odd_fp32 if odd else _even_fp32
            widen(t, b)
            widen(d, c)
            np.subtract(delta, theta, out=delta)
            np.multiply(delta, self.scale, out=delta)
            widen(p, c)
            np.add(delta, theta, out=theta)
            if math.isnan(theta.min()):
                return False
            rounded = _round_bf16_bits(c, b)  # top halves: the bf16 results
            if odd:
                np.bitwise_or(a, np.bitwise_and(rounded, _HIGH, out=rounded), out=o)
            else:
                np.right_shift(rounded, _16, out=a)  # kept in a until the odd half joins it
        return True

    def _theta(self, dtype: str, *arrays: np.ndarray, exact_nans: bool) -> np.ndarray:
        """The fp32 result in ``a``, from the stored inputs (left intact).

        When both operands of an operation are NaN, torch's kernels return the second one's, numpy's
        the first one's. Adding delta to post (rather than post to delta) costs nothing; subtracting
        donor the same way needs a pass more (adding donor times -1, which keeps a NaN's sign, unlike
        negation), taken only for the rare passes whose result has a NaN. Each way the numbers are
        the same: t + (-1 * d) is t - d, rounding included."""
        post, donor, tuned, a, b, c = arrays
        delta = _widen(tuned, b)
        if exact_nans:
            np.add(np.multiply(_widen(donor, c), -1, out=c), delta, out=delta)
        else:
            np.subtract(delta, _widen(donor, c), out=delta)
        np.multiply(delta, self.scale, out=delta)
        return np.add(delta, _widen(post, a), out=a)


def _widen(raw: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``raw``, stored as one of STORAGE's types, as fp32 in ``out``."""
    if raw.dtype == np.uint16:
        return widen_bf16(raw, out.view(np.uint32))
    np.copyto(out, raw, casting="same_kind")  # exact from fp16; fp64 rounds to nearest even, as in torch
    return out


def _has_nan(value: np.ndarray) -> bool:
    return bool(value.size) and math.isnan(value.min())  # min propagates NaN: one read-only pass finds any


def _round_bf16_bits(bits: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``bits`` (fp32 bit patterns) plus 0x7FFF plus their bit 16, in ``out``: the top halves are then
    the bf16s rounded to nearest, ties to even (a carry out of the dropped half happens exactly when
    it is above the tie, or at it with an odd kept half; overflow carries into the exponent and
    gives inf, as it should). NaNs come out wrong (a negative one wraps round): callers replace them."""
    np.right_shift(bits, _16, out=out)
    np.bitwise_and(out, _1, out=out)
    np.add(out, _BIAS, out=out)
    return np.add(out, bits, out=out)


def _even_fp32(pairs: np.ndarray, out: np.ndarray) -> None:
    np.left_shift(pairs, _16, out=out)


def _odd_fp32(pairs: np.ndarray, out: np.ndarray) -> None:
    np.bitwise_and(pairs, _HIGH, out=out)
