"""Grafting (DESIGN §3): ``theta = post + scale * P(donor_tuned - donor)``, streamed tensor by tensor.

Each tensor is computed in fp32 and cast back to the post model's dtype. Nothing ever holds a whole
model: tensors are read one at a time from memory-mapped shards (large ones in row blocks) and
appended to the output as they are finished. Model merging is the case donor == post.

Imports stay minimal (torch, safetensors, graftlab.models; not transformers): start-up is a large
share of a graft's wall time (DESIGN §7).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from graftlab.models import (
    INDEX_NAME,
    SINGLE_NAME,
    GraftlabError,
    SafetensorsWriter,
    TensorSpec,
    atomic_dir,
    copy_model_files,
    read_config,
    tensor_index,
    tensor_specs,
    write_provenance,
)

# P(delta) for one tensor: receives the tensor's name and its whole fp32 delta (scratch memory, valid
# during the call and free to modify in place), returns the projected delta (same shape). Fisher masks
# and KFAC projections plug in here; KFAC mixes rows, so a projected tensor is always handed over
# whole rather than in row blocks.
Projection = Callable[[str, torch.Tensor], torch.Tensor]

# Hugging Face's default shard size: below it one file is simplest for every consumer.
MAX_SHARD_BYTES = 5 * 10**9

ROLES = ("post", "donor", "donor_tuned")


class _Model:
    """One input model: its tensor index and header specs, and its shards opened lazily."""

    def __init__(self, role: str, path: str | Path) -> None:
        self.role, self.path = role, Path(path)
        self.index = tensor_index(self.path)
        self.specs = tensor_specs(self.path, self.index)
        self.config = read_config(self.path)
        self._handles: dict[Path, Any] = {}
        self._unread = Counter(self.index.values())

    def read(self, name: str, rows: slice | None) -> torch.Tensor:
        """Tensor ``name`` (or its block of ``rows``) as stored, without converting the dtype."""
        file = self.index[name]
        if file not in self._handles:
            self._handles[file] = safe_open(str(file), framework="pt").__enter__()
        handle = self._handles[file]
        return handle.get_tensor(name) if rows is None else handle.get_slice(name)[rows.start : rows.stop]

    def finished(self, name: str) -> None:
        """Close a shard once all its tensors are done: the pages read from a memory-mapped file
        count towards RSS until it is unmapped, which would add up to three models' worth."""
        file = self.index[name]
        self._unread[file] -= 1
        if self._unread[file] == 0 and file in self._handles:
            self._handles.pop(file).__exit__(None, None, None)

    def close(self) -> None:
        while self._handles:
            self._handles.popitem()[1].__exit__(None, None, None)


def _check_scale(scale: float) -> float:
    try:
        scale = float(scale)
    except (TypeError, ValueError):
        raise GraftlabError(f"scale must be a number, got {scale!r}") from None
    if not math.isfinite(scale):
        raise GraftlabError(f"scale must be finite, got {scale}")
    if scale < 0:
        raise GraftlabError(f"scale must be >= 0, got {scale}")
    return scale


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
    missing = sorted(post.specs.keys() - other.specs.keys())
    extra = sorted(other.specs.keys() - post.specs.keys())
    if missing:
        problems.append(f"{len(missing)} tensor(s) missing: {_few(missing)}")
    if extra:
        problems.append(f"{len(extra)} extra tensor(s): {_few(extra)}")
    shapes, vocab_rows = [], []
    for name in sorted(post.specs.keys() & other.specs.keys()):
        want, got = post.specs[name].shape, other.specs[name].shape
        if want == got:
            continue
        shapes.append(f"{name} {list(got)} vs post {list(want)}")
        if _is_vocab_tensor(name) and want[1:] == got[1:]:
            vocab_rows.append(f"{name} has {got[0]} rows vs post's {want[0]}")
    if vocab_rows and not config_vocab_differs:
        problems.append(f"vocabulary differs: {_few(vocab_rows)}")
    if shapes:
        problems.append(f"{len(shapes)} shape difference(s): {_few(shapes)}")
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
    for model in models:
        if out.resolve() == model.path.resolve():
            raise GraftlabError(f"output directory {out} is the {model.role} model's directory")


