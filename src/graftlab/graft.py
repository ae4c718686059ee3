"""Grafting (docs/methods.md): ``theta = post + scale * P(donor_tuned - donor)``, streamed tensor by tensor.

Each tensor is computed in fp32 and cast back to the post model's dtype. Nothing ever holds a whole
model: tensors are read one at a time (large ones in row blocks) into reused buffers and appended to
the output as they are finished. Model merging is the case donor == post.

Two kernels compute a block, bit for bit alike: numpy's (graftlab.graft_numpy) for the identity graft
of bf16, fp16, fp32 and fp64 tensors, and torch's for a projection (masks take and return torch
tensors) and for fp8. torch is imported only when its kernel is first needed: at Qwen3-0.6B, importing
it took 2 s of the 4.5 s an identity graft took, against 0.2 s for numpy. Nothing else heavy is imported
(not transformers, not even safetensors, whose headers graftlab.io.safetensors_io parses itself).
"""

from __future__ import annotations

import collections
import contextlib
import json
import math
import os
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from io import FileIO
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from graftlab.errors import GraftlabError
from graftlab.graft_numpy import NumpyKernel
from graftlab.io.atomic import atomic_dir
from graftlab.io.fetch import copy_model_files
from graftlab.io.fp32_numpy import STORAGE, widen_bf16
from graftlab.io.gates import number, output
from graftlab.io.provenance import write_provenance
from graftlab.io.safetensors_io import (
    INDEX_NAME,
    ITEMSIZES,
    SINGLE_NAME,
    SafetensorsWriter,
    TensorSpec,
    read_config,
    spec_differences,
    tensor_index,
    tensor_specs,
    torch_dtype,
)

if TYPE_CHECKING:
    import torch

# P(delta) for one tensor: receives the tensor's name and its whole fp32 delta (scratch memory, valid
# during the call and free to modify in place), returns the projected delta (same shape). Fisher masks
# and KFAC projections plug in here; KFAC mixes rows, so a projected tensor is always handed over
# whole rather than in row blocks.
Projection = Callable[[str, "torch.Tensor"], "torch.Tensor"]

# Hugging Face's default shard size: below it one file is simplest for every consumer.
MAX_SHARD_BYTES = 5 * 10**9

ROLES = ("post", "donor", "donor_tuned")


class _Model:
    """One input model: its tensor index and header specs, and its shard files opened lazily.

    Tensors are read one block at a time into buffers the caller reuses, not through memory maps
    (``safe_open``): every page of a mapped file that has been touched counts towards the process's
    RSS until the file is unmapped, which at Qwen3-0.6B kept 1.9 GiB resident (a shard of each input
    at a time) against 160 MiB of actual scratch memory. Mapping one block at a time (MAP_POPULATE)
    was no better: at Qwen3-0.6B it took 5.6-7.4 s against 3.2-5.5 s for reads on freshly written
    inputs (page-table work, in the kernel), and only 10% less on older ones.
    """

    def __init__(self, role: str, path: str | Path) -> None:
        self.role, self.path = role, Path(path)
        self.index = tensor_index(self.path)
        self.specs = tensor_specs(self.path, self.index)
        self.config = read_config(self.path)
        if self.config is None:
            # Without it the vocabulary cannot be compared, and a post without one grafts a model
            # that nothing can load.
            raise GraftlabError(f"{role} model {self.path} has no config.json: not a model directory")
        self._files: dict[Path, FileIO] = {}
        self._opening = threading.Lock()  # blocks may be read by several threads
        self._unread = Counter(self.index.values())

    def _where(self, name: str, rows: slice | None) -> tuple[int, int, int]:
        """The open file descriptor holding tensor ``name`` (or its block of ``rows``), and the
        block's first byte and length in it."""
        spec, file = self.specs[name], self.index[name]
        start, nbytes = spec.file_offset, spec.nbytes
        if rows is not None:
            row_bytes = spec.nbytes // spec.shape[0]
            start, nbytes = start + rows.start * row_bytes, (rows.stop - rows.start) * row_bytes
        with self._opening:
            if file not in self._files:
                self._files[file] = FileIO(file, "r")
            return self._files[file].fileno(), start, nbytes

    def read(self, name: str, rows: slice | None, out: np.ndarray) -> np.ndarray:
        """Read tensor ``name`` (or its block of ``rows``) as stored into ``out``, a contiguous array
        of exactly the block's bytes (any numpy dtype); returns ``out``."""
        fd, start, _ = self._where(name, rows)
        view = memoryview(out).cast("B")
        done = 0
        while done < len(view):  # a read may return fewer bytes than asked
            got = os.preadv(fd, [view[done:]], start + done)
            if not got:
                raise GraftlabError(f"{self.index[name]}: ends inside tensor {name} (truncated while grafting?)")
            done += got
        return out

    def finished(self, name: str) -> None:
        """Close a shard once all its tensors are done, so that a model of hundreds of shards never
        holds hundreds of open files."""
        file = self.index[name]
        self._unread[file] -= 1
        if self._unread[file] == 0 and file in self._files:
            self._files.pop(file).close()

    def close(self) -> None:
        while self._files:
            self._files.popitem()[1].close()


