"""What each job asks its scheduler for: GPUs, host memory, runtime, CPUs and partition, from the model's
size and the job's work, so a real model gets real limits and the tiny world keeps small ones.

Standard library only: the workflow imports it while it parses. The figures are upper bounds, sized so a
first attempt rarely fails; each retry (`attempt` > 1) grows memory and runtime by `GROWTH`.

- GPU memory per parameter, by kind: training with AdamW in mixed precision holds bf16 weights and
  gradients, fp32 master weights and two fp32 moments (2 + 2 + 4 + 8 = 16 bytes), plus a frozen bf16
  copy (2 bytes) where a second model sits beside it (OPSD's teacher, Pedagogical RL's student);
  sampling holds bf16 weights (2 bytes) and leaves the rest to the KV cache; a Fisher holds bf16
  weights, fp32 per-example gradients and fp32 accumulators (2 + 4 + 4 = 10 bytes). `HEADROOM` covers
  activations and the KV cache. GPUs = that need over a GPU's memory (`GPU_MEMORY_GB` unless the
  cluster profile states its own, `gpu_memory_gb`), rounded up.
- Host memory: a GPU job passes one fp32 copy of the model through host memory while it loads and
  saves (4 bytes per parameter); a graft holds the post model, a delta, the Fisher and the result in
  fp32 at once (16 bytes); a sensitivity update the Fisher and two streamed models (8 bytes).
- Runtime: the job's FLOPs (`graftlab.planning.work`, the count the cost plan uses too), decoding at
  `SAMPLE_FLOPS` and whole-sequence passes at `TRAIN_FLOPS` per GPU, plus `SETUP_MIN`; capped at
  `MAX_RUNTIME_MIN`, beyond which a trainer resumes after SLURM requeues it. Both rates are 2.5x below
  `graftlab plan`'s default estimate (0.1 and 0.3 of an H100's bf16 peak), so a first attempt rarely
  runs out of time.
"""

from __future__ import annotations

import math

from graftlab.methods import on_policy, trained_rules

