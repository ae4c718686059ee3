"""Peak memory of each job kind against graftlab's memory model (`graftlab.memory`).

    python benchmarks/memory_bench.py                 # every kind, ~25M parameters, on this machine's device
    python benchmarks/memory_bench.py --kinds sft fisher_diag --hidden 768 --layers 12

Each kind runs in a fresh process through graftlab's own function, on a Qwen3-shaped model at random (the
tiny world's tokenizer, fp32 weights), at a size where weights dominate. Measured: on a GPU, torch's peak
allocation; on a CPU, the process's peak resident memory less its resident memory once every library the
job uses is imported (so torch's own ~0.4 GB is not counted). Predicted: the memory model's parts for the
same job as this device runs it: bf16 activations and recomputation on a GPU, fp32 activations on a CPU;
sampling by transformers' `generate` (vLLM is the GPU default), with the trained model's own fp32 weights
and an fp32 KV cache.
The table gives measured / predicted; the model is held to within 25% (benchmarks/README.md, "Memory").
"""

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

KINDS = ("sft", "grpo", "opsd", "sdpo", "fisher_diag", "fisher_kfac", "sample")
PROMPTS = 16  # problems a trainer's step or a sampler draws on
NEW = 32  # tokens each sample may generate
SFT_LEN = 256  # tokens of each SFT sequence
MICRO = 4  # sequences per micro-batch


def build(out: Path, hidden: int, layers: int) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from graftlab.world.tokenizer import build_tokenizer

    tok = build_tokenizer()
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 128),
        head_dim=64,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.pad_token_id,
    )
    Qwen3ForCausalLM(config).save_pretrained(out)
    tok.save_pretrained(out)


def problems(task: str = "add"):
    """`PROMPTS` tiny-world problems; `task` coin grades by a response's parity, so about half of a random
    model's samples succeed and GRPO's and SDPO's updates all do their work (benchmarks/onpolicy_bench.py)."""
    from graftlab.tasks import TASKS, Task, arith

    TASKS["coin"] = Task("coin", prompt=str, grade=lambda completion, answer: len(completion) % 2 == 0, reference=str)
    rows = arith.sample_problems("add", PROMPTS, "bench", 0)
    return [{"id": p["id"], "prompt": p["prompt"], "answer": p["answer"], "task": task} for p in rows]


def prompt_tokens(model: Path) -> int:
    """The longest chat prompt of the problems, in tokens."""
    from transformers import AutoTokenizer

    from graftlab.tasks import get_task

    tok = AutoTokenizer.from_pretrained(model)
    return max(len(tok(get_task("add").chat_prompt(tok, p["prompt"]))["input_ids"]) for p in problems())


def predicted(kind: str, model: Path, cuda: bool):
    """The memory model's parts for `kind` as this benchmark runs it, plus on a CPU what the model leaves
    out as a GPU's concern only: the attention matrices of torch's math attention (its CPU path with a
    padding mask), scores and probabilities in fp32, per layer and head."""
    mem = _predicted(kind, model, cuda)
    if not cuda and kind != "sample":
        c = json.loads((model / "config.json").read_text())
        seq = SFT_LEN if kind == "sft" else prompt_tokens(model) + NEW
        mem.parts["attention matrices (CPU)"] = MICRO * c["num_hidden_layers"] * c["num_attention_heads"] * seq**2 * 8
    return mem


def _predicted(kind: str, model: Path, cuda: bool):
    from graftlab import memory as mm
    from graftlab.planning.work import from_config_json, kfac_factor_bytes

    m = from_config_json(model / "config.json")
    shape, P = m.shape, m.params
    act = mm.BF16 if cuda else mm.FP32
    seq = prompt_tokens(model) + NEW
    # The sampler is transformers' generate with the trained fp32 weights: only its fp32 KV cache is new.
    engine = {"engine_tokens": PROMPTS * seq, "engine_bytes": mm.FP32}
    if kind == "sft":
        return mm.trainer(P, shape, tokens=MICRO * SFT_LEN, act_bytes=act, recompute=cuda, step_copy=cuda)
    if kind in ("grpo", "opsd", "sdpo"):
        scorers = 0 if kind == "grpo" else 1
        mem = mm.trainer(
            P, shape, tokens=MICRO * seq, act_bytes=act, recompute=cuda, scorers=scorers, step_copy=cuda, **engine
        )
        mem.parts["sampling engine"] -= P * mm.FP32
        return mem
    if kind.startswith("fisher"):
        factors = kfac_factor_bytes(m) if kind == "fisher_kfac" else 0
        return mm.fisher(P, shape, rollouts=MICRO, sequence=seq, factors=factors, recompute=True)
    return mm.sampler(P, shape, tokens=PROMPTS * 4 * seq, weight_bytes=mm.FP32)  # the checkpoint's dtype


