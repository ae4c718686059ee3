"""What each job asks its scheduler for: GPUs, host memory, runtime, CPUs and partition, from the model's
size and the job's work, so a real model gets real limits and the tiny world keeps small ones.

Standard library only: the workflow imports it while it parses. The figures are upper bounds, sized so a
first attempt rarely fails; each retry (`attempt` > 1) grows memory and runtime by `GROWTH`.

- GPU memory per parameter, by kind: training with AdamW in mixed precision holds bf16 weights and
  gradients, fp32 master weights and two fp32 moments (2 + 2 + 4 + 8 = 16 bytes), plus a frozen bf16
  copy (2 bytes) where a second model sits beside it (OPSD's teacher, Pedagogical RL's student);
  sampling holds bf16 weights (2 bytes) and leaves the rest to the KV cache; a Fisher holds bf16
  weights, fp32 per-example gradients and fp32 accumulators (2 + 4 + 4 = 10 bytes). `HEADROOM` covers
  activations and the KV cache. GPUs = that need over `GPU_MEMORY_GB`, rounded up.
- Host memory: a GPU job passes one fp32 copy of the model through host memory while it loads and
  saves (4 bytes per parameter); a graft holds the post model, a delta, the Fisher and the result in
  fp32 at once (16 bytes); a sensitivity update the Fisher and two streamed models (8 bytes).
- Runtime: tokens x FLOPs per token (2 x params to sample, 6 x params to train or to take
  per-example gradients) at `SAMPLE_FLOPS` / `TRAIN_FLOPS` effective per GPU, every sample counted at
  its full token budget, plus `SETUP_MIN`; capped at `MAX_RUNTIME_MIN`, beyond which a trainer resumes
  after SLURM requeues it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

# Every rule of the workflow by what it needs; tests/test_resources.py fails on a rule missing here.
TRAIN = ("world_pretrain", "world_posttrain", "sft", "opsd", "pedagogical_teacher")
SAMPLE = ("mine", "teacher_traces", "star", "pedagogical_traces", "rollouts", "evaluate")
FISHER = ("fisher",)
GPU_KINDS = TRAIN + SAMPLE + FISHER
# Host-memory bytes per parameter of the CPU rules that hold whole models.
CPU_BYTES_PER_PARAM = {"graft": 16, "sensitivity_update": 8}
CPU_MEM_MB = {"dataset": 8000, "fetch_model": 4000}
CPU_KINDS = (
    "all",
    "dataset",
    "drift",
    "expert_traces",
    "fetch_model",
    "graft",
    "knowledge",
    "latency",
    "moe",
    "pareto",
    "sensitivity",
    "sensitivity_update",
    "study",
    "summary",
    "takeover",
    "world_benchmarks",
    "world_candidates",
    "world_corpus",
    "world_tokenizer",
)

GPU_BYTES_PER_PARAM = {"train": 16, "train_pair": 18, "sample": 2, "fisher": 10}
TWO_MODELS = ("opsd", "pedagogical_teacher")
HEADROOM = 1.25
GPU_MEMORY_GB = 80  # an A100/H100 80 GB; a smaller card needs more GPUs than this asks for
SAMPLE_FLOPS = 40e12  # decoding is memory-bound: about a tenth of an H100's bf16 peak
TRAIN_FLOPS = 120e12  # about 30% of the bf16 peak
SETUP_MIN = 10  # loading the model, compiling the engine, writing the results
MAX_RUNTIME_MIN = 48 * 60
GROWTH = 1.5
BASE_MEM_MB = 4000
GPU_JOB_CPUS = 8  # tokenization and vLLM's scheduler and detokenizer run on the CPU beside the GPU
TINY_PARAMS = 2e6  # the tiny world's models: about 0.4M parameters by default, with room to grow


def classify(rule: str) -> str:
    """`gpu` or `cpu` for a rule name; an unknown rule is an error, so a new rule must be sized here."""
    if rule in GPU_KINDS:
        return "gpu"
    if rule in CPU_KINDS:
        return "cpu"
    raise KeyError(f"rule {rule!r} is not sized in graftlab.resources: add it to GPU_KINDS or CPU_KINDS")


def params_from_config(config: dict) -> int:
    """Parameters of a decoder-only transformer from its HF config.json (dense or mixture-of-experts)."""
    text = config.get("text_config", config)
    hidden, layers, vocab = text["hidden_size"], text["num_hidden_layers"], text["vocab_size"]
    heads = text["num_attention_heads"]
    head_dim = text.get("head_dim") or hidden // heads
    kv = text.get("num_key_value_heads") or heads
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv * head_dim
    experts = text.get("num_experts") or text.get("num_local_experts") or 0
    if experts:
        mlp = experts * 3 * hidden * text.get("moe_intermediate_size", text["intermediate_size"])
    else:
        mlp = 3 * hidden * text["intermediate_size"]
    embeddings = vocab * hidden * (1 if text.get("tie_word_embeddings", config.get("tie_word_embeddings")) else 2)
    return layers * (attention + mlp) + embeddings


def model_params(model_dir: str | Path | None, hint: float | None = None) -> float:
    """A model's parameter count: its config.json where it already lies here, else the config's size
    hint (a model not fetched yet), else the tiny world's size."""
    if model_dir is not None:
        path = Path(model_dir) / "config.json"
        if path.is_file():
            return float(params_from_config(json.loads(path.read_text())))
    return float(hint) if hint else TINY_PARAMS


