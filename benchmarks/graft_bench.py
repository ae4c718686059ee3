"""Graft vs I/O floor vs mergekit: how close `graftlab.graft.graft` comes to merely moving the bytes,
and how it compares with mergekit's `task_arithmetic` doing the same graft.

Builds three random Qwen3-shaped sharded models (post, donor, donor_tuned) in a temporary directory,
then times, each in a fresh subprocess so one measurement's peak memory cannot mask another's:
  floor     read every byte of the three inputs and write one model with `safetensors.torch.save_file`
  graft     `graft(post, donor, donor_tuned, LAM, out)`
  mergekit  `mergekit-yaml` with base_model donor, models post (weight 1) and donor_tuned (weight LAM),
            normalize false, bfloat16: donor + (post - donor) + LAM * (donor_tuned - donor), the same
            graft. It runs in mergekit's own Python (mergekit pins its own dependencies, so it lives in
            a venv of its own), through its command-line entry point after its imports.
Before timing, a small trio whose delta is as large as the weights (so a wrong weight or sign could not
hide under bf16 rounding) is grafted by both, and mergekit's output must match graftlab's to within a
few bf16 rounding steps: the comparison is of the same computation.

Imports happen before the clock starts and are reported on their own. Memory comes from
/proc/self/status (Linux only): peak RSS is VmHWM (anonymous memory plus touched mmap pages), peak
anonymous memory (the part that cannot be reclaimed) is RssAnon sampled every 2 ms. Not
`resource.getrusage`: a child's ru_maxrss starts at its parent's peak (Linux carries it across
fork and exec), which here is the model builder's. psutil reports no peak on Linux.

    python benchmarks/graft_bench.py --params 50M --dtype bf16 --shards 3 --mergekit /path/to/mergekit-yaml
"""

from __future__ import annotations

import argparse
import contextlib
import functools
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
LAM = 0.5  # the graft's scale, mergekit's weight on donor_tuned
# mergekit's options for a fair race: CPU only, one output shard like graftlab's (5B parameters is its
# default and more than any model here), synchronous writes (its default; async holds more memory),
# and nothing written that graftlab does not write (no tokenizer exists to copy; no model card).
# --lazy-unpickle only matters for pickled inputs, harmless here. Threads match graftlab's.
MERGEKIT_FLAGS = (
    "--no-cuda",
    "--lazy-unpickle",
    "--out-shard-size",
    "5B",
    "--no-async-write",
    "--no-copy-tokenizer",
    "--no-write-model-card",
    "--quiet",
)
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


def qwen3_config(shapes: dict[str, tuple[int, ...]]) -> dict:
    """A config.json complete enough for transformers' Qwen3Config (mergekit reads the model through it)."""
    c = QWEN3_06B
    vocab, hidden = shapes["model.embed_tokens.weight"]
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": c["intermediate"],
        "num_hidden_layers": sum(name.endswith("input_layernorm.weight") for name in shapes),
        "num_attention_heads": c["heads"],
        "num_key_value_heads": c["kv_heads"],
        "head_dim": c["head_dim"],
        "tie_word_embeddings": True,
    }


def write_model(
    out: Path,
    shapes: dict[str, tuple[int, ...]],
    dtype,
    shards: int,
    seed: int,
    base: Path | None = None,
    noise: float = 1e-3,
) -> None:
    """A random sharded model directory; with ``base``, ``base``'s tensors plus ``noise`` times N(0, 1)."""
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
                normal = torch.randn(shapes[name], generator=generator)
                start = 0.0 if f is None else f.get_tensor(name).float()
                tensors[name] = (start + (0.02 if f is None else noise) * normal).to(dtype)
                weight_map[name] = file
        save_file(tensors, str(out / file), metadata={"format": "pt"})
    total = sum(math.prod(s) for s in shapes.values()) * dtype.itemsize
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    (out / "config.json").write_text(json.dumps(qwen3_config(shapes)))


