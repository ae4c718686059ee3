"""A GPU check: every stage of graftlab on a Qwen3-shaped model of about 0.5B parameters, built locally.

    python benchmarks/gpu_check.py --out /tmp/gpu_check            # a GPU with vLLM: a few minutes
    python benchmarks/gpu_check.py --backend transformers --out /tmp/gpu_check   # a GPU without vLLM: ~4 min
    python benchmarks/gpu_check.py --size pico --out /tmp/check    # the same stages on a CPU, in seconds

Nothing is downloaded: the model is initialised at random with the tiny world's character tokenizer, so
its samples are noise that runs to the token budget (which is what a throughput check wants). The stages
are the workflow's own functions, run in this process:

1. sampling (vLLM when installed, else transformers `generate`): rollouts of old-task prompts;
2. SFT, 20 steps under the precision graftlab picks (bf16 autocast over fp32 weights on a GPU);
3. the diagonal retention Fisher over the rollouts (256 on the 0.5B model);
4. a graft of the SFT update into the model;
5. an evaluation of the graft on a tiny-world benchmark;
6. GRPO (TRL's trainer, as the workflow runs it): 2 optimizer steps, each sampling `GRPO_GENERATIONS`
   completions of 16 problems; the second step's sampling and update seconds are the figures.

Per stage it prints seconds, tokens/s, MFU (model FLOPs: 2 x params per sampled or scored token, 6 x
params per trained token or Fisher token, over the stage's wall time, against `--peak-flops`) and peak
memory (GPU: torch's peak allocation in the stage; CPU: the process's peak RSS so far), as a Markdown
table, and writes it to `OUT/gpu_check.json` after every stage. A stage that fails is reported with its
error and the rest still run, so one short lease gives every figure it can.
Record the table in benchmarks/README.md.
"""

import argparse
import json
import random
import resource
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

# name: (hidden, intermediate, layers, heads, kv heads, head_dim, rollouts, rollout tokens, SFT batch, SFT tokens)
SIZES = {
    "0.5b": (1024, 3072, 32, 16, 8, 128, 256, 512, 16, 1024),
    "pico": (32, 64, 2, 2, 1, 16, 16, 16, 4, 32),
}
SFT_STEPS = 20
GRPO_PROBLEMS, GRPO_GENERATIONS = 16, 8


@dataclass
class Stage:
    name: str
    seconds: float
    tokens: int
    flops: float
    peak_gb: float
    note: str = ""

    def row(self, peak_flops: float) -> str:
        rate = self.tokens / self.seconds if self.seconds else 0.0
        mfu = self.flops / self.seconds / peak_flops if self.seconds else 0.0
        cells = [
            self.name,
            f"{self.seconds:.2f}",
            str(self.tokens),
            f"{rate:,.0f}",
            f"{mfu:.3f}",
            f"{self.peak_gb:.2f}",
        ]
        return "| " + " | ".join(cells + [self.note]) + " |"


def peak_memory_gb() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB on Linux


def reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def elapsed(start: float) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def build_model(size: str, out: Path) -> int:
    """A Qwen3-shaped model at random, saved with the tiny world's tokenizer; returns its parameter count."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from graftlab.world.tokenizer import build_tokenizer

    hidden, inter, layers, heads, kv, head_dim, *_ = SIZES[size]
    tok = build_tokenizer()
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.pad_token_id,
    )
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def sampling(model: Path, size: str, root: Path, params: int, backend: str) -> Stage:
    """Rollouts of old-task prompts, written as the Fisher's input."""
    from transformers import AutoTokenizer

    from graftlab.fisher.rollouts import retention_problems, sample_rollouts
    from graftlab.sampling import SamplingConfig, load_sampler
    from graftlab.world.build import make_benchmarks

    *_, rollouts, tokens, _, _ = SIZES[size]
    make_benchmarks(["add", "sub"], 50, 0, root / "bench")
    problems = retention_problems(
        ["add", "sub"], rollouts, 0, [root / "bench" / f"{t}.parquet" for t in ("add", "sub")]
    )
    sampler, tok = load_sampler(model, backend), AutoTokenizer.from_pretrained(model)
    cfg = SamplingConfig(n=1, temperature=1.0, top_p=1.0, max_new_tokens=tokens, seed=0)
    reset_peak()
    start = time.perf_counter()
    frame = sample_rollouts(sampler, tok, problems, cfg)
    seconds = elapsed(start)
    frame.write_parquet(root / "rollouts.parquet")
    generated = int(frame["completion_ids"].list.len().sum())
    prompt = int(frame["prompt_ids"].list.len().sum())
    del sampler
    return Stage("sampling", seconds, generated, 2 * params * (generated + prompt), peak_memory_gb())


def sft(model: Path, size: str, root: Path, params: int) -> Stage:
    """20 steps on random sequences; tokens/s from the step times after the first (warm-up)."""
    from graftlab.train.sft import TrainConfig, finetune

    *_, batch, length = SIZES[size]
    rng = random.Random(0)
    rows = [{"input_ids": [rng.randrange(10, 80) for _ in range(length)]} for _ in range(batch * SFT_STEPS)]
    cfg = TrainConfig(
        lr=1e-5, batch_size=batch, steps=SFT_STEPS, save_steps=(SFT_STEPS,), threads=torch.get_num_threads()
    )
    reset_peak()
    finetune(model, rows, cfg, [root / "sft"], data="random tokens", steps_out=root / "sft_steps.jsonl")
    steps = [json.loads(line) for line in (root / "sft_steps.jsonl").read_text().splitlines()]
    seconds = sum(s["update_s"] for s in steps[1:])
    tokens = batch * length * (len(steps) - 1)
    return Stage("sft (20 steps)", seconds, tokens, 6 * params * tokens, peak_memory_gb())


