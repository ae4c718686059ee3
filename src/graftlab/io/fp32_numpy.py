"""Float tensors of safetensors files as fp32 numpy arrays, read one at a time, without torch.

For analyses that only sum and compare weights (the sensitivity job): importing torch would be most of
such a job's time. numpy has no bfloat16, and safetensors' numpy API refuses to read one, so every
tensor is read as stored, a bf16 one as its raw uint16 bit patterns, and widened to fp32 exactly
(`widen_bf16`: the bits become the fp32's top half), as torch's `.float()` does. Reads are
plain file reads at the byte ranges the checked headers give (`safetensors_io.tensor_specs`), not memory
maps, whose touched pages would stay resident while a model is streamed (see graftlab.graft).
"""

from __future__ import annotations

import os
from io import FileIO
from pathlib import Path

import numpy as np

from graftlab.errors import GraftlabError
from graftlab.io.safetensors_io import TensorSpec, tensor_index, tensor_specs

# How each dtype the numpy readers and kernels compute is stored, as numpy reads it. Other floating dtypes (fp8) have
# no numpy type: a graft computes those with torch.
STORAGE = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32, "F64": np.float64}


def widen_bf16(raw: np.ndarray, out: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (uint16) to fp32, exactly: the bits become the fp32's top half. ``out`` is uint32."""
    return np.left_shift(raw, 16, out=out, dtype=np.uint32).view(np.float32)


class Fp32Reader:
    """`read(name)`: one tensor as a new fp32 array of its shape; each file opened once, until `close()`.
    Reads BF16, F16, F32 and F64 tensors (STORAGE); any other dtype is an error naming the tensor."""

    def __init__(self, index: dict[str, Path], specs: dict[str, TensorSpec]) -> None:
        """`index`: tensor name -> file holding it; `specs`: each tensor's header entry (tensor_specs)."""
        self.index, self.specs = index, specs
        self._files: dict[Path, FileIO] = {}

    @classmethod
    def of_model(cls, model_dir: str | Path, specs: dict[str, TensorSpec] | None = None) -> Fp32Reader:
        """A reader of a model directory (one file or shards); `specs`, when its headers were read already."""
        index = tensor_index(model_dir)
        return cls(index, tensor_specs(model_dir, index) if specs is None else specs)

    def __call__(self, name: str) -> np.ndarray:
        spec, file = self.specs[name], self.index[name]
        storage = STORAGE.get(spec.dtype_name)
        if storage is None:
            raise GraftlabError(
                f"{file}: tensor {name} is stored as {spec.dtype_name}; only {sorted(STORAGE)} can be read here"
            )
        raw = np.empty(spec.numel, dtype=storage)
        self._read_into(file, spec.file_offset, raw, name)
        if spec.dtype_name == "BF16":
            value = widen_bf16(raw, np.empty(spec.numel, dtype=np.uint32))
        else:  # fp16 widens exactly; fp64 rounds to nearest even, as torch's .float() does
            value = raw if raw.dtype == np.float32 else raw.astype(np.float32)
        return value.reshape(spec.shape)

    def _read_into(self, file: Path, start: int, out: np.ndarray, name: str) -> None:
        if file not in self._files:
            self._files[file] = FileIO(file, "r")
        fd, view, done = self._files[file].fileno(), memoryview(out).cast("B"), 0
        while done < len(view):  # a read may return fewer bytes than asked
            got = os.preadv(fd, [view[done:]], start + done)
            if not got:
                raise GraftlabError(f"{file}: ends inside tensor {name} (truncated?)")
            done += got

    def close(self) -> None:
        while self._files:
            self._files.popitem()[1].close()

    def __enter__(self) -> Fp32Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
