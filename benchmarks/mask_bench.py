"""Peak memory and time of a masked graft: the streamed global threshold (graftlab.fisher.make_mask: Fisher
and deltas read tensor by tensor, radix select in two passes) against the former exact path (the whole
Fisher, every delta and every score held in fp32, concatenated and ranked by kthvalue), reimplemented here
as it was. Each runs in a fresh subprocess (ru_maxrss only ever grows) on the same bf16 post, donor and
tuned models and random diagonal Fisher, written once to --dir; the grafted outputs are compared bit for bit.

    python benchmarks/mask_bench.py --hidden 2048 --intermediate 6144 --heads 16 --kv-heads 8 \\
        --head-dim 128 --vocab 8192 --layers 2

Qwen3-1.7B's layer shapes at 2 layers and a vocabulary of 8192 (tied embeddings, as 1.7B has).
"""

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def write_inputs(a, root: Path) -> None:
    from safetensors.torch import save_file
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=a.vocab,
        hidden_size=a.hidden,
        intermediate_size=a.intermediate,
        num_hidden_layers=a.layers,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
        head_dim=a.head_dim,
        tie_word_embeddings=True,
    )
    model = Qwen3ForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(root / "post")
    model.to(torch.bfloat16).save_pretrained(root / "donor")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    model.save_pretrained(root / "tuned")
    fisher = {n: torch.rand(p.shape) for n, p in model.named_parameters()}
    (root / "fisher").mkdir()
    save_file(fisher, root / "fisher" / "diag.safetensors")


def former_mask(fisher_dir, post, donor, tuned, rho):
    """The global mask as it was before the radix select: everything in memory, kthvalue over the scores."""
    from graftlab.fisher.masks import DiagMask, load_diag_fisher, read_deltas

    fisher = load_diag_fisher(fisher_dir, post)
    reader = read_deltas(donor, tuned, fisher)
    deltas = {n: reader[n] for n in fisher}
    mask = DiagMask(fisher, rho, scope="tensor")  # ranking set below, as the former constructor did
    mask.scope = "global"
    scores = {n: mask._score(n, deltas[n])[0] for n in mask.sizes}
    flat = torch.cat([s.flatten() for s in scores.values()])
    k = round(rho * mask.total)
    mask.threshold = flat.kthvalue(mask.total - k + 1).values.item()
    mask.ties_left = k - int((flat > mask.threshold).sum())
    return mask


def one(a) -> None:
    from graftlab.fisher import make_mask
    from graftlab.graft import graft

    root = Path(a.dir)
    inputs = [root / "post", root / "donor", root / "tuned"]
    start = time.perf_counter()
    if a.one == "former":
        mask = former_mask(root / "fisher", *inputs, a.rho)
    else:
        mask = make_mask("diag", root / "fisher", *inputs, a.rho)
    mask_s = time.perf_counter() - start
    graft(*inputs, 1.0, root / f"out-{a.one}", project=mask)
    record = {"mask_s": mask_s, "total_s": time.perf_counter() - start, "masked": mask.report()["masked"]}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(record | {"peak_mib": peak, "entries": mask.total}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=6144)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rho", type=float, default=0.1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dir", help="where the models live (default: a temporary directory)")
    ap.add_argument("--one", choices=["former", "streamed"], help=argparse.SUPPRESS)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if a.one:
        return one(a)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(a.dir or tmp)
        if not (root / "fisher").exists():
            write_inputs(a, root)
        runs = {}
        for name in ("former", "streamed"):
            cmd = [sys.executable, __file__, *sys.argv[1:], "--dir", str(root), "--one", name]
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode:
                sys.exit(out.stderr)
            runs[name] = json.loads(out.stdout.strip().splitlines()[-1])
        same = _same(root / "out-former", root / "out-streamed")
    entries = runs["former"]["entries"]
    print(f"{entries:,} entries ({4 * entries / 2**20:.0f} MiB per fp32 copy), rho {a.rho}, {a.threads} threads\n")
    print("| global mask | threshold s | mask + graft s | peak RSS MiB | masked |\n|---|---:|---:|---:|---:|")
    for name, r in runs.items():
        print(f"| {name} | {r['mask_s']:.2f} | {r['total_s']:.2f} | {r['peak_mib']:.0f} | {r['masked']:,} |")
    print(f"\noutputs identical bit for bit: {same}")


def _same(x: Path, y: Path) -> bool:
    from safetensors.torch import load_file

    a, b = load_file(x / "model.safetensors"), load_file(y / "model.safetensors")
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


if __name__ == "__main__":
    main()