def fisher(model: Path, root: Path, params: int) -> Stage:
    import polars as pl

    from graftlab.fisher import write_fisher

    frame = pl.read_parquet(root / "rollouts.parquet")
    tokens = int(frame["completion_ids"].list.len().sum() + frame["prompt_ids"].list.len().sum())
    reset_peak()
    start = time.perf_counter()
    write_fisher("diag", model, root / "rollouts.parquet", root / "fisher", batch_size=8)
    return Stage(
        f"diag Fisher ({frame.height} rollouts)", elapsed(start), tokens, 6 * params * tokens, peak_memory_gb()
    )


def graft(model: Path, root: Path) -> Stage:
    from graftlab.graft import graft as run_graft

    start = time.perf_counter()
    counts = run_graft(model, model, root / "sft", 1.0, root / "graft")
    seconds = elapsed(start)
    note = f"{counts['bytes'] / 1e9:.2f} GB written, {counts['bytes'] / 1e9 / seconds:.2f} GB/s (on the CPU)"
    return Stage("graft", seconds, 0, 0.0, peak_memory_gb(), note)


def evaluation(root: Path, size: str, params: int, backend: str) -> Stage:
    from graftlab.evaluate.run import Benchmark, evaluate
    from graftlab.sampling import SamplingConfig

    tokens = SIZES[size][7]
    cfg = SamplingConfig(n=4, temperature=1.0, top_p=1.0, max_new_tokens=tokens, seed=0)
    bench = Benchmark("add", root / "bench" / "add.parquet", "old")
    reset_peak()
    start = time.perf_counter()
    evaluate(root / "graft", [bench], cfg, root / "eval", "graft", backend=backend)
    seconds = elapsed(start)
    import polars as pl

    records = pl.read_parquet(root / "eval" / "add.parquet")
    generated = int(records["completion"].str.len_chars().sum())  # one token per character
    return Stage("evaluation", seconds, generated, 2 * params * generated, peak_memory_gb())


def grpo(model: Path, size: str, root: Path, params: int, backend: str) -> Stage:
    """Two GRPO steps through graftlab's trainer; the second (warm) step's seconds and tokens."""
    from graftlab.tasks import arith
    from graftlab.train.grpo import GrpoConfig, train_grpo

    rows = arith.sample_problems("add", GRPO_PROBLEMS, "bench", 0)
    problems = [{"prompt": p["prompt"], "answer": p["answer"], "task": "add"} for p in rows]
    cfg = GrpoConfig(
        lr=1e-6,
        steps=2,
        batch_size=GRPO_PROBLEMS,
        generations=GRPO_GENERATIONS,
        max_new_tokens=SIZES[size][7] // 2,
        threads=torch.get_num_threads(),
        backend=backend,
    )
    reset_peak()
    log = train_grpo(model, problems, cfg, root / "grpo")
    last = log[-1]
    seconds = last["sample_s"] + last["update_s"]
    tokens = int(last["response_tokens"])  # of the step's whole sampled batch
    # Sampling 2 x params per token; the update's old log-probs, forward and backward 2 + 6.
    note = f"sampling {last['sample_s']:.2f} s, update {last['update_s']:.2f} s"
    return Stage("grpo (1 warm step)", seconds, tokens, 10 * params * tokens, peak_memory_gb(), note)


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    names = ("torch", "transformers", "trl", "accelerate", "vllm", "polars", "pyarrow", "datasets")
    found = {}
    for name in names:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="0.5b")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--backend", default="auto", help="sampling backend: auto | vllm | transformers")
    parser.add_argument("--peak-flops", type=float, default=989e12, help="dense bf16 peak (H100/H200: 989e12)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    params = build_model(args.size, args.out / "model")
    print(f"{args.size}: {params / 1e6:.1f}M parameters on {device}; {versions()}", flush=True)
    model = args.out / "model"
    runs = [
        lambda: sampling(model, args.size, args.out, params, args.backend),
        lambda: sft(model, args.size, args.out, params),
        lambda: fisher(model, args.out, params),
        lambda: graft(model, args.out),
        lambda: evaluation(args.out, args.size, params, args.backend),
        lambda: grpo(model, args.size, args.out, params, args.backend),
    ]
    stages, failed = [], []
    for run in runs:
        try:
            stages.append(run())
            print(stages[-1].row(args.peak_flops), flush=True)
        except Exception as e:  # a benchmark reports each stage it can; the error is printed and recorded
            traceback.print_exc()
            failed.append(repr(e))
        record = {"device": device, "params": params, "size": args.size, "versions": versions()}
        record |= {"stages": [asdict(s) for s in stages], "failed": failed}
        (args.out / "gpu_check.json").write_text(json.dumps(record, indent=2))
    print(f"\n{device}, {params / 1e6:.1f}M parameters, MFU against {args.peak_flops:.3g} FLOP/s")
    print("| stage | seconds | tokens | tokens/s | MFU | peak memory (GB) | |\n|---|---:|---:|---:|---:|---:|---|")
    print("\n".join(s.row(args.peak_flops) for s in stages))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