def write_trio(work: Path, shapes: dict[str, tuple[int, ...]], dtype, shards: int, noise: float = 1e-3) -> None:
    """post, donor and donor_tuned under ``work``, and the mergekit config that grafts them."""
    write_model(work / "post", shapes, dtype, shards, seed=1)
    write_model(work / "donor", shapes, dtype, shards, seed=2)
    write_model(work / "donor_tuned", shapes, dtype, shards, seed=3, base=work / "donor", noise=noise)
    # JSON is YAML: no YAML library needed on this side.
    config = {
        "merge_method": "task_arithmetic",
        "base_model": str(work / "donor"),
        "models": [
            {"model": str(work / "post"), "parameters": {"weight": 1.0}},
            {"model": str(work / "donor_tuned"), "parameters": {"weight": LAM}},
        ],
        "parameters": {"normalize": False},
        "dtype": "bfloat16",
        "out_dtype": "bfloat16",
    }
    (work / "mergekit.yaml").write_text(json.dumps(config, indent=2))


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
    """One measurement, in this fresh process; prints its result as a JSON line."""
    start = time.perf_counter()
    import torch

    torch.set_num_threads(threads)
    out = work / f"out-{kind}"
    if kind == "mergekit":
        # Its command-line entry point, so the flags are exactly those a user would type.
        from mergekit.scripts.run_yaml import main as mergekit_yaml

        argv = [str(work / "mergekit.yaml"), str(out), *MERGEKIT_FLAGS, "--num-threads", str(threads)]
        task = functools.partial(mergekit_yaml.main, args=argv, standalone_mode=False)
    else:
        from graftlab.graft import graft  # the floor imports it too: the same start-up on both sides

        if kind == "floor":
            task = functools.partial(floor, work, out)
        else:
            task = functools.partial(graft, *(work / role for role in ROLES), LAM, out)
    import_s = time.perf_counter() - start
    sampler = AnonPeak()
    sampler.start()
    rss_before = status_kib("VmRSS")
    start = time.perf_counter()
    task()
    wall = time.perf_counter() - start
    anon = sampler.stop()
    peak = status_kib("VmHWM")
    result = {
        "wall_s": wall,
        "rss_mib": peak // 1024,
        "rss_delta_mib": (peak - rss_before) // 1024,
        "anon_mib": anon,
        "import_s": import_s,
    }
    print(json.dumps(result))


