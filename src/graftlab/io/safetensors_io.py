"""Safetensors I/O of model directories: tensor indexes, headers read without the safetensors library,
a lazy per-tensor reader and a streaming writer.

Standard library only at import time: torch dtypes are looked up when first asked for, safetensors only
inside `open_tensors`. The graft's identity path reads and writes through this module without torch,
and start-up is a large share of a graft's wall time (benchmarks/README.md).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from graftlab.errors import GraftlabError

if TYPE_CHECKING:
    import torch

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

# A header larger than this is a corrupt or hostile file, not a model (the safetensors library uses
# the same bound).
_MAX_HEADER_BYTES = 100_000_000

# Bytes per element of every safetensors dtype graftlab reads, and which of them are floating point:
# enough to lay out, check and copy tensors without torch.
ITEMSIZES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}
FLOATING = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"})


@functools.cache
def _torch_dtypes() -> dict[str, torch.dtype]:
    import torch

    return {
        "F64": torch.float64,
        "F32": torch.float32,
        "F16": torch.float16,
        "BF16": torch.bfloat16,
        "I64": torch.int64,
        "I32": torch.int32,
        "I16": torch.int16,
        "I8": torch.int8,
        "U8": torch.uint8,
        "BOOL": torch.bool,
        "F8_E4M3": torch.float8_e4m3fn,
        "F8_E5M2": torch.float8_e5m2,
    }


@dataclass(frozen=True)
class TensorSpec:
    """What a safetensors header says about one tensor."""

    dtype_name: str  # as the header spells it ("BF16"); `dtype` is torch's, looked up on demand
    shape: tuple[int, ...]
    offset: int = 0  # start of its bytes in the file's data section; orders reads front to back
    file_offset: int = 0  # start of its bytes in the file itself: where an explicit read seeks to

    @property
    def dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype_name)

    @property
    def itemsize(self) -> int:
        return ITEMSIZES[self.dtype_name]

    @property
    def is_floating_point(self) -> bool:
        return self.dtype_name in FLOATING

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


def _check_dtype_name(name: str) -> str:
    if name not in ITEMSIZES:
        raise GraftlabError(f"unsupported safetensors dtype {name!r}")
    return name


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype string (``"BF16"`` -> ``torch.bfloat16``); imports torch."""
    return _torch_dtypes()[_check_dtype_name(name)]


def dtype_name(dtype: torch.dtype | str) -> str:
    """The safetensors dtype string of a torch dtype (a string is checked and returned as it is)."""
    if isinstance(dtype, str):
        return _check_dtype_name(dtype)
    names = {v: k for k, v in _torch_dtypes().items()}
    try:
        return names[dtype]
    except KeyError:
        raise GraftlabError(f"dtype {dtype} cannot be stored in safetensors") from None