# Every rule of the workflow by what it needs; tests/test_resources.py fails on a rule missing here.
# A continual experiment's chain rules (rules/continual.smk) are sized as the rule each one runs
# (`sized("sft")` for chain_sft): they are listed beside it.
TRAIN = ("world_pretrain", "world_posttrain", "pedagogical_teacher", *trained_rules())
SAMPLE = (
    "mine",
    "teacher_traces",
    "star",
    "pedagogical_traces",
    "rollouts",
    "evaluate",
    "evaluate_run",  # every kept checkpoint of a training run (rules/evaluate.smk)
    "graft",  # grafts, then evaluates its model (rules/graft.smk)
    "chain_rollouts",
    "response_kl",
    "stage_star",
)
FISHER = ("fisher", "chain_fisher")
GPU_KINDS = TRAIN + SAMPLE + FISHER
# Host-memory bytes per parameter of the CPU rules that hold whole models.
# A graft streams its three inputs through host memory (graftlab.graft), on a GPU node too.
HOST_BYTES_PER_PARAM = {"graft": 16, "chain_graft": 16, "sensitivity_update": 8}
CPU_MEM_MB = {"dataset": 8000, "fetch_model": 4000}
CPU_KINDS = (
    "all",
    "chain_graft",
    "continual",
    "param_drift",
    "stage_data",
    "dataset",
    "drift",
    "expert_traces",
    "fetch_model",
    "gain_forgetting",
    "knowledge",
    "latency",
    "moe",
    "pareto",
    "report_tables",
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
# Trainers holding a second model beside the one they train: a frozen or moving teacher, Pedagogical RL's student.
TWO_MODELS = ("pedagogical_teacher", *(m.rule for m in on_policy() if m.spec.models == 2))
HEADROOM = 1.25
GPU_MEMORY_GB = 80  # an A100/H100 80 GB; a smaller card needs more GPUs than this asks for
SAMPLE_FLOPS = 40e12  # decoding is memory-bound: about a tenth of an H100's bf16 peak
TRAIN_FLOPS = 120e12  # about 30% of the bf16 peak
SETUP_MIN = 10  # loading the model, compiling the engine, writing the results
MAX_RUNTIME_MIN = 48 * 60
GROWTH = 1.5
# Grafted models on disk at once (each graft job holds one, rules/graft.smk) unless a profile or the command
# line gives `--resources temp_grafts=N`; `graftlab plan --temp-grafts N` prices the disk a cap needs.
TEMP_GRAFTS = 2
BASE_MEM_MB = 4000
GPU_JOB_CPUS = 8  # tokenization and vLLM's scheduler and detokenizer run on the CPU beside the GPU
TINY_PARAMS = 2e6  # a job with no model of its own (fetching, data sets, tables): the tiny world's size


def classify(rule: str) -> str:
    """`gpu` or `cpu` for a rule name; an unknown rule is an error, so a new rule must be sized here."""
    if rule in GPU_KINDS:
        return "gpu"
    if rule in CPU_KINDS:
        return "cpu"
    raise KeyError(f"rule {rule!r} is not sized in graftlab.planning.resources: add it to GPU_KINDS or CPU_KINDS")


def job_resources(
    rule: str,
    params: float = TINY_PARAMS,
    *,
    generate: float = 0.0,
    compute: float = 0.0,
    attempt: int = 1,
    partitions: dict | None = None,
    gpu_memory_gb: float = GPU_MEMORY_GB,
) -> dict:
    """The resources of one job of `rule` by a model of `params` parameters that decodes `generate` FLOPs
    and passes `compute` FLOPs over whole sequences (`graftlab.planning.work.Work`), at try `attempt`.
    `partitions` maps `cpu` / `gpu` to partition names; without it no `slurm_partition` is set.
    `gpu_memory_gb`: the memory of one of the cluster's GPUs."""
    gpu_memory_gb = gpu_memory(gpu_memory_gb)
    kind = classify(rule)
    grow = GROWTH ** (attempt - 1)
    gpus = 0
    host = HOST_BYTES_PER_PARAM.get(rule, 0)
    streamed = params * host / 50e6 / 60  # minutes of tensors streamed through host memory at ~50 MB/s
    if kind == "gpu":
        gpus = max(1, math.ceil(params * _gpu_bytes(rule) * HEADROOM / (gpu_memory_gb * 1e9)))
        mem_mb = BASE_MEM_MB + params * max(4, host) / 1e6
        runtime = SETUP_MIN + streamed + (generate / SAMPLE_FLOPS + compute / TRAIN_FLOPS) / gpus / 60
    else:
        mem_mb = CPU_MEM_MB.get(rule, BASE_MEM_MB) + params * host / 1e6
        runtime = SETUP_MIN + streamed
    out = {
        "gpu": gpus,
        "mem_mb": math.ceil(mem_mb * grow),
        "runtime": min(MAX_RUNTIME_MIN, math.ceil(runtime * grow)),
        "cpus_per_task": GPU_JOB_CPUS if gpus else 1,
        # Every job is one node's: a multi-GPU job starts its processes itself (accelerate, on a free port),
        # so SLURM must not spread its GPUs over nodes.
        "nodes": 1,
    }
    if partitions and partitions.get(kind):
        out["slurm_partition"] = partitions[kind]
    return out


def gpu_memory(value) -> float:
    """`value` as one GPU's memory in GB (a number, or a profile's text of one); an error unless positive."""
    try:
        gb = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        gb = math.nan
    if not (math.isfinite(gb) and gb > 0):
        raise ValueError(f"gpu_memory_gb must be a positive number of GB, got {value!r}")
    return gb


def _gpu_bytes(rule: str) -> int:
    if rule in SAMPLE:
        return GPU_BYTES_PER_PARAM["sample"]
    if rule in FISHER:
        return GPU_BYTES_PER_PARAM["fisher"]
    return GPU_BYTES_PER_PARAM["train_pair" if rule in TWO_MODELS else "train"]