def measure(kind: str, work: Path, threads: int, python: str = sys.executable, keep: bool = False) -> dict:
    cmd = [python, __file__, "--worker", kind, "--workdir", str(work), "--threads", str(threads)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if not keep:
        shutil.rmtree(work / f"out-{kind}", ignore_errors=True)
    if done.returncode:
        sys.exit(f"{kind} run failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def find_mergekit(path: str | None) -> str | None:
    """The Python interpreter of a mergekit-yaml console script (``path``, else the one on PATH);
    None when no path was given and none is on PATH."""
    script = path or shutil.which("mergekit-yaml")
    if script is None:
        return None
    if not Path(script).is_file():
        sys.exit(f"--mergekit {script}: no such file")
    with open(script, "rb") as f:
        first = f.readline().decode(errors="replace")
    # pip writes the venv's interpreter into the #! line; a too-long path gets a /bin/sh trampoline
    # instead, and then the interpreter beside the script is that venv's.
    candidates = [first[2:].split()[0]] if first.startswith("#!") and first[2:].split() else []
    candidates.append(str(Path(script).parent / "python"))
    for python in candidates:
        if Path(python).name.startswith("python") and os.access(python, os.X_OK):
            return python
    sys.exit(f"--mergekit {script}: cannot tell which Python runs it (no python in its #! line or beside it)")


def check_mergekit(python: str, threads: int) -> None:
    """Graft a small trio with both tools and require the same result up to bf16 rounding.

    mergekit computes in bf16, rounding after each step (post - donor, the weighted sum, the final
    add); graftlab computes in fp32 and rounds once. Each rounding errs by at most half a bf16 step
    (2**-8 relative) of a value at most twice the largest operand, so the two may differ by a few
    steps of the operands' magnitude, never more. The delta is as large as the weights, so a wrong
    weight, sign or base would show as differences of hundreds of steps.
    """
    import torch
    from safetensors.torch import load_file

    def load(model_dir: Path) -> dict[str, torch.Tensor]:
        return {k: v for f in sorted(model_dir.glob("*.safetensors")) for k, v in load_file(f).items()}

    with tempfile.TemporaryDirectory(prefix="graft-bench-check-") as tmp:
        work = Path(tmp)
        write_trio(work, qwen3_shapes(parse_count("20M")), torch.bfloat16, shards=3, noise=0.02)
        measure("graft", work, threads, keep=True)
        measure("mergekit", work, threads, python=python, keep=True)
        post, donor, tuned, ours, theirs = (load(work / d) for d in (*ROLES, "out-graft", "out-mergekit"))
    assert ours.keys() == theirs.keys(), f"tensor names differ: {sorted(ours.keys() ^ theirs.keys())[:3]}"
    worst, differ, total, max_abs = 0.0, 0, 0, 0.0
    for name, mine in ours.items():
        assert theirs[name].dtype == mine.dtype == torch.bfloat16, f"{name}: mergekit wrote {theirs[name].dtype}"
        diff = (mine.float() - theirs[name].float()).abs()
        operands = torch.stack([t[name].float().abs() for t in (post, donor, tuned, ours)]).amax(0)
        step = torch.exp2(torch.floor(torch.log2(operands.clamp_min(2.0**-126))) - 7)  # bf16 spacing there
        worst = max(worst, (diff / step).max().item())
        differ, total, max_abs = differ + int((diff > 0).sum()), total + diff.numel(), max(max_abs, diff.max().item())
    print(
        f"mergekit check (20M params, delta as large as the weights): max |graftlab - mergekit| = {max_abs:.2g}, "
        f"{worst:.1f} bf16 steps of the operands' magnitude; {differ / total:.0%} of elements differ "
        "(mergekit rounds to bf16 after every step, graftlab once)"
    )
    if worst > 4:
        sys.exit(f"mergekit's output differs from graftlab's by {worst:.1f} bf16 steps: not the same graft")


def summarise(runs: dict[str, list[dict]]) -> str:
    def med(kind: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[kind])

    keys = ("wall_s", "rss_mib", "rss_delta_mib", "anon_mib", "import_s")
    rows = [
        "| measurement | wall s | peak RSS MiB | peak RSS Δ MiB | peak anon Δ MiB | imports s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for kind in runs:
        cells = [med(kind, k) for k in keys]
        rows.append(f"| {kind} | {cells[0]:.2f} | {cells[1]:.0f} | {cells[2]:.0f} | {cells[3]:.0f} | {cells[4]:.2f} |")
    for other in ("floor", "mergekit"):
        if other in runs:
            ratios = [med("graft", k) / max(med(other, k), 1e-9) for k in keys]
            rows.append(f"| graft / {other} | " + " | ".join(f"{r:.2f}" for r in ratios) + " |")
    return "\n".join(rows)


def targets(runs: dict[str, list[dict]], largest_bytes: int) -> str:
    """Issue 3's targets for the graft, each with its measured value. Peak RSS is the whole process's
    (imports included), the stricter reading."""

    def med(kind: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[kind])

    rss_cap = (2 * largest_bytes + 500e6) / 2**20
    floor_wall = med("graft", "wall_s") / med("floor", "wall_s")
    rows = [
        ("wall <= 1.3 x floor", f"{floor_wall:.2f} x", floor_wall <= 1.3),
        (
            f"peak RSS <= 2 x largest tensor + 500 MB = {rss_cap:.0f} MiB",
            f"{med('graft', 'rss_mib'):.0f} MiB",
            med("graft", "rss_mib") <= rss_cap,
        ),
    ]
    if "mergekit" in runs:
        wall, rss = (med("graft", k) / med("mergekit", k) for k in ("wall_s", "rss_mib"))
        rows += [
            ("wall <= 0.7 x mergekit", f"{wall:.2f} x", wall <= 0.7),
            ("peak RSS <= 0.5 x mergekit", f"{rss:.2f} x", rss <= 0.5),
        ]
    lines = ["| target | measured | met |", "|---|---:|:---:|"]
    lines += [f"| {target} | {value} | {'yes' if ok else 'no'} |" for target, value, ok in rows]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> None:
    import torch

    mergekit = find_mergekit(args.mergekit)
    if mergekit:
        check_mergekit(mergekit, args.threads)
    else:
        print("mergekit: no mergekit-yaml on PATH and no --mergekit given; its row is skipped")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    shapes = qwen3_shapes(args.params)
    n_params = sum(math.prod(s) for s in shapes.values())
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="graft-bench-"))
    try:
        start = time.perf_counter()
        write_trio(work, shapes, dtype, args.shards)
        size_gb = n_params * dtype.itemsize / 1e9
        largest = max(math.prod(s) for s in shapes.values()) * dtype.itemsize
        print(
            f"{n_params / 1e6:.0f}M params, {args.dtype}, {size_gb:.2f} GB per model, {args.shards} shards, "
            f"{len(shapes)} tensors, largest {largest / 1e6:.0f} MB (built in {time.perf_counter() - start:.1f} s); "
            f"warm page cache; {args.threads} torch thread(s); median of {args.repeats}"
        )
        runs: dict[str, list[dict]] = {"floor": [], "graft": [], **({"mergekit": []} if mergekit else {})}
        measure("floor", work, args.threads)  # warm-up: page cache and first-import costs
        for _ in range(args.repeats):
            for kind in runs:
                python = mergekit if kind == "mergekit" else sys.executable
                runs[kind].append(measure(kind, work, args.threads, python=python))
        print(summarise(runs))
        print()
        print(targets(runs, largest))
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=parse_count, default=parse_count("50M"), help="model size, e.g. 50M, 0.6B")
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    parser.add_argument("--shards", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5, help="runs of each, fresh processes")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads in every run")
    parser.add_argument(
        "--mergekit",
        help="mergekit-yaml of a mergekit install (its own venv); default: the one on PATH, else no mergekit row",
    )
    parser.add_argument(
        "--workdir",
        help="build the models in this new directory and keep them (default: a removed temporary directory)",
    )
    parser.add_argument("--worker", choices=["floor", "graft", "mergekit"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not Path("/proc/self/status").is_file():
        sys.exit("graft_bench measures memory through /proc/self/status: Linux only")
    if args.worker:
        worker(args.worker, Path(args.workdir), args.threads)
    else:
        run(args)


if __name__ == "__main__":
    main()