def tensor_index(model_dir: str | Path) -> dict[str, Path]:
    """Map every tensor name of a model directory to the safetensors file holding it."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise GraftlabError(f"model directory not found: {model_dir}")
    index_file = model_dir / INDEX_NAME
    if index_file.is_file():
        try:
            weight_map = json.loads(index_file.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise GraftlabError(f"{index_file}: not a safetensors index with a weight_map ({e})") from None
        index = {name: model_dir / shard for name, shard in weight_map.items()}
        for shard in sorted(set(index.values())):
            if not shard.is_file():
                raise GraftlabError(f"shard {shard} named in {index_file} does not exist")
        return index
    single = model_dir / SINGLE_NAME
    if not single.is_file():
        raise GraftlabError(f"no {SINGLE_NAME} or {INDEX_NAME} in {model_dir}")
    return {name: single for name in read_header(single) if name != "__metadata__"}


@contextlib.contextmanager
def open_tensors(model_dir: str | Path) -> Iterator[Callable[[str], torch.Tensor]]:
    """`get(name)` for one model, each shard opened once; a tensor is read only when asked for, so
    analyses that compare several models stream them one tensor at a time."""
    from safetensors import safe_open

    index = tensor_index(model_dir)
    with contextlib.ExitStack() as stack:
        files = {f: stack.enter_context(safe_open(str(f), framework="pt")) for f in set(index.values())}
        yield lambda name: files[index[name]].get_tensor(name)


def refuse_nonfinite(model_dir: str | Path, role: str = "model") -> None:
    """Refuse a model directory whose floating tensors hold a NaN or Inf, naming the first such tensor:
    a Fisher or a fine-tune started from it is NaN throughout, without a word. Every shard's header is
    checked first (tensor_specs), so a truncated file is named rather than failing inside the library."""
    import torch

    index = tensor_index(model_dir)
    tensor_specs(model_dir, index)
    with open_tensors(model_dir) as get:
        for name in sorted(index):
            tensor = get(name)
            if tensor.is_floating_point():
                bad = tensor.numel() - int(torch.isfinite(tensor).sum())
                if bad:
                    raise GraftlabError(f"{role} {model_dir}: tensor {name} holds {bad} NaN or Inf value(s)")


def read_header(file: str | Path) -> dict[str, Any]:
    """The JSON header of a safetensors file (dtype, shape, data_offsets per tensor, plus
    ``__metadata__``); reads only the header bytes, never tensor data."""
    return _read_header(Path(file))[0]


def _read_header(file: Path) -> tuple[dict[str, Any], int, int]:
    """The header, the file offset where the data section starts, and the data section's length."""
    try:
        with open(file, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise GraftlabError(f"{file}: too short to be a safetensors file")
            (size,) = struct.unpack("<Q", prefix)
            if size > _MAX_HEADER_BYTES:
                raise GraftlabError(f"{file}: header length {size} is implausible; not a safetensors file")
            raw = f.read(size)
            file_size = os.fstat(f.fileno()).st_size
    except FileNotFoundError:
        raise GraftlabError(f"safetensors file not found: {file}") from None
    except OSError as e:
        raise GraftlabError(f"cannot read {file}: {e.strerror}") from None
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise GraftlabError(f"{file}: safetensors header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise GraftlabError(f"{file}: safetensors header is not a JSON object")
    return header, 8 + size, file_size - 8 - size


def tensor_specs(model_dir: str | Path, index: dict[str, Path] | None = None) -> dict[str, TensorSpec]:
    """dtype, shape and byte position of every tensor of a model directory, from headers alone.

    Each tensor's byte range is checked against its dtype, shape and the file's length, so a reader
    that seeks to ``file_offset`` (the graft does) can trust it without the safetensors library."""
    index = tensor_index(model_dir) if index is None else index
    specs: dict[str, TensorSpec] = {}
    for file in sorted(set(index.values())):
        header, data_start, data_length = _read_header(file)
        for name, entry in header.items():
            if name != "__metadata__" and index.get(name) == file:
                specs[name] = _spec(file, name, entry, data_start, data_length)
    missing = sorted(set(index) - set(specs))
    if missing:
        raise GraftlabError(f"tensor {missing[0]} is listed in the index of {model_dir} but absent from its shard")
    return specs


def spec_differences(
    reference: dict[str, TensorSpec], specs: dict[str, TensorSpec]
) -> tuple[list[str], list[str], list[str]]:
    """How ``specs`` departs from ``reference``: names missing, names extra, common names whose shape
    differs, each sorted. Graft, drift and sensitivity all refuse models that are not one architecture."""
    missing = sorted(reference.keys() - specs.keys())
    extra = sorted(specs.keys() - reference.keys())
    shapes = sorted(n for n in reference.keys() & specs.keys() if reference[n].shape != specs[n].shape)
    return missing, extra, shapes


def _spec(file: Path, name: str, entry: Any, data_start: int, data_length: int) -> TensorSpec:
    try:
        dtype, shape, (start, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
    except (KeyError, TypeError, ValueError):
        raise GraftlabError(f"{file}: header entry of tensor {name} lacks a dtype, shape or data_offsets") from None
    spec = TensorSpec(_check_dtype_name(dtype), shape, start, data_start + start)
    if end - start != spec.nbytes or start < 0:
        raise GraftlabError(
            f"{file}: tensor {name} spans bytes {start}-{end}, but {entry['dtype']} {list(shape)} needs {spec.nbytes}"
        )
    if end > data_length:
        raise GraftlabError(
            f"{file}: tensor {name} ends at byte {end} of a {data_length}-byte data section (truncated?)"
        )
    return spec


class SafetensorsWriter:
    """Writes one safetensors file tensor by tensor, so a model never has to sit in memory whole.

    The safetensors library only saves complete dicts of tensors (no streaming writer), hence this
    small hand-written one. The format is: 8-byte little-endian header length, a JSON header padded
    with spaces to a multiple of 8 bytes, then the raw little-endian bytes of every tensor in header
    order. Because all shapes are declared up front, the header is written first and tensors are
    appended as they are computed; a tensor may arrive whole or as consecutive row blocks.
    """

    def __init__(self, path: str | Path, specs: Sequence[tuple[str, torch.dtype | str, Sequence[int]]]) -> None:
        """``specs``: each tensor's name, dtype (torch's, or the safetensors string) and shape, in file order."""
        self.path = Path(path)
        self._specs = [(name, dtype_name(dtype), tuple(shape)) for name, dtype, shape in specs]
        if len({name for name, _, _ in self._specs}) != len(self._specs):
            raise GraftlabError(f"{self.path}: duplicate tensor names declared")
        self._pos = 0  # index of the tensor being written
        self._rows = 0  # rows of it written so far
        header = self._header()  # before opening, so a bad declaration leaves no file behind
        self._file: BinaryIO | None = open(self.path, "wb")
        # Not preallocated (posix_fallocate): at Qwen3-0.6B on ext4 here a graft then took 5.6-6.6 s
        # against 3.0-4.2 s, the system time of writing into unwritten extents.
        self._file.write(header)

    def _header(self) -> bytes:
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, dtype, shape in self._specs:
            end = offset + math.prod(shape) * ITEMSIZES[dtype]
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, end]}
            offset = end
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # tensor data must start 8-byte aligned
        return struct.pack("<Q", len(raw)) + raw

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append ``tensor``: the next declared tensor whole, or its next block of rows."""
        import torch

        self._next(name, dtype_name(tensor.dtype))
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        self.write_bytes(name, tuple(tensor.shape), data.numpy())

    def write_bytes(self, name: str, shape: Sequence[int], data: Any) -> None:
        """Append the raw little-endian bytes ``data`` (any contiguous buffer, e.g. a numpy array) of
        the next declared tensor whole, or of its next block of rows, of ``shape``. The torch-free
        way in: the bytes are checked against the declared dtype's size, not a dtype of their own."""
        _, want_dtype, want_shape = self._next(name)
        shape = tuple(shape)
        rows = self._check_shape(name, shape, want_shape)
        view = memoryview(data).cast("B")
        if len(view) != math.prod(shape) * ITEMSIZES[want_dtype]:
            raise GraftlabError(f"{self.path}: tensor {name} block of shape {list(shape)} came as {len(view)} bytes")
        self._file.write(view)
        self._rows += rows
        if not want_shape or self._rows == want_shape[0]:
            self._pos, self._rows = self._pos + 1, 0

    def _next(self, name: str, dtype: str | None = None) -> tuple[str, str, tuple[int, ...]]:
        """The declaration of the tensor to write next, checked against ``name`` (and ``dtype``)."""
        if self._file is None:
            raise GraftlabError(f"{self.path}: writer is closed")
        if self._pos >= len(self._specs):
            raise GraftlabError(f"{self.path}: tensor {name} was not declared (all declared tensors written)")
        want = self._specs[self._pos]
        if name != want[0]:
            raise GraftlabError(f"{self.path}: expected tensor {want[0]} next, got {name}")
        if dtype is not None and dtype != want[1]:
            raise GraftlabError(f"{self.path}: tensor {name} has dtype {dtype}, declared {want[1]}")
        return want

    def _check_shape(self, name: str, shape: tuple[int, ...], want: tuple[int, ...]) -> int:
        """Rows contributed by a block of ``shape`` towards a tensor of shape ``want``."""
        if shape == want and self._rows == 0:
            return want[0] if want else 1
        if not want or shape[1:] != want[1:] or self._rows + shape[0] > want[0]:
            raise GraftlabError(
                f"{self.path}: tensor {name} block of shape {list(shape)} does not fit declared shape "
                f"{list(want)} after {self._rows} rows"
            )
        return shape[0]

    def close(self) -> None:
        """Finish the file; refuses (and leaves the file incomplete) if a declared tensor is missing."""
        if self._file is None:
            return
        self._file.close()
        self._file = None
        if self._pos < len(self._specs):
            raise GraftlabError(f"{self.path}: tensor {self._specs[self._pos][0]} was declared but not written")

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
        elif self._file is not None:
            # The caller's exception is the story; the file is garbage that atomic_dir removes.
            self._file.close()
            self._file = None


def read_config(model_dir: str | Path) -> dict[str, Any] | None:
    """The model's config.json, or None when it has none."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise GraftlabError(f"{path}: not valid JSON ({e})") from None