def _vocab_size(config: dict[str, Any] | None) -> int | None:
    if config is None:
        return None
    # Multimodal configs keep the language model's vocabulary in a nested text_config.
    return config.get("vocab_size", (config.get("text_config") or {}).get("vocab_size"))


def _few(items: list[str], shown: int = 3) -> str:
    more = f", and {len(items) - shown} more" if len(items) > shown else ""
    return ", ".join(items[:shown]) + more


def _is_vocab_tensor(name: str) -> bool:
    return "embed_tokens" in name or name.startswith("lm_head") or name.endswith("wte.weight")


def _mismatches(post: _Model, other: _Model) -> list[str]:
    """Every way ``other`` differs from ``post`` in tensor names, shapes and vocabulary."""
    problems: list[str] = []
    post_vocab, other_vocab = _vocab_size(post.config), _vocab_size(other.config)
    config_vocab_differs = None not in (post_vocab, other_vocab) and post_vocab != other_vocab
    if config_vocab_differs:
        problems.append(f"vocabulary size {other_vocab} vs post's {post_vocab} (config.json vocab_size)")
    missing, extra, shapes_differ = spec_differences(post.specs, other.specs)
    if missing:
        problems.append(f"{len(missing)} tensor(s) missing: {_few(missing)}")
    if extra:
        problems.append(f"{len(extra)} extra tensor(s): {_few(extra)}")
    shapes, vocab_rows = [], []
    for name in shapes_differ:
        want, got = post.specs[name].shape, other.specs[name].shape
        shapes.append(f"{name} {list(got)} vs post {list(want)}")
        if _is_vocab_tensor(name) and want[1:] == got[1:]:
            vocab_rows.append(f"{name} has {got[0]} rows vs post's {want[0]}")
    kinds = sorted(
        n
        for n in post.specs.keys() & other.specs.keys()
        if post.specs[n].is_floating_point != other.specs[n].is_floating_point
    )
    if kinds:
        problems.append(f"{len(kinds)} tensor(s) floating point in one model only: {_few(kinds)}")
    if vocab_rows and not config_vocab_differs:
        problems.append(f"vocabulary differs: {_few(vocab_rows)}")
    if shapes:
        problems.append(f"{len(shapes)} shape difference(s): {_few(shapes)}")
    return problems + _tokenizer_differences(post.path, other.path)


# Files that fix token ids; a tokenizer_config.json may differ in chat template or padding side alone,
# which changes no id.
TOKENIZER_VOCAB_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model", "vocab.txt", "added_tokens.json")


def _token_ids(path: Path) -> Any:
    """What ``path`` says about token ids: tokenizer.json's vocabulary and added tokens, another
    JSON's content, or the bytes of anything else."""
    if path.suffix != ".json":
        return path.read_bytes()
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise GraftlabError(f"{path}: not valid JSON ({e})") from None
    if path.name == "tokenizer.json" and isinstance(data, dict):
        added = sorted((t.get("id"), t.get("content")) for t in data.get("added_tokens") or [])
        return (data.get("model") or {}).get("vocab"), added
    return data


def _tokenizer_differences(post: Path, other: Path) -> list[str]:
    """Tokenizer files both directories hold that map tokens to different ids: a graft adds the rows
    of embedding matrices, which is meaningless across vocabularies even of one size."""
    problems = []
    for name in TOKENIZER_VOCAB_FILES:
        mine, theirs = post / name, other / name
        if not (mine.is_file() and theirs.is_file()):
            continue
        # Equal bytes are the rule (one tokenizer, copied); parsing a 10 MB tokenizer.json is not free.
        if mine.read_bytes() != theirs.read_bytes() and _token_ids(mine) != _token_ids(theirs):
            problems.append(f"tokenizer differs from post's ({name} maps tokens to other ids)")
    return problems


