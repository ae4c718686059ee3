"""Diagonal Fisher and KFAC statistics cost as a ratio to a plain batched forward+backward over the same
rollouts, and (`--peak`) the peak memory of the diagonal Fisher against that backward's.

"KFAC statistics" is the pass over the rollouts (factors A and G, the diagonal of the other parameters);
the eigendecompositions are a one-off cost per layer, independent of the rollouts, and the EKFAC re-fit a
second pass: both are timed on their own rows.

    python benchmarks/fisher_bench.py --hidden 128 --layers 2 --rollouts 256 --batch 16

All run in this process on the same random Qwen3-shaped model and rollouts; the median of --repeats.
With `--peak`, each of "plain" and "diag" runs in a fresh subprocess (ru_maxrss only ever grows), on one
batch of `--batch` rollouts; the diag subprocess times a plain backward first, as its baseline. E.g.
Qwen3-1.7B's layer shapes at 2 layers, vocabulary cut to 8192, 4 rollouts of 512 tokens, SDPA:

    python benchmarks/fisher_bench.py --peak --hidden 2048 --intermediate 6144 --heads 16 --kv-heads 8 \\
        --head-dim 128 --vocab 8192 --layers 2 --length 512 --batch 4 --attn sdpa

and the KFAC file's size, A per weight against one A per shared input, from the layer shapes (the sizes
tests/test_fisher_scale.py checks against a written file), for this model and the full 1.7B and 8B.
"""

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from graftlab.fisher.diag import diag_fisher, right_pad
from graftlab.fisher.kfac import kfac_fisher, kfac_statistics


def plain_backward(model, rollouts, batch_size):
    for start in range(0, len(rollouts), batch_size):
        ids, scored = right_pad(rollouts[start : start + batch_size], 0)
        model.zero_grad(set_to_none=True)
        logp = model(ids).logits[:, :-1].float().log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
        (logp * scored[:, 1:]).sum().backward()
    model.zero_grad(set_to_none=True)


def build(a):
    torch.manual_seed(0)
    heads = a.heads
    config = Qwen3Config(
        vocab_size=a.vocab,
        hidden_size=a.hidden,
        intermediate_size=a.intermediate or 3 * a.hidden,
        num_hidden_layers=a.layers,
        num_attention_heads=heads,
        num_key_value_heads=a.kv_heads,
        head_dim=a.head_dim or a.hidden // heads,
        max_position_embeddings=2 * a.length,
        tie_word_embeddings=True,
    )
    model = Qwen3ForCausalLM(config).eval()
    model.config._attn_implementation = a.attn  # the same for every run
    prompt = a.length // 3
    rollouts = [
        (
            torch.randint(1, a.vocab, (prompt,)).tolist(),
            torch.randint(1, a.vocab, (a.length - prompt - i % 7,)).tolist(),
        )
        for i in range(a.rollouts)
    ]
    return model, rollouts


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def one(a) -> None:
    """One `--peak` measurement in this (fresh) process; prints a JSON line."""
    model, rollouts = build(a)
    rollouts = rollouts[: a.batch]
    plain_backward(model, rollouts, a.batch)  # warm-up: first-call allocations and kernel selection
    base = _rss_mib()
    start = time.perf_counter()
    plain_backward(model, rollouts, a.batch)
    record = {"plain_s": time.perf_counter() - start}
    if a.one == "diag":
        start = time.perf_counter()
        diag_fisher(model, rollouts, a.batch)
        record["diag_s"] = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(record | {"setup_mib": base, "peak_mib": peak}))


