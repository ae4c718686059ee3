"""Graft vs I/O floor: how close `graftlab.graft.graft` comes to merely moving the bytes.

Builds three random Qwen3-shaped sharded models (post, donor, donor_tuned) in a temporary directory,
then times, each in a fresh subprocess so one measurement's peak memory cannot mask another's:
  floor  read every byte of the three inputs and write one model with `safetensors.torch.save_file`
  graft  `graft(post, donor, donor_tuned, 0.5, out)`
Imports happen before the clock starts and are reported on their own. Memory comes from
/proc/self/status (Linux only): peak RSS is VmHWM (anonymous memory plus touched mmap pages), peak
anonymous memory (the part that cannot be reclaimed) is RssAnon sampled every 2 ms. Not
`resource.getrusage`: a child's ru_maxrss starts at its parent's peak (Linux carries it across
fork and exec), which here is the model builder's. psutil reports no peak on Linux.

    python benchmarks/graft_bench.py --params 50M --dtype bf16 --shards 3
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROLES = ("post", "donor", "donor_tuned")
QWEN3_06B = dict(hidden=1024, intermediate=3072, heads=16, kv_heads=8, head_dim=128, layers=28, vocab=151936)


def parse_count(text: str) -> int:
    match = re.fullmatch(r"([\d.]+)\s*([kKmMbBgG]?)", text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a parameter count: {text!r} (e.g. 50M, 0.6B)")
    unit = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9}[match.group(2).lower()]
    return int(float(match.group(1)) * unit)


def qwen3_shapes(params: int) -> dict[str, tuple[int, ...]]:
    """Qwen3-0.6B's layer shapes, with layers and vocabulary scaled so the total is about ``params``
    (tied embeddings, as in the small Qwen3 models)."""
    c = QWEN3_06B
    h, q, kv = c["hidden"], c["heads"] * c["head_dim"], c["kv_heads"] * c["head_dim"]
    layer = {
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q),
        "self_attn.q_norm.weight": (c["head_dim"],),
        "self_attn.k_norm.weight": (c["head_dim"],),
        "mlp.gate_proj.weight": (c["intermediate"], h),
        "mlp.up_proj.weight": (c["intermediate"], h),
        "mlp.down_proj.weight": (h, c["intermediate"]),
    }
    per_layer = sum(math.prod(s) for s in layer.values())
    full = per_layer * c["layers"] + c["vocab"] * h
    layers = max(1, round(c["layers"] * params / full))
    vocab = max(1024, min(c["vocab"], (params - layers * per_layer) // h))
    shapes = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,)}
    for i in range(layers):
        shapes.update({f"model.layers.{i}.{name}": shape for name, shape in layer.items()})
    return shapes


def write_model(
    out: Path, shapes: dict[str, tuple[int, ...]], dtype, shards: int, seed: int, base: Path | None = None
) -> None:
    """A random sharded model directory; with ``base``, ``base``'s tensors plus small noise."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    out.mkdir(parents=True)
    generator = torch.Generator().manual_seed(seed)
    names = list(shapes)
    per_shard = math.ceil(len(names) / shards)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        tensors = {}
        with safe_open(str(base / file), framework="pt") if base else contextlib.nullcontext() as f:
            for name in names[i * per_shard : (i + 1) * per_shard]:
                noise = torch.randn(shapes[name], generator=generator)
                start = 0.0 if f is None else f.get_tensor(name).float()
                tensors[name] = (start + (0.02 if f is None else 1e-3) * noise).to(dtype)
                weight_map[name] = file
        save_file(tensors, str(out / file), metadata={"format": "pt"})
    total = sum(math.prod(s) for s in shapes.values()) * dtype.itemsize
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    vocab, hidden = shapes["model.embed_tokens.weight"]
    (out / "config.json").write_text(
        json.dumps({"model_type": "qwen3", "vocab_size": vocab, "hidden_size": hidden})
    )