def _layout(post: _Model) -> list[str]:
    """Output tensor order: widest dtype first, so every tensor's offset stays aligned to its item
    size (as the safetensors library arranges it); within a dtype, post's file order, so each input
    shard is read front to back."""
    specs = post.specs
    return sorted(specs, key=lambda n: (-specs[n].dtype.itemsize, str(post.index[n]), specs[n].offset))


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
    """Grafts tensors one at a time into fp32 scratch buffers that are reused from tensor to tensor.

    Reuse matters: a large fresh allocation is handed back to the OS when freed and page-faulted in
    again on its next use, which measured 4x slower than copying into a warm buffer and cost more
    than the arithmetic itself.
    """

    def __init__(
        self, models: list[_Model], scale: float, project: Projection | None, chunk_bytes: int
    ) -> None:
        self.models, self.scale, self.project, self.chunk_bytes = models, scale, project, chunk_bytes
        self._scratch = torch.empty(0, dtype=torch.uint8)

    def _buffers(self, shape: torch.Size, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """Two fp32 views of the scratch, and one of ``dtype`` for the cast result (None for fp32)."""
        n = math.prod(shape)
        cast_bytes = 0 if dtype == torch.float32 else n * dtype.itemsize
        if self._scratch.numel() < 8 * n + cast_bytes:
            self._scratch = torch.empty(8 * n + cast_bytes, dtype=torch.uint8)
        a = self._scratch[: 4 * n].view(torch.float32).view(shape)
        b = self._scratch[4 * n : 8 * n].view(torch.float32).view(shape)
        cast = self._scratch[8 * n : 8 * n + cast_bytes].view(dtype).view(shape) if cast_bytes else None
        return a, b, cast

    def __call__(self, name: str, writer: SafetensorsWriter) -> bool:
        """Write one tensor; returns False when post's tensor was copied unchanged."""
        spec = self.models[0].specs[name]
        # scale 0 is post itself: copying skips arithmetic that would turn -0.0 into +0.0 or 0 * inf
        # into nan. Integer and bool tensors are buffers (ids, masks), never trained weights.
        copy = self.scale == 0 or not spec.dtype.is_floating_point
        whole = self.project is not None and not copy  # a projection sees whole tensors
        for rows in [None] if whole else _row_blocks(spec, self.chunk_bytes):
            writer.write(name, self.models[0].read(name, rows) if copy else self._graft(name, spec, rows))
        for model in self.models:
            model.finished(name)
        return not copy

    def _graft(self, name: str, spec: TensorSpec, rows: slice | None) -> torch.Tensor:
        post, donor, tuned = self.models
        post_block = post.read(name, rows)
        a, b, cast = self._buffers(post_block.shape, spec.dtype)
        # Each operand is converted to fp32 before any arithmetic (an in-place op with a bf16 operand
        # would be exact too, but takes torch's unvectorised mixed-dtype path, 6x slower).
        delta = b.copy_(tuned.read(name, rows)).sub_(a.copy_(donor.read(name, rows)))
        if self.project is not None:
            delta = self.project(name, delta)
        theta = a.copy_(post_block).add_(delta.mul_(self.scale))
        return theta if cast is None else cast.copy_(theta)


def _write_weights(
    out_dir: Path, shards: list[list[str]], models: list[_Model], graft_one: Callable[..., bool]
) -> tuple[list[str], int]:
    """Write the shard files (and an index when there is more than one); returns their names and
    the number of tensors actually grafted."""
    specs = models[0].specs
    count = len(shards)
    files = [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    files = [SINGLE_NAME] if count == 1 else files
    grafted = 0
    for file, shard in zip(files, shards):
        with SafetensorsWriter(
            out_dir / file, [(n, specs[n].dtype, specs[n].shape) for n in shard]
        ) as writer:
            grafted += sum(graft_one(name, writer) for name in shard)
    if count > 1:
        weight_map = {name: file for file, shard in zip(files, shards) for name in shard}
        total = sum(s.nbytes for s in specs.values())
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return files, grafted


def graft(
    post: str | Path,
    donor: str | Path,
    donor_tuned: str | Path,
    scale: float,
    out: str | Path,
    *,
    chunk_bytes: int = 64 << 20,
    project: Projection | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> dict[str, Any]:
    """Write ``post + scale * project(donor_tuned - donor)`` to the model directory ``out``.

    ``project`` defaults to the identity. Config, tokenizer and other non-weight files are copied from
    ``post``; ``out/graftlab.json`` records the inputs, parameters and counts. All three models must
    have identical tensor names and shapes (and config vocab_size), else GraftlabError lists the
    mismatches before anything is written. Returns the counts written to the provenance file.
    """
    scale = _check_scale(scale)
    out = Path(out)
    paths = dict(zip(ROLES, (post, donor, donor_tuned)))
    models = [_Model(role, path) for role, path in paths.items()]
    try:
        _validate(models, out)
        specs = models[0].specs
        shards = _plan_shards(_layout(models[0]), specs, max_shard_bytes)
        with atomic_dir(out) as tmp:
            files, grafted = _write_weights(
                tmp, shards, models, _Grafter(models, scale, project, chunk_bytes)
            )
            copy_model_files(models[0].path, tmp)
            counts = {
                "tensors": len(specs),
                "tensors_grafted": grafted,
                "parameters": sum(s.numel for s in specs.values()),
                "bytes": sum(s.nbytes for s in specs.values()),
                "shards": len(files),
            }
            projection = "identity" if project is None else getattr(project, "__name__", repr(project))
            inputs = {role: str(Path(p).resolve()) for role, p in paths.items()}
            extra = {"counts": counts}
            if hasattr(project, "report"):  # masks say how many entries they zeroed, per tensor
                extra["mask"] = project.report()
            write_provenance(tmp, inputs, {"scale": scale, "projection": projection}, extra)
    finally:
        for model in models:
            model.close()
    return counts