def _validate(models: list[_Model], out: Path) -> None:
    post = models[0]
    if not post.specs:
        raise GraftlabError(f"post model {post.path} has no tensors")
    reports = []
    for other in models[1:]:
        problems = _mismatches(post, other)
        if problems:
            reports.append(f"{other.role} {other.path}: " + "; ".join(problems))
    if reports:
        raise GraftlabError(f"models do not match post {post.path}: " + " | ".join(reports))
    output(out, {f"the {model.role} model": model.path for model in models}, "output directory")


def _layout(post: _Model) -> list[str]:
    """Output tensor order: widest dtype first, so every tensor's offset stays aligned to its item
    size (as the safetensors library arranges it); within a dtype, post's file order, so each input
    shard is read front to back."""
    specs = post.specs
    return sorted(specs, key=lambda n: (-specs[n].itemsize, str(post.index[n]), specs[n].offset))


def _plan_shards(order: list[str], specs: dict[str, TensorSpec], max_bytes: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for name in order:
        if shards[-1] and size + specs[name].nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += specs[name].nbytes
    return shards


def _row_blocks(spec: TensorSpec, chunk_bytes: int) -> list[slice | None]:
    """Row ranges to process ``spec``'s tensor in, each about ``chunk_bytes`` of fp32; [None] = whole."""
    fp32_bytes = spec.numel * 4
    if not spec.shape or fp32_bytes <= chunk_bytes:
        return [None]
    rows = spec.shape[0]
    step = max(1, chunk_bytes // (fp32_bytes // rows))
    return [slice(start, min(start + step, rows)) for start in range(0, rows, step)]


class _Grafter:
    """Grafts tensors one block of rows at a time, in order, for the writer.

    Small blocks matter: each block passes through its buffers about ten times (read, widen, subtract,
    scale, add, round, write), and blocks of 4 MiB of fp32 keep those passes in the CPU cache: with
    torch's kernel at Qwen3-0.6B on one thread 1.0 s, against 1.9 s with 8 MiB blocks, 3.8 s with
    64 MiB and 1.6 s with 1 MiB (per-block overheads).

    With ``workers`` >= 2, numpy's blocks are computed by that many threads (reads and numpy's
    operations release the GIL) while this thread writes finished blocks in order; each block has a
    kernel (scratch) of its own, reused only once its block has been written. On the 2-CPU machine
    here that was no faster than one thread (see graft()), hence not the default.
    """

    def __init__(
        self,
        models: list[_Model],
        scale: float,
        project: Projection | None,
        chunk_bytes: int,
        workers: int,
        check_finite: bool = True,
    ) -> None:
        self.models, self.scale, self.project, self.chunk_bytes = models, scale, project, chunk_bytes
        self.check_finite = check_finite
        self.grafted = 0  # tensors computed rather than copied
        self._torch: _TorchKernel | None = None
        torch_needed = any(self._needs_torch(name) for name in models[0].specs)
        # torch's kernel has one scratch and a projection may keep state: those grafts stay serial.
        self.workers = 0 if torch_needed or workers < 2 else workers
        # Reuse matters: a large fresh allocation is handed back to the OS when freed and page-faulted
        # in again on its next use, which measured 4x slower than writing into a warm buffer.
        self._kernels = [NumpyKernel(scale) for _ in range(self.workers + 1)]

    def _copies(self, spec: TensorSpec) -> bool:
        # scale 0 is post itself: copying skips arithmetic that would turn -0.0 into +0.0 or 0 * inf
        # into nan. Integer and bool tensors are buffers (ids, masks), never trained weights.
        return self.scale == 0 or not spec.is_floating_point

    def _needs_torch(self, name: str) -> bool:
        if self._copies(self.models[0].specs[name]):
            return False
        return self.project is not None or any(m.specs[name].dtype_name not in STORAGE for m in self.models)

    def blocks(self, names: list[str], stack: contextlib.ExitStack) -> Iterator[tuple[str, tuple, np.ndarray]]:
        """(name, shape, bytes) of each block of the tensors ``names``, in order; each block's bytes
        stay valid until the next is asked for. ``stack`` holds torch's thread count at 1 once the
        torch kernel exists."""
        items = []
        for name in names:
            spec = self.models[0].specs[name]
            whole = self.project is not None and not self._copies(spec)  # a projection sees whole tensors
            items += [(name, rows) for rows in ([None] if whole else _row_blocks(spec, self.chunk_bytes))]
            self.grafted += not self._copies(spec)
        if any(self._needs_torch(name) for name in names) and self._torch is None:
            self._torch = _TorchKernel(self.scale, self.project, self.check_finite)
            stack.enter_context(_torch_threads(1))  # after the kernel has noted the caller's count
        if not self.workers:
            for name, rows in items:
                yield self._block(self._kernels[0], name, rows)
                self._finished(name, rows)
            return
        pending: collections.deque = collections.deque()
        with ThreadPoolExecutor(self.workers) as pool:
            for i, (name, rows) in enumerate(items):
                if len(pending) == len(self._kernels):  # the kernel about to be reused has been written
                    yield from self._retire(pending.popleft())
                kernel = self._kernels[i % len(self._kernels)]
                pending.append((pool.submit(self._block, kernel, name, rows), rows))
            while pending:
                yield from self._retire(pending.popleft())

    def _retire(self, item: tuple[Future, slice | None]) -> Iterator[tuple[str, tuple, np.ndarray]]:
        future, rows = item
        block = future.result()
        yield block
        self._finished(block[0], rows)

    def _finished(self, name: str, rows: slice | None) -> None:
        spec = self.models[0].specs[name]
        if rows is None or rows.stop == spec.shape[0]:  # the tensor's last block
            for model in self.models:
                model.finished(name)

    def _block(self, kernel: NumpyKernel, name: str, rows: slice | None) -> tuple[str, tuple, np.ndarray]:
        try:
            block = self._compute(kernel, name, rows)
        except _NonFinite:
            self._refuse_nonfinite(name, rows)
        spec = self.models[0].specs[name]
        if self.check_finite and spec.is_floating_point and not _finite(kernel, block[2], spec.dtype_name):
            self._refuse_nonfinite(name, rows)
        return block

    def _refuse_nonfinite(self, name: str, rows: slice | None) -> None:
        """Raise the GraftlabError naming the input whose block of tensor ``name`` holds a NaN or Inf
        (read again: the failure is rare, the check of every block is not), or the overflow."""
        spec = self.models[0].specs[name]
        where = "" if rows is None else f" (rows {rows.start}-{rows.stop - 1})"
        for model in self.models if self.scale else self.models[:1]:  # scale 0 reads post alone
            dtype = model.specs[name].dtype_name
            shape = spec.shape if rows is None else (rows.stop - rows.start, *spec.shape[1:])
            raw = model.read(name, rows, np.empty(math.prod(shape) * ITEMSIZES[dtype], dtype=np.uint8))
            count = _count_nonfinite(raw, dtype)
            if count:
                raise GraftlabError(
                    f"{model.role} model {model.path}: tensor {name}{where} holds {count} NaN or Inf value(s); "
                    "the graft would carry them into the output (--allow-nonfinite grafts them anyway)"
                )
        raise GraftlabError(
            f"tensor {name}{where}: post + {self.scale} * delta overflows {spec.dtype_name} to Inf, the inputs "
            "being finite (--allow-nonfinite writes it anyway)"
        )

    def _compute(self, kernel: NumpyKernel, name: str, rows: slice | None) -> tuple[str, tuple, np.ndarray]:
        spec = self.models[0].specs[name]
        shape = spec.shape if rows is None else (rows.stop - rows.start, *spec.shape[1:])
        sizes = [math.prod(shape) * ITEMSIZES[model.specs[name].dtype_name] for model in self.models]
        buffers = kernel.input_buffers(sizes)
        if self._copies(spec):
            return name, shape, self.models[0].read(name, rows, buffers[0])
        dtypes = [model.specs[name].dtype_name for model in self.models]
        if self._needs_torch(name):

            def read(role: int, out: np.ndarray) -> np.ndarray:
                return self.models[role].read(name, rows, out)

            return name, shape, self._torch.graft(name, shape, dtypes, read)
        inputs = [m.read(name, rows, b).view(STORAGE[d]) for m, b, d in zip(self.models, buffers, dtypes)]
        return name, shape, kernel.graft(dtypes[0], *inputs)


class _NonFinite(Exception):
    """A block's delta holds a NaN or Inf that a projection might hide (a mask zeroes entries)."""


def _finite(kernel: NumpyKernel, block: np.ndarray, dtype: str) -> bool:
    """Whether the stored bytes ``block`` of a floating ``dtype`` hold only finite values."""
    if dtype in STORAGE:
        return kernel.finite(block.view(STORAGE[dtype]))
    import torch  # fp8: numpy has no type for it, and only torch's kernel computes it

    return bool(torch.from_numpy(block).view(torch_dtype(dtype)).float().isfinite().all())


def _count_nonfinite(raw: np.ndarray, dtype: str) -> int:
    """NaNs and Infs among the stored bytes ``raw`` of a floating ``dtype``."""
    if dtype == "BF16":
        values = widen_bf16(raw.view(np.uint16), np.empty(raw.size // 2, dtype=np.uint32))
    elif dtype in STORAGE:
        values = raw.view(STORAGE[dtype])
    else:
        import torch

        values = torch.from_numpy(raw).view(torch_dtype(dtype)).float().numpy()
    return int(values.size - np.count_nonzero(np.isfinite(values)))


class _TorchKernel:
    """The graft of one block with torch: for projections, which take and return torch tensors, and
    for dtypes numpy lacks (fp8). Imports torch when created."""

    def __init__(self, scale: float, project: Projection | None, check_finite: bool = True) -> None:
        import torch

        self.torch, self.scale, self.project, self.check_finite = torch, scale, project, check_finite
        self.threads = torch.get_num_threads()  # the caller's, for the projection
        self._scratch = torch.empty(0, dtype=torch.uint8)

    def _buffers(self, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """Two fp32 views of the scratch, and one of the stored ``dtype``: inputs are read into it
        and the result is cast into it."""
        torch = self.torch
        n = math.prod(shape)
        raw_bytes = n * dtype.itemsize
        if self._scratch.numel() < 8 * n + raw_bytes:
            self._scratch = torch.empty(8 * n + raw_bytes, dtype=torch.uint8)
        a = self._scratch[: 4 * n].view(torch.float32).view(shape)
        b = self._scratch[4 * n : 8 * n].view(torch.float32).view(shape)
        raw = self._scratch[8 * n : 8 * n + raw_bytes].view(dtype).view(shape)
        return a, b, raw

    def graft(self, name: str, shape: tuple[int, ...], dtypes: list[str], read: Callable[..., Any]) -> np.ndarray:
        """The grafted block of ``shape`` from inputs stored as ``dtypes`` (post's, donor's, donor_tuned's),
        as post's dtype stores it; valid until the next call."""
        torch = self.torch
        a, b, raw = self._buffers(shape, torch_dtype(dtypes[0]))

        def load(role: int, fp32: torch.Tensor) -> torch.Tensor:
            # An input stored unlike post (rare) is read into a tensor of its own.
            stored = raw if dtypes[role] == dtypes[0] else torch.empty(shape, dtype=torch_dtype(dtypes[role]))
            read(role, stored.reshape(-1).view(torch.uint8).numpy())
            return fp32.copy_(stored)

        # Each operand is converted to fp32 before any arithmetic (an in-place op with a bf16 operand
        # would be exact too, but takes torch's unvectorised mixed-dtype path, 6x slower).
        delta = load(2, b).sub_(load(1, a))
        if self.project is not None and self.check_finite and not bool(delta.isfinite().all()):
            raise _NonFinite  # before a mask can zero the entry that holds it
        if self.project is not None:
            with _torch_threads(self.threads):  # projections multiply matrices: they do use threads
                delta = self.project(name, delta)
        theta = load(0, a).add_(delta.mul_(self.scale))
        result = theta if raw.dtype == torch.float32 else raw.copy_(theta)
        return result.reshape(-1).view(torch.uint8).numpy()


@contextlib.contextmanager
def _torch_threads(count: int) -> Iterator[None]:
    """torch's intra-op thread count set to ``count`` for the block, restored afterwards."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _write_weights(
    out_dir: Path, shards: list[list[str]], models: list[_Model], grafter: _Grafter, stack: contextlib.ExitStack
) -> list[str]:
    """Write the shard files (and an index when there is more than one); returns their names."""
    specs = models[0].specs
    count = len(shards)
    files = [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    files = [SINGLE_NAME] if count == 1 else files
    for file, shard in zip(files, shards):
        with SafetensorsWriter(out_dir / file, [(n, specs[n].dtype_name, specs[n].shape) for n in shard]) as writer:
            for name, shape, data in grafter.blocks(shard, stack):
                writer.write_bytes(name, shape, data)
    if count > 1:
        weight_map = {name: file for file, shard in zip(files, shards) for name in shard}
        total = sum(s.nbytes for s in specs.values())
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return files


def graft(
    post: str | Path,
    donor: str | Path,
    donor_tuned: str | Path,
    scale: float,
    out: str | Path,
    *,
    chunk_bytes: int = 4 << 20,
    project: Projection | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    threads: int | None = None,
    allow_nonfinite: bool = False,
) -> dict[str, Any]:
    """Write ``post + scale * project(donor_tuned - donor)`` to the model directory ``out``.

    ``project`` defaults to the identity. Config, tokenizer and other non-weight files are copied from
    ``post``; ``out/graftlab.json`` records the inputs, parameters and counts. All three models must
    have identical tensor names and shapes (and config vocab_size), else GraftlabError lists the
    mismatches before anything is written. Returns the counts written to the provenance file.
    ``threads`` compute the identity graft's blocks (at most 4). One by default: at Qwen3-0.6B on the
    2-CPU machine here, two took 2.6-2.8 s against 2.1-2.4 s for one, and 1.5x its CPU time (the
    work is bound by memory, which the threads share). A projection's graft runs its elementwise
    work on one thread and ``project`` with the caller's torch thread count.

    A NaN or Inf in any floating tensor of an input (post alone when ``scale`` is 0: the donors are
    not read), or an output that overflows, is refused, naming the model and the tensor, unless
    ``allow_nonfinite``: a model full of NaN is no result. Each output block is checked, which covers
    the three inputs (NaN and Inf propagate through the arithmetic) in one pass.
    """
    scale = number(scale, "scale", low=0)
    out = Path(out)
    paths = dict(zip(ROLES, (post, donor, donor_tuned)))
    models = [_Model(role, path) for role, path in paths.items()]
    try:
        _validate(models, out)
        specs = models[0].specs
        shards = _plan_shards(_layout(models[0]), specs, max_shard_bytes)
        # One thread for the elementwise work: it is bound by memory, not arithmetic, and a second
        # thread turns costly as soon as another process wants the core. Each small torch op is a
        # parallel region whose barrier waits for the descheduled thread: at Qwen3-0.6B on the 2-core
        # machine with other jobs running, 2 threads took 6-31 s where 1 thread took 1.0-1.1 s. (numpy's
        # elementwise operations run on one thread anyway.) The stack restores torch's count.
        with atomic_dir(out) as tmp, contextlib.ExitStack() as stack:
            grafter = _Grafter(models, scale, project, chunk_bytes, _workers(threads), not allow_nonfinite)
            files = _write_weights(tmp, shards, models, grafter, stack)
            copy_model_files(models[0].path, tmp)
            counts = {
                "tensors": len(specs),
                "tensors_grafted": grafter.grafted,
                "parameters": sum(s.numel for s in specs.values()),
                "bytes": sum(s.nbytes for s in specs.values()),
                "shards": len(files),
            }
            projection = "identity" if project is None else getattr(project, "__name__", repr(project))
            inputs = {role: str(Path(p).resolve()) for role, p in paths.items()}
            extra = {"counts": counts}
            if hasattr(project, "report"):  # masks say how many entries they zeroed, per tensor
                extra["mask"] = project.report()
            params = {"scale": scale, "projection": projection} | ({"allow_nonfinite": True} if allow_nonfinite else {})
            write_provenance(tmp, inputs, params, extra)
    finally:
        for model in models:
            model.close()
    return counts


def masked_graft(post, donor, donor_tuned, scale: float, out, mask: str = "none", fisher=None, rho=0.0, **settings):
    """`graft`, its update masked by the post model's retention Fisher (`fisher`, of kind `mask`, zeroing the
    top-`rho` share; `settings`: scope and score) unless `mask` is `none`: what a graft sweep's job runs for each lam.
    The mask may rank lazily, tensor by tensor, while the graft runs."""
    project = None
    if mask != "none":
        from graftlab.fisher import make_mask

        project = make_mask(mask, fisher, post, donor, donor_tuned, float(rho), **settings)
    return graft(post, donor, donor_tuned, scale, out, project=project)


def graft_fingerprint(post, donor, donor_tuned, scale: float, mask: str = "none", fisher=None, rho=0.0, **settings):
    """What identifies the model `masked_graft` makes from the same arguments before it is made: its inputs'
    files and its settings. A graft's samples are kept under it (graftlab.sample_chunks), since each
    attempt, and each part of its sampling, grafts its own copy into a scratch directory of its own."""
    from graftlab.sample_chunks import inputs_fingerprint

    inputs = [post, donor, donor_tuned] + ([fisher] if mask != "none" else [])
    return inputs_fingerprint(inputs, {"scale": float(scale), "mask": mask, "rho": float(rho), **settings})


def _workers(threads: int | None) -> int:
    return max(1, min(threads or 1, 4))