def run(kind: str, model: Path, out: Path, threads: int) -> None:
    """One kind in this process on `threads` threads; prints {"measured": bytes}."""
    import torch

    # Everything any kind imports, before the baseline.
    import trl  # noqa: F401
    from trl import GRPOTrainer, SFTTrainer  # noqa: F401

    from graftlab.fisher import write_fisher
    from graftlab.fisher.rollouts import sample_rollouts
    from graftlab.sampling import SamplingConfig, load_sampler
    from graftlab.synth.demonstrations import opsd_examples
    from graftlab.train.grpo import GrpoConfig, train_grpo
    from graftlab.train.opsd import OpsdConfig, train_opsd
    from graftlab.train.sdpo import SdpoConfig, train_sdpo
    from graftlab.train.sft import TrainConfig, finetune

    cuda = torch.cuda.is_available()
    rl = problems("coin" if kind in ("grpo", "sdpo") else "add")
    if kind.startswith("fisher"):  # rollouts to score, made before the baseline
        from transformers import AutoTokenizer

        cfg = SamplingConfig(n=1, temperature=1.0, top_p=1.0, max_new_tokens=NEW, seed=0)
        frame = sample_rollouts(load_sampler(model, "transformers"), AutoTokenizer.from_pretrained(model), rl, cfg)
        frame.write_parquet(out / "rollouts.parquet")
    torch.set_num_threads(threads)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = rss()
    common = {"threads": threads, "micro_batch_size": MICRO, "backend": "transformers"}
    if kind == "sft":
        import random

        rng = random.Random(0)
        rows = [{"input_ids": [rng.randrange(10, 80) for _ in range(SFT_LEN)]} for _ in range(2 * 2 * MICRO)]
        del common["backend"]
        cfg = TrainConfig(lr=1e-5, batch_size=2 * MICRO, steps=2, save_steps=(2,), **common)
        finetune(model, rows, cfg, [out / "sft"], data="random tokens")
    elif kind == "grpo":
        train_grpo(
            model,
            rl,
            GrpoConfig(lr=1e-6, steps=2, batch_size=PROMPTS // 2, generations=2, max_new_tokens=NEW, **common),
            out / "grpo",
        )
    elif kind == "opsd":
        import polars as pl

        traces = pl.DataFrame(
            [{"id": str(i), "task": "add", "prompt": p["prompt"], "completion": p["answer"]} for i, p in enumerate(rl)]
        )
        cfg = OpsdConfig(alpha=0.5, lr=1e-6, steps=2, batch_size=PROMPTS, max_new_tokens=NEW, **common)
        train_opsd(model, opsd_examples(traces), cfg, out / "opsd")
    elif kind == "sdpo":
        cfg = SdpoConfig(lr=1e-6, steps=2, batch_size=PROMPTS // 2, generations=2, max_new_tokens=NEW, **common)
        train_sdpo(model, rl, cfg, out / "sdpo")
    elif kind.startswith("fisher"):
        write_fisher(kind.removeprefix("fisher_"), model, out / "rollouts.parquet", out / kind, batch_size=MICRO)
    else:
        sampler = load_sampler(model, "transformers")
        from transformers import AutoTokenizer

        cfg = SamplingConfig(n=4, temperature=1.0, top_p=1.0, max_new_tokens=NEW, seed=0)
        sample_rollouts(sampler, AutoTokenizer.from_pretrained(model), rl, cfg)
    peak = torch.cuda.max_memory_allocated() - base if cuda else peak_rss() - base
    print(json.dumps({"measured": peak}))


def rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path("/tmp/memory_bench"))
    # 1 where other processes share the cores (the test suite): torch's threads spin-wait for a busy core.
    parser.add_argument("--threads", type=int, default=2, help="torch threads of each job")
    parser.add_argument("--run", choices=KINDS, help=argparse.SUPPRESS)  # one kind, in the child process
    args = parser.parse_args()
    model = args.out / "model"
    if args.run:
        run(args.run, model, args.out / args.run, args.threads)
        return 0
    import torch

    args.out.mkdir(parents=True, exist_ok=True)
    build(model, args.hidden, args.layers)
    cuda = torch.cuda.is_available()
    params = sum(p.numel() for p in __import__("transformers").AutoModelForCausalLM.from_pretrained(model).parameters())
    device = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"{params / 1e6:.1f}M parameters, hidden {args.hidden}, {args.layers} layers, on {device}", flush=True)
    rows, worst = [], 0.0
    for kind in args.kinds:
        (args.out / kind).mkdir(exist_ok=True)
        cmd = [sys.executable, __file__, "--run", kind, "--out", str(args.out), "--threads", str(args.threads)]
        # glibc hands every block of 64 KiB or more straight back to the kernel when freed, so a CPU's
        # resident memory follows the live tensors (by default it keeps freed blocks for reuse).
        env = os.environ | {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0", "MALLOC_ARENA_MAX": "1"}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode:
            print(proc.stderr[-3000:], file=sys.stderr)
            rows.append(f"| {kind} | failed | | | |")
            worst = float("inf")
            continue
        measured = json.loads(proc.stdout.strip().splitlines()[-1])["measured"]
        mem = predicted(kind, model, cuda)
        ratio = measured / mem.total
        worst = max(worst, abs(ratio - 1))
        parts = ", ".join(f"{k} {v / 1e6:,.0f}" for k, v in mem.parts.items())
        rows.append(f"| {kind} | {measured / 1e6:,.0f} | {mem.total / 1e6:,.0f} | {ratio:.2f} | {parts} |")
        print(rows[-1], flush=True)
    print(f"\n{params / 1e6:.1f}M parameters on {device}; measured against the memory model (parts in MB)")
    print("| job | measured MB | predicted MB | measured / predicted | predicted parts (MB) |")
    print("|---|---:|---:|---:|---|")
    print("\n".join(rows))
    print(f"\nlargest miss: {worst:.0%}")
    return 0 if worst <= 0.25 else 1


if __name__ == "__main__":
    sys.exit(main())