def peak(a) -> None:
    args = [a for a in sys.argv[1:] if a != "--peak"]
    runs = {}
    for name in ("plain", "diag"):
        out = subprocess.run([sys.executable, __file__, *args, "--one", name], capture_output=True, text=True)
        if out.returncode:
            sys.exit(out.stderr)
        runs[name] = json.loads(out.stdout.strip().splitlines()[-1])
    plain, diag = runs["plain"], runs["diag"]
    extra = {n: r["peak_mib"] - r["setup_mib"] for n, r in runs.items()}
    print(f"{a.batch} rollouts of ~{a.length} tokens, attention {a.attn}, {a.threads} threads\n")
    print("| run | wall s | peak RSS MiB | above model+data MiB |\n|---|---:|---:|---:|")
    print(f"| plain forward+backward | {plain['plain_s']:.2f} | {plain['peak_mib']:.0f} | {extra['plain']:.0f} |")
    print(f"| diag Fisher (hooks) | {diag['diag_s']:.2f} | {diag['peak_mib']:.0f} | {extra['diag']:.0f} |")
    ratio = diag["diag_s"] / diag["plain_s"]
    print(
        f"\ntime ratio diag / plain backward (same process): {ratio:.2f}; memory ratio: "
        f"{extra['diag'] / extra['plain']:.2f}\n"
    )
    kfac_sizes(a)


def kfac_file_floats(hidden, intermediate, q_out, kv_out, layers) -> tuple[int, int]:
    """Floats of a KFAC file's layer factors (A, G and their eigen-pairs), per weight and shared."""
    linears = [(hidden, q_out), (hidden, kv_out), (hidden, kv_out), (q_out, hidden)]
    linears += [(hidden, intermediate), (hidden, intermediate), (intermediate, hidden)]
    per_weight = sum(2 * (i * i + o * o) + i + o for i, o in linears) * layers
    return per_weight, per_weight - 3 * (2 * hidden * hidden + hidden) * layers  # k, v read q's input; up gate's


def kfac_sizes(a) -> None:
    shapes = {
        "this model": (
            a.hidden,
            a.intermediate or 3 * a.hidden,
            a.heads * a.head_dim,
            a.kv_heads * a.head_dim,
            a.layers,
        ),
        "Qwen3-1.7B (28 layers)": (2048, 6144, 16 * 128, 8 * 128, 28),
        "Qwen3-8B (36 layers)": (4096, 12288, 32 * 128, 8 * 128, 36),
    }
    print("| KFAC factors | per weight GiB | shared GiB | saved |\n|---|---:|---:|---:|")
    for name, s in shapes.items():
        old, new = kfac_file_floats(*s)
        print(f"| {name} | {4 * old / 2**30:.2f} | {4 * new / 2**30:.2f} | {1 - new / old:.0%} |")


def table(a) -> None:
    model, rollouts = build(a)
    runs = {
        "plain forward+backward": plain_backward,
        "diag Fisher (hooks)": diag_fisher,
        "KFAC statistics": kfac_statistics,
        "KFAC statistics + eigh": kfac_fisher,
        "KFAC + EKFAC pass": lambda m, r, b: kfac_fisher(m, r, b, ekfac=True),
    }
    times = {name: [] for name in runs}
    for _ in range(a.repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run(model, rollouts, a.batch)
            times[name].append(time.perf_counter() - start)
    base = statistics.median(times["plain forward+backward"])
    params = sum(p.numel() for p in model.parameters())
    print(f"{params:,} params, {a.rollouts} rollouts of ~{a.length} tokens, batch {a.batch}, {a.threads} threads\n")
    print("| measurement | wall s | ratio |\n|---|---:|---:|")
    for name, ts in times.items():
        print(f"| {name} | {statistics.median(ts):.2f} | {statistics.median(ts) / base:.2f} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--intermediate", type=int, default=0, help="default 3 x hidden")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=0, help="default hidden / heads")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=84)
    ap.add_argument("--rollouts", type=int, default=256)
    ap.add_argument("--length", type=int, default=48)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--attn", default="sdpa", choices=["eager", "sdpa"])
    ap.add_argument("--peak", action="store_true", help="peak memory of diag vs plain, in subprocesses")
    ap.add_argument("--one", choices=["plain", "diag"], help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.head_dim = a.head_dim or a.hidden // a.heads
    torch.set_num_threads(a.threads)
    if a.one:
        one(a)
    elif a.peak:
        peak(a)
    else:
        table(a)


if __name__ == "__main__":
    main()
