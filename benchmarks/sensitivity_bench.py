"""Wall time of one `sensitivity_update` job (write_update_sensitivity in a fresh process, as the workflow
runs it): its imports, its work and its peak RSS, over bf16 models of Qwen3's tensor names and a random
fp32 diagonal Fisher, built here with numpy.

    python benchmarks/sensitivity_bench.py                  # this tree
    git archive <commit> src | tar -x -C /tmp/old && python benchmarks/sensitivity_bench.py --src /tmp/old/src

Sizes: `pico` (the tests' pico model: hidden 16, 2 layers, vocab 32), `mid` (hidden 512, 4 layers,
vocab 32000: 46M parameters).
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from graftlab.graft_numpy import narrow_bf16
from graftlab.io.safetensors_io import SafetensorsWriter

SIZES = {"pico": (16, 32, 2, 32), "mid": (512, 1536, 4, 32000)}  # hidden, mlp, layers, vocab
JOB = """
import sys, time
start = time.perf_counter()
try:
    from graftlab.analysis.sensitivity_shares import write_update_sensitivity
except ImportError:  # before the split
    from graftlab.analysis.sensitivity import write_update_sensitivity
imported = time.perf_counter()
write_update_sensitivity(*sys.argv[1:6], top=0.01)
print(imported - start, time.perf_counter() - imported, "torch" in sys.modules)
"""


def tensors(hidden: int, mlp: int, layers: int, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    names = [("model.embed_tokens.weight", (vocab, hidden)), ("lm_head.weight", (vocab, hidden))]
    names.append(("model.norm.weight", (hidden,)))
    for layer in range(layers):
        p = f"model.layers.{layer}."
        names += [(f"{p}self_attn.{x}_proj.weight", (hidden, hidden)) for x in "qkvo"]
        names += [(f"{p}mlp.{x}_proj.weight", (mlp, hidden)) for x in ("gate", "up")]
        names += [(f"{p}mlp.down_proj.weight", (hidden, mlp))]
        names += [(f"{p}{x}.weight", (hidden,)) for x in ("input_layernorm", "post_attention_layernorm")]
    return names


def build(root: Path, size: str) -> None:
    rng = np.random.default_rng(0)
    names = tensors(*SIZES[size])
    post = {n: rng.standard_normal(s, dtype=np.float32) * 0.02 for n, s in names}
    for role, noise in (("post", 0.0), ("sft", 0.001)):
        (root / role).mkdir()
        with SafetensorsWriter(root / role / "model.safetensors", [(n, "BF16", s) for n, s in names]) as w:
            for n, s in names:
                x = (post[n] + noise * rng.standard_normal(s, dtype=np.float32)).ravel()
                w.write_bytes(n, s, narrow_bf16(x, np.empty(x.size, np.uint32), np.empty(x.size, np.uint16)))
    (root / "fisher").mkdir()
    with SafetensorsWriter(root / "fisher" / "diag.safetensors", [(n, "F32", s) for n, s in names]) as w:
        for n, s in names:
            w.write_bytes(n, s, rng.random(s, dtype=np.float32) ** 6)


def run_job(root: Path, env: dict, i: int) -> tuple[float, float, float, float, bool]:
    """(process wall s, import s, work s, peak RSS MiB, torch imported) of one job in a fresh process."""
    args = [str(root / "fisher"), str(root / "post"), "sft/post/lr~1e-3/epoch~2", str(root / "sft")]
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-c", JOB, *args, str(root / f"out{i}.parquet")], env=env, stdout=subprocess.PIPE, text=True
    )
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if status:
        raise SystemExit(f"job failed ({status})")
    imported, work, torch = out.split()
    return wall, float(imported), float(work), usage.ru_maxrss / 1024, torch == "True"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", help="a source tree (its src/) to time instead of the installed graftlab")
    parser.add_argument("--size", choices=SIZES, default="pico")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    env = dict(os.environ, PYTHONPATH=args.src) if args.src else dict(os.environ)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        build(root, args.size)
        runs = [run_job(root, env, i) for i in range(args.repeats)]
    median = [statistics.median(r[j] for r in runs) for j in range(4)]
    print("| size | process wall s | import s | work s | peak RSS MiB | torch imported |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    print(f"| {args.size} | {median[0]:.2f} | {median[1]:.2f} | {median[2]:.2f} | {median[3]:.0f} | {runs[0][4]} |")


if __name__ == "__main__":
    main()
