"""Diagonal Fisher and KFAC statistics cost as a ratio to a plain batched forward+backward over the same
rollouts. "KFAC statistics" is the pass over the rollouts (factors A and G, the diagonal of the other
parameters); the eigendecompositions are a one-off cost per layer, independent of the rollouts, and the
EKFAC re-fit a second pass: both are timed on their own rows.

    python benchmarks/fisher_bench.py --hidden 128 --layers 2 --rollouts 256 --batch 16

Both run in this process on the same random Qwen3-shaped model and rollouts; the median of --repeats.
"""

import argparse
import statistics
import time

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from graftlab.fisher.diag import diag_fisher, right_pad
from graftlab.fisher.kfac import kfac_fisher, kfac_statistics


def plain_backward(model, rollouts, batch_size):
    for start in range(0, len(rollouts), batch_size):
        ids, scored = right_pad(rollouts[start : start + batch_size], 0)
        model.zero_grad()
        logp = model(ids).logits[:, :-1].float().log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
        (logp * scored[:, 1:]).sum().backward()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=84)
    ap.add_argument("--rollouts", type=int, default=256)
    ap.add_argument("--length", type=int, default=48)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=a.vocab,
        hidden_size=a.hidden,
        intermediate_size=3 * a.hidden,
        num_hidden_layers=a.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=a.hidden // 4,
        max_position_embeddings=2 * a.length,
    )
    model = Qwen3ForCausalLM(config).eval()
    model.config._attn_implementation = "eager"  # as write_diag_fisher loads it; the same for both sides
    prompt = a.length // 3
    rollouts = [
        (
            torch.randint(1, a.vocab, (prompt,)).tolist(),
            torch.randint(1, a.vocab, (a.length - prompt - i % 7,)).tolist(),
        )
        for i in range(a.rollouts)
    ]
    runs = {
        "plain forward+backward": plain_backward,
        "diag Fisher (vmap)": diag_fisher,
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


if __name__ == "__main__":
    main()