class AnonPeak(threading.Thread):
    """Samples RssAnon every 2 ms: mmap'd input pages are reclaimable, anonymous memory is not."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = self.base = status_kib("RssAnon")
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.wait(0.002):
            self.peak = max(self.peak, status_kib("RssAnon"))

    def stop(self) -> int:
        """Peak rise of anonymous memory, MiB."""
        self._done.set()
        self.join()
        return (self.peak - self.base) // 1024


def status_kib(key: str) -> int:
    match = re.search(rf"^{key}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    assert match, f"/proc/self/status has no {key}"
    return int(match.group(1))


def floor(work: Path, out: Path) -> None:
    """Read every input byte into memory (clone: a tensor over an untouched mmap reads nothing) and
    write post's tensors back out as one model."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    kept = {}
    for role in ROLES:
        weight_map = json.loads((work / role / "model.safetensors.index.json").read_text())["weight_map"]
        for file in sorted(set(weight_map.values())):
            with safe_open(str(work / role / file), framework="pt") as f:
                for name in f.keys():
                    tensor = f.get_tensor(name).clone()
                    if role == "post":
                        kept[name] = tensor
    out.mkdir()
    save_file(kept, str(out / "model.safetensors"), metadata={"format": "pt"})


def worker(kind: str, work: Path, threads: int) -> None:
    start = time.perf_counter()
    import torch

    torch.set_num_threads(threads)
    from graftlab.graft import graft

    import_s = time.perf_counter() - start
    out = work / f"out-{kind}"
    sampler = AnonPeak()
    sampler.start()
    rss_before = status_kib("VmRSS")
    start = time.perf_counter()
    if kind == "floor":
        floor(work, out)
    else:
        graft(*(work / role for role in ROLES), 0.5, out)
    wall = time.perf_counter() - start
    anon = sampler.stop()
    peak = status_kib("VmHWM")
    result = {"wall_s": wall, "rss_mib": (peak - rss_before) // 1024, "anon_mib": anon, "import_s": import_s}
    print(json.dumps(result))


def measure(kind: str, work: Path, threads: int) -> dict:
    cmd = [sys.executable, __file__, "--worker", kind, "--workdir", str(work), "--threads", str(threads)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    shutil.rmtree(work / f"out-{kind}", ignore_errors=True)
    if done.returncode:
        sys.exit(f"{kind} run failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summarise(runs: dict[str, list[dict]]) -> str:
    def med(kind: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[kind])

    rows = [
        "| measurement | wall s | peak RSS Δ MiB | peak anon Δ MiB | imports s |",
        "|---|---:|---:|---:|---:|",
    ]
    for kind in runs:
        cells = [med(kind, k) for k in ("wall_s", "rss_mib", "anon_mib", "import_s")]
        rows.append(f"| {kind} | {cells[0]:.2f} | {cells[1]:.0f} | {cells[2]:.0f} | {cells[3]:.2f} |")
    ratios = [med("graft", k) / med("floor", k) for k in ("wall_s", "rss_mib", "anon_mib")]
    rows.append(f"| graft / floor | {ratios[0]:.2f} | {ratios[1]:.2f} | {ratios[2]:.2f} | |")
    return "\n".join(rows)


def run(args: argparse.Namespace) -> None:
    import torch

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    shapes = qwen3_shapes(args.params)
    n_params = sum(math.prod(s) for s in shapes.values())
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="graft-bench-"))
    try:
        start = time.perf_counter()
        write_model(work / "post", shapes, dtype, args.shards, seed=1)
        write_model(work / "donor", shapes, dtype, args.shards, seed=2)
        write_model(work / "donor_tuned", shapes, dtype, args.shards, seed=3, base=work / "donor")
        size_gb = n_params * dtype.itemsize / 1e9
        print(
            f"{n_params / 1e6:.0f}M params, {args.dtype}, {size_gb:.2f} GB per model, {args.shards} shards, "
            f"{len(shapes)} tensors (built in {time.perf_counter() - start:.1f} s); warm page cache; "
            f"{args.threads} torch thread(s); median of {args.repeats}"
        )
        runs: dict[str, list[dict]] = {"floor": [], "graft": []}
        measure("floor", work, args.threads)  # warm-up: page cache and first-import costs
        for _ in range(args.repeats):
            for kind in runs:
                runs[kind].append(measure(kind, work, args.threads))
        print(summarise(runs))
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--params", type=parse_count, default=parse_count("50M"), help="model size, e.g. 50M, 0.6B"
    )
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    parser.add_argument("--shards", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5, help="runs of each, fresh processes")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads in both runs")
    parser.add_argument(
        "--workdir",
        help="build the models in this new directory and keep them (default: a removed temporary directory)",
    )
    parser.add_argument("--worker", choices=["floor", "graft"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not Path("/proc/self/status").is_file():
        sys.exit("graft_bench measures memory through /proc/self/status: Linux only")
    if args.worker:
        worker(args.worker, Path(args.workdir), args.threads)
    else:
        run(args)


if __name__ == "__main__":
    main()
