"""Graft vs the byte floor vs mergekit: how close `graftlab graft` comes to merely moving its bytes.

Builds three random sharded models (post, donor, donor_tuned; by default Qwen3-0.6B's shapes in bf16)
in a temporary directory with graftlab's own SafetensorsWriter, then times, page cache warm, the
median of --repeats runs of each:
  byte floor     `cat` of the three inputs' files to /dev/null, then `cp` of post's weight files: the
                 same bytes read and written as a graft, by the tools that do nothing else, as one
                 shell process timed whole
  graft process  `graftlab graft --post ... --scale LAM --out ...`, the whole process timed from
                 outside as for the floor: interpreter start-up and imports included
  graft()        `graft(post, donor, donor_tuned, LAM, out)` in a fresh Python process, timed after its
                 imports (which are reported on their own), with its peak memory
  mergekit       `mergekit-yaml` with base_model donor, models post (weight 1) and donor_tuned (weight
                 LAM), normalize false, bfloat16: donor + (post - donor) + LAM * (donor_tuned - donor),
                 the same graft, timed like graft() after its imports. It runs in mergekit's own Python
                 (mergekit pins its own dependencies, so it lives in a venv of its own); no row without it.
Every run starts with no dirty pages (`sync`, not timed), so no run pays for the previous run's
writeback, and with the inputs just read (not timed); outputs are removed between runs. Before
timing, a small trio whose delta is as large as the weights (so a wrong weight or sign could not hide
under bf16 rounding) is grafted by both graftlab and mergekit, and mergekit's output must match
graftlab's to within a few bf16 rounding steps.

Memory comes from /proc/self/status (Linux only): peak RSS is VmHWM (anonymous memory plus touched
mmap pages), peak anonymous memory (the part that cannot be reclaimed) is RssAnon sampled every 2 ms.
Not `resource.getrusage`: a child's ru_maxrss starts at its parent's peak (Linux carries it across
fork and exec), which here is the model builder's. psutil reports no peak on Linux.

    python benchmarks/graft_bench.py --params 0.6B --dtype bf16 --shards 1
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used, so that a worker's import time includes numpy's
    import numpy as np

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


# Random values come from a pool of this many per model, sliced at random offsets: drawing 0.6B
# normal numbers per model would take longer than everything measured.
POOL = 1 << 22
STORAGE = {"bf16": "BF16", "fp16": "F16", "fp32": "F32"}


def pools(dtype: str, noise: float) -> list[np.ndarray]:
    """Stored values for post, donor and donor_tuned, each POOL long: 0.02 * N(0, 1) for post and
    donor, and donor plus ``noise`` * N(0, 1) for donor_tuned, element for element."""
    import numpy as np

    from graftlab.graft_numpy import narrow_bf16

    rng = np.random.default_rng(0)
    post, donor = (0.02 * rng.standard_normal(POOL, dtype=np.float32) for _ in range(2))
    tuned = donor + noise * rng.standard_normal(POOL, dtype=np.float32)
    if dtype == "bf16":
        scratch = np.empty(POOL, dtype=np.uint32)
        return [narrow_bf16(x, scratch, np.empty(POOL, dtype=np.uint16)) for x in (post, donor, tuned)]
    return [x.astype({"fp16": np.float16, "fp32": np.float32}[dtype]) for x in (post, donor, tuned)]


def write_trio(work: Path, shapes: dict[str, tuple[int, ...]], dtype: str, shards: int, noise: float = 1e-3) -> None:
    """post, donor and donor_tuned under ``work``, sharded alike, written with graftlab's own
    SafetensorsWriter from slices of pools(): donor_tuned's slice is at donor's offset, so it is donor
    plus noise everywhere; and the mergekit config that grafts them."""
    import numpy as np

    from graftlab.io.safetensors_io import INDEX_NAME, SINGLE_NAME, SafetensorsWriter

    names = list(shapes)
    per_shard = math.ceil(len(names) / shards)
    files = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)] if shards > 1 else [SINGLE_NAME]
    weight_map = {name: files[i // per_shard] for i, name in enumerate(names)}
    offsets = np.random.default_rng(1)
    for role, pool in zip(ROLES, pools(dtype, noise)):
        (work / role).mkdir(parents=True)
        for file in files:
            shard = [name for name in names if weight_map[name] == file]
            specs = [(name, STORAGE[dtype], shapes[name]) for name in shard]
            with SafetensorsWriter(work / role / file, specs) as writer:
                for name in shard:
                    write_tensor(writer, name, shapes[name], pool, offsets)
        offsets = np.random.default_rng(1)  # the same slices for every model
        total = sum(math.prod(s) for s in shapes.values()) * pool.itemsize
        if shards > 1:
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (work / role / INDEX_NAME).write_text(json.dumps(index))
        (work / role / "config.json").write_text(json.dumps(qwen3_config(shapes)))
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


def write_tensor(writer, name: str, shape: tuple[int, ...], pool: np.ndarray, offsets: np.random.Generator) -> None:
    """One tensor in row blocks of at most half the pool, each a slice of it at a random offset."""
    row = math.prod(shape[1:])
    step = max(1, (POOL // 2) // row) if shape else 1
    for start in range(0, shape[0] if shape else 1, step):
        rows = min(step, shape[0] - start) if shape else 1
        block = (rows, *shape[1:]) if shape else ()
        at = int(offsets.integers(0, POOL - rows * row + 1))
        writer.write_bytes(name, block, pool[at : at + rows * row])


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


def worker(kind: str, work: Path, threads: int) -> None:
    """One measurement, in this fresh process; prints its result as a JSON line."""
    start = time.perf_counter()
    out = work / f"out-{kind}"
    if kind == "mergekit":
        import torch

        torch.set_num_threads(threads)
        # Its command-line entry point, so the flags are exactly those a user would type.
        from mergekit.scripts.run_yaml import main as mergekit_yaml

        argv = [str(work / "mergekit.yaml"), str(out), *MERGEKIT_FLAGS, "--num-threads", str(threads)]
        task = functools.partial(mergekit_yaml.main, args=argv, standalone_mode=False)
    else:
        from graftlab.graft import graft

        task = functools.partial(graft, *(work / role for role in ROLES), LAM, out, threads=threads)
    import_s = time.perf_counter() - start
    sampler = AnonPeak()
    sampler.start()
    rss_before = status_kib("VmRSS")
    cpu = time.process_time()
    start = time.perf_counter()
    task()
    wall = time.perf_counter() - start
    cpu = time.process_time() - cpu
    anon = sampler.stop()
    peak = status_kib("VmHWM")
    result = {
        "wall_s": wall,
        "cpu_s": cpu,
        "rss_mib": peak // 1024,
        "rss_delta_mib": (peak - rss_before) // 1024,
        "anon_mib": anon,
        "import_s": import_s,
    }
    print(json.dumps(result))


def measure(kind: str, work: Path, threads: int, python: str = sys.executable, keep: bool = False) -> dict:
    """One run of ``kind``: graft() or mergekit in a fresh process, timed after its imports."""
    cmd = [python, __file__, "--worker", kind, "--workdir", str(work), "--threads", str(threads)]
    os.sync()  # the previous run's output is still being written back: not this run's cost
    warm(work)
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
        write_trio(work, qwen3_shapes(parse_count("20M")), "bf16", shards=3, noise=0.02)
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


def warm(work: Path) -> None:
    """Read the three inputs right before a run: the kernel here may reclaim page cache it deems cold
    (kdamond runs), and a run that reads from disk measures the disk, not the graft."""
    for file in sorted(work.glob("*/*.safetensors")):
        if file.parent.name in ROLES:
            with open(file, "rb") as f:
                while f.read(1 << 24):
                    pass


def timed_process(cmd: list[str], out: Path) -> dict:
    """Wall seconds and CPU seconds (user + system, its children's included) of the whole process
    ``cmd``, which writes ``out`` (removed before and after). CPU time is what a loaded machine
    cannot inflate: wall time there also counts waiting for a core."""
    shutil.rmtree(out, ignore_errors=True)
    os.sync()  # no earlier run's writeback left to slow this one
    warm(out.parent)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    shutil.rmtree(out, ignore_errors=True)
    if done.returncode:
        sys.exit(f"{cmd[0]} failed:\n{done.stderr}")
    return {"wall_s": wall, "cpu_s": after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime}


def byte_floor_cmd(work: Path) -> list[str]:
    """Read every byte of the three inputs' weight files and write post's as a new model: no tool
    moves those bytes faster than cat and cp."""
    inputs = " ".join(f"{role}/*.safetensors" for role in ROLES)
    script = f"cd {work} && cat {inputs} > /dev/null && mkdir out-floor && cp post/*.safetensors out-floor/"
    return ["sh", "-c", script]


def graft_cmd(work: Path, threads: int) -> list[str]:
    """`graftlab graft` as a user runs it: the venv's console script, else python -m graftlab."""
    script = Path(sys.executable).with_name("graftlab")
    start = [str(script)] if script.is_file() else [sys.executable, "-m", "graftlab"]
    models = ["--post", "post", "--donor", "donor", "--donor-tuned", "donor_tuned"]
    out = ["--scale", str(LAM), "--out", str(work / "out-process"), "--threads", str(threads)]
    return ["sh", "-c", f"cd {work} && exec " + " ".join([*start, "graft", *models, *out])]


def med(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def summarise(runs: dict[str, list[dict]]) -> str:
    """The table: each measurement's median, and each one's ratio to the byte floor."""
    rows = [
        "| measurement | wall s | x byte floor | CPU s | x byte floor | peak RSS MiB | peak anon Δ MiB | imports s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    floor_s, floor_cpu = med(runs["floor"], "wall_s"), med(runs["floor"], "cpu_s")
    names = {
        "floor": "byte floor (cat inputs, cp post), whole process",
        "process": "graftlab graft, whole process",
        "graft": "graft(), in process, after imports",
        "mergekit": "mergekit, in process, after imports",
    }
    for kind, label in names.items():
        if kind not in runs:
            continue
        wall, cpu = med(runs[kind], "wall_s"), med(runs[kind], "cpu_s")
        cells = [f"{wall:.2f}", f"{wall / floor_s:.2f}", f"{cpu:.2f}", f"{cpu / floor_cpu:.2f}"]
        if "rss_mib" in runs[kind][0]:
            cells += [f"{med(runs[kind], k):.0f}" for k in ("rss_mib", "anon_mib")] + [
                f"{med(runs[kind], 'import_s'):.2f}"
            ]
        else:
            cells += ["", "", ""]
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def targets(runs: dict[str, list[dict]], largest_bytes: int) -> str:
    """Issue 15's and issue 3's targets for the graft, each with its measured value. Peak RSS is the
    whole process's (imports included), the stricter reading."""
    rss_cap = (2 * largest_bytes + 500e6) / 2**20
    whole = med(runs["process"], "wall_s") / med(runs["floor"], "wall_s")
    rows = [
        ("graftlab graft, whole process <= 2 x byte floor", f"{whole:.2f} x", whole <= 2),
        (
            f"peak RSS <= 2 x largest tensor + 500 MB = {rss_cap:.0f} MiB",
            f"{med(runs['graft'], 'rss_mib'):.0f} MiB",
            med(runs["graft"], "rss_mib") <= rss_cap,
        ),
    ]
    if "mergekit" in runs:
        wall, rss = (med(runs["graft"], k) / med(runs["mergekit"], k) for k in ("wall_s", "rss_mib"))
        rows += [
            ("graft() wall <= 0.7 x mergekit", f"{wall:.2f} x", wall <= 0.7),
            ("peak RSS <= 0.5 x mergekit", f"{rss:.2f} x", rss <= 0.5),
        ]
    lines = ["| target | measured | met |", "|---|---:|:---:|"]
    lines += [f"| {target} | {value} | {'yes' if ok else 'no'} |" for target, value, ok in rows]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> None:
    mergekit = find_mergekit(args.mergekit)
    if mergekit:
        check_mergekit(mergekit, args.threads)
    else:
        print("mergekit: no mergekit-yaml on PATH and no --mergekit given; its row is skipped")
    shapes = qwen3_shapes(args.params)
    n_params = sum(math.prod(s) for s in shapes.values())
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="graft-bench-"))
    try:
        start = time.perf_counter()
        write_trio(work, shapes, args.dtype, args.shards)
        itemsize = {"bf16": 2, "fp16": 2, "fp32": 4}[args.dtype]
        largest = max(math.prod(s) for s in shapes.values()) * itemsize
        print(
            f"{n_params / 1e6:.0f}M params, {args.dtype}, {n_params * itemsize / 1e9:.2f} GB per model, "
            f"{args.shards} shard(s), {len(shapes)} tensors, largest {largest / 1e6:.0f} MB (built in "
            f"{time.perf_counter() - start:.1f} s); warm page cache; {args.threads} thread(s); "
            f"median of {args.repeats}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
        )
        floor, process = byte_floor_cmd(work), graft_cmd(work, args.threads)
        timed_process(floor, work / "out-floor")  # warm-up: page cache and first-import costs
        timed_process(process, work / "out-process")
        runs: dict[str, list[dict]] = {
            "floor": [],
            "process": [],
            "graft": [],
            **({"mergekit": []} if mergekit else {}),
        }
        for _ in range(args.repeats):  # interleaved, so that a busy moment hits every kind alike
            runs["floor"].append(timed_process(floor, work / "out-floor"))
            runs["process"].append(timed_process(process, work / "out-process"))
            runs["graft"].append(measure("graft", work, args.threads))
            if mergekit:
                runs["mergekit"].append(measure("mergekit", work, args.threads, python=mergekit))
        print(summarise(runs))
        print()
        print(targets(runs, largest))
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--params",
        type=parse_count,
        default=parse_count("0.6B"),
        help="model size, e.g. 50M; 0.6B is Qwen3-0.6B's shapes",
    )
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    parser.add_argument("--shards", type=int, default=1, help="files per model (Qwen3-0.6B has one)")
    parser.add_argument("--repeats", type=int, default=5, help="runs of each, fresh processes")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="graftlab's threads (mergekit's: torch's) in every run; 1 is graftlab's default",
    )
    parser.add_argument(
        "--mergekit",
        help="mergekit-yaml of a mergekit install (its own venv); default: the one on PATH, else no mergekit row",
    )
    parser.add_argument(
        "--workdir",
        help="build the models in this new directory and keep them (default: a removed temporary directory)",
    )
    parser.add_argument("--worker", choices=["graft", "mergekit"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not Path("/proc/self/status").is_file():
        sys.exit("graft_bench measures memory through /proc/self/status: Linux only")
    if args.worker:
        worker(args.worker, Path(args.workdir), args.threads)
    else:
        run(args)


if __name__ == "__main__":
    main()