def job_resources(
    rule: str,
    params: float = TINY_PARAMS,
    *,
    sequences: int = 0,
    tokens: int = 0,
    attempt: int = 1,
    partitions: dict | None = None,
) -> dict:
    """The resources of one job of `rule`: `sequences` sequences of up to `tokens` tokens each (sampled,
    trained on, or differentiated) by a model of `params` parameters, at try `attempt`. `partitions`
    maps `cpu` / `gpu` to partition names; without it no `slurm_partition` is set."""
    kind = classify(rule)
    grow = GROWTH ** (attempt - 1)
    gpus = 0
    if kind == "gpu":
        gpus = max(1, math.ceil(params * _gpu_bytes(rule) * HEADROOM / (GPU_MEMORY_GB * 1e9)))
        mem_mb = BASE_MEM_MB + params * 4 / 1e6
        flops = (2 if rule in SAMPLE else 6) * params * sequences * tokens
        rate = (SAMPLE_FLOPS if rule in SAMPLE else TRAIN_FLOPS) * gpus
        runtime = SETUP_MIN + flops / rate / 60
    else:
        mem_mb = CPU_MEM_MB.get(rule, BASE_MEM_MB) + params * CPU_BYTES_PER_PARAM.get(rule, 0) / 1e6
        runtime = SETUP_MIN + params * CPU_BYTES_PER_PARAM.get(rule, 0) / 50e6 / 60  # ~50 MB/s of tensors
    out = {
        "gpu": gpus,
        "mem_mb": math.ceil(mem_mb * grow),
        "runtime": min(MAX_RUNTIME_MIN, math.ceil(runtime * grow)),
        "cpus_per_task": GPU_JOB_CPUS if gpus else 1,
    }
    if partitions and partitions.get(kind):
        out["slurm_partition"] = partitions[kind]
    return out


def _gpu_bytes(rule: str) -> int:
    if rule in SAMPLE:
        return GPU_BYTES_PER_PARAM["sample"]
    if rule in FISHER:
        return GPU_BYTES_PER_PARAM["fisher"]
    return GPU_BYTES_PER_PARAM["train_pair" if rule in TWO_MODELS else "train"]


# What a job's work is sized by, where the config does not say it.
PROMPT_TOKENS = 512  # a competition problem in its chat template; the tiny world's are far shorter
NOMINAL_PROBLEMS = 10_000  # a real data set that sets no `limit` (MATH's training split has 7,500)
# A benchmark that sets no `limit`: MATH-500's size; AIME and HMMT hold 30 each.
NOMINAL_BENCHMARK_PROBLEMS = 500


def problems(source: dict | None, nominal: int = NOMINAL_PROBLEMS) -> int:
    """Problems a real data set holds at most: its `limit`, else `nominal`."""
    return (source or {}).get("limit") or nominal


def job_work(rule: str, *, world: dict, experiment: dict | None = None, donor: str = "post"):
    """(model, sequences, tokens per sequence) of one job of `rule`, from its resolved world section and,
    for an experiment's rule, the experiment's section: the model is `post`, a donor or teacher name, or
    None for the tiny world's own training; tokens include `PROMPT_TOKENS`."""
    if rule == "world_pretrain":
        return None, world["pretrain"]["steps"] * world["pretrain"]["batch_size"], world["model"]["max_positions"]
    if rule == "world_posttrain":
        post = world["posttrain"]
        return (
            None,
            post["examples_per_task"] * len(world["old_tasks"]) * post["epochs"],
            world["model"]["max_positions"],
        )
    if experiment is None:
        return None, 0, 0
    x = experiment
    cands = problems(x["problems"]) if x["problems"] else world["candidates"]
    new = {"teacher": x["teacher"], "star": x["star"], "pedagogical": x["pedagogical"]}.get(x["data"], x["mining"])
    new = new["max_new_tokens"]
    bench = sum(problems(s, NOMINAL_BENCHMARK_PROBLEMS) for s in (x["benchmarks"] or {}).values())
    ped = x["pedagogical"]
    work = {
        "mine": ("post", cands * x["mining"]["samples"], x["mining"]["max_new_tokens"]),
        "teacher_traces": (x["teacher"]["model"], cands * x["teacher"]["attempts"], new),
        "star": ("post", cands * x["star"]["attempts"], new),
        "pedagogical_traces": ("post", cands * ped["attempts"], new),
        "pedagogical_teacher": ("post", ped["steps"] * ped["prompts_per_step"] * ped["group_size"], new),
        "sft": (donor, cands * x["sft"]["epochs"], new),
        "opsd": ("post", x["opsd"]["steps"] * x["opsd"]["batch_size"], x["opsd"]["max_new_tokens"]),
        "rollouts": ("post", x["fisher"]["rollouts"], x["fisher"]["max_new_tokens"]),
        "fisher": ("post", x["fisher"]["rollouts"], x["fisher"]["max_new_tokens"]),
        "evaluate": ("post", (bench + x["mining"]["heldout"]) * x["eval"]["samples"], x["eval"]["max_new_tokens"]),
    }
    model, sequences, tokens = work.get(rule, ("post", 0, 0))
    return model, sequences, tokens + PROMPT_TOKENS
