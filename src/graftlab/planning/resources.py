"""What each job asks its scheduler for: GPUs, host memory, runtime, CPUs and partition, from the model's
size and the job's work, so a real model gets real limits and the tiny world keeps small ones.

Standard library only: the workflow imports it while it parses. The figures are upper bounds, sized so a
first attempt rarely fails; each retry (`attempt` > 1) grows memory and runtime by `GROWTH`.

- GPUs: the job's memory, part by part (`graftlab.memory`, from its `graftlab.planning.work.Work`):
  the fewest GPUs of `gpu_memory_gb` (`GPU_MEMORY_GB` unless the cluster profile states its own) on which
  each GPU's share fits and over which its batch divides. Only the parts its code shards are divided
  (FSDP's in SFT, GRPO, OPSD, SDPO and the Fishers; a tensor-parallel engine's). A job that fits no count
  asks for one GPU, and `misfit` says why in one line. Where the job cannot shard (a sampling engine, the
  Pedagogical RL teacher) the workflow refuses it while it builds the DAG and `graftlab plan` refuses the
  run; a sharded one is warned about and listed, as smaller micro-batches may still fit it.
- Host memory: a GPU job passes one fp32 copy of the model through host memory while it loads and
  saves (4 bytes per parameter), a sharded job one a process (each loads the whole model before FSDP
  shards it); a graft holds the post model, a delta, the Fisher and the result in
  fp32 at once (16 bytes); a sensitivity update the Fisher and two streamed models (8 bytes).
- Runtime: the job's work (`graftlab.planning.work`, the count the cost plan uses too): decoding at
  `SAMPLE_FLOPS` or, where slower, reading its KV cache at `SAMPLE_BANDWIDTH`, and whole-sequence passes
  at `TRAIN_FLOPS`, per GPU it shards over, plus `SETUP_MIN`; capped at `MAX_RUNTIME_MIN`, beyond which a
  trainer resumes after SLURM requeues it. A sampling job that one engine would take beyond its limit runs
  as many engines at once as bring it within, a node's GPUs at most (`graftlab.sample_chunks.DataParallel`);
  an evaluation or graft that a node's engines would still take beyond it is named with the count of part
  jobs (`eval.parts`, each sampling a share of every call at once on a node of its own) that brings each
  within it (`sampling_parts`).
  Every rate is 2.5x below `graftlab plan`'s default estimate
  (0.1 and 0.3 of an H100's bf16 peak, half its memory bandwidth), so a first attempt rarely runs out of
  time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from graftlab import memory
from graftlab.memory import Memory, Shape
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
    "evaluate_part",  # a part of an evaluation's sampling (`PARTS`)
    "evaluate_run_part",
    "graft_part",
    "graft_screen",  # an adaptive sweep's first pass over a graft (rules/graft.smk)
    "evaluate_run_screen",  # ... and over a training run's checkpoints (rules/evaluate.smk)
)
FISHER = ("fisher", "chain_fisher")
GPU_KINDS = TRAIN + SAMPLE + FISHER
# Host-memory bytes per parameter of the CPU rules that hold whole models.
# A graft streams its three inputs through host memory (graftlab.graft), on a GPU node too.
HOST_BYTES_PER_PARAM = {"graft": 16, "graft_screen": 16, "chain_graft": 16, "sensitivity_update": 8}
CPU_MEM_MB = {"dataset": 8000, "fetch_model": 4000}
CPU_KINDS = (
    "all",
    "chain_graft",
    "continual",
    "param_drift",
    "stage_drift",
    "screen",
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

# Trainers holding a second model beside the one they train: a frozen or moving teacher, Pedagogical RL's student.
TWO_MODELS = ("pedagogical_teacher", *(m.rule for m in on_policy() if m.spec.models == 2))
# Trainers whose code shards the trained model over several GPUs: SFT (FSDP through accelerate), GRPO (TRL's
# trainer, the same way) and our own on-policy loops (graftlab.train.shard).
SHARDED = ("sft", *dict.fromkeys(m.rule for m in on_policy() if m.spec.shards))
# Our own loops: sharded, they still resume, gathering a whole state from their shards.
OWN_LOOPS = tuple(dict.fromkeys(m.rule for m in on_policy() if m.spec.resumes_sharded))
# Jobs that save their state and continue after SLURM requeues them at their time limit: trainers on one GPU
# (graftlab.train.resume; our loops on any count), and sampling jobs, which keep their finished chunks
# (graftlab.sample_chunks).
RESUMES = ("pedagogical_teacher", *trained_rules())
CHUNKED = ("mine", "star", "stage_star", "teacher_traces", "pedagogical_traces", "rollouts", "chain_rollouts")
# A graft's store outlives its scratch model: it is made anew. Every chunked job's sampling also splits over
# engines sampling at once (graftlab.sample_chunks.DataParallel).
CHUNKED += ("evaluate", "evaluate_run", "graft")
# Jobs whose sampling splits over several jobs, and the rule of their parts (rules/evaluate.smk, graft.smk):
# an evaluation's calls depend on no earlier result, so each part can take every n-th chunk of each.
PARTS = {"evaluate": "evaluate_part", "evaluate_run": "evaluate_run_part", "graft": "graft_part"}
MOST_PARTS = 64
# Tokens of the one sequence a job is sized for when its work gives no memory (a bare call, the tiny world).
NOMINAL_TOKENS = 2048
GPU_MEMORY_GB = 80  # an A100/H100 80 GB; a smaller card needs more GPUs than this asks for
GPUS_PER_NODE = 8  # the most one job may ask for: every job is one node's
SAMPLE_FLOPS = 40e12  # decoding is memory-bound: about a tenth of an H100's bf16 peak
# Bytes a second of KV cache a long decode reads: a fifth of an H100's 3.35 TB/s, 2.5x below the plan's half
# (`graftlab.planning.plan.Assumptions.kv_utilisation`), as the FLOP rates are.
SAMPLE_BANDWIDTH = 0.2 * 3.35e12
TRAIN_FLOPS = 120e12  # about 30% of the bf16 peak
CPU_FLOPS = 5e9  # float64 decompositions on a CPU job's few cores (torch's SVD, 2 threads: 4-6e9 measured)
SETUP_MIN = 10  # loading the model, compiling the engine, writing the results
MAX_RUNTIME_MIN = 48 * 60
GROWTH = 1.5
# Grafted models on disk at once (each graft sweep's job holds one at a time, rules/graft.smk) unless a profile
# or the command line gives `--resources temp_grafts=N`; `graftlab plan --temp-grafts N` prices the disk a cap needs.
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


@dataclass(frozen=True)
class Cluster:
    """The cluster's shape, as the SLURM profile's `default-resources` state it (profiles/slurm/config.yaml;
    a profile cannot template per rule, so the GPU rules read the `gpu_*` keys here and ask for them)."""

    slurm_partition: str | None = None  # every job's default: a CPU partition
    gpu_partition: str | None = None  # the GPU rules'
    gpu_memory_gb: float = GPU_MEMORY_GB  # one GPU's memory
    gpus_per_node: int = GPUS_PER_NODE  # the most GPUs one job may take
    cpu_max_runtime: int = MAX_RUNTIME_MIN  # minutes: each partition's time limit
    gpu_max_runtime: int = MAX_RUNTIME_MIN
    # The GPU rules' GPU model (the SLURM plugin's `gpu_model`: `--gpus=MODEL:N`). Named apart from the
    # plugin's key: a profile's default-resources reach every job, and a CPU job given a model asks for a GPU.
    gpu_type: str | None = None
    gpu_constraint: str | None = None  # the GPU rules' `--constraint`
    gpu_qos: str | None = None  # the GPU rules' `--qos`

    @classmethod
    def of(cls, given: dict) -> Cluster:
        """From a profile's default-resources (values as text or numbers; keys it does not state keep their
        defaults); a ValueError names a key whose value is not of its kind."""
        values = {}
        for f in fields(cls):
            if given.get(f.name) is None:
                continue
            raw = given[f.name]
            if f.name == "gpu_memory_gb":
                values[f.name] = gpu_memory(raw)
            elif f.type == "int":
                values[f.name] = _whole(f.name, raw)
            else:
                values[f.name] = str(raw)
        return cls(**values)

    def partition(self, kind: str) -> str | None:
        return self.gpu_partition if kind == "gpu" else self.slurm_partition


def _whole(key: str, raw) -> int:
    try:
        value = int(str(raw)) if not isinstance(raw, bool) else 0
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{key} must be a whole number >= 1, got {raw!r}")
    return value


def job_resources(
    rule: str,
    params: float = TINY_PARAMS,
    *,
    generate: float = 0.0,
    kv_read: float = 0.0,
    compute: float = 0.0,
    memory: Memory | None = None,
    batch: int | None = None,
    host: float = 0.0,
    streams: int = 1,
    attempt: int = 1,
    cluster: Cluster = Cluster(),
    capped: bool = True,
    part_of: int = 1,
) -> dict:
    """The resources of one job of `rule` by a model of `params` parameters that decodes `generate` FLOPs
    reading `kv_read` bytes of KV cache, and passes `compute` FLOPs over whole sequences, holds `memory` on
    its GPUs and takes `batch` examples a step (`graftlab.planning.work.Work`; without `memory`,
    `nominal_memory`), and a CPU job `host` bytes of host memory beyond its base and `compute` FLOPs at
    `CPU_FLOPS`, streaming `streams` models through host memory one after another (`HOST_BYTES_PER_PARAM`
    each: a sweep's grafts), at try `attempt`, on `cluster` (its partitions, GPU size and count a node, time
    limits, and the GPU rules' model, constraint and QoS, each set only where the cluster names one). Not `capped`:
    its runtime as estimated, beyond its partition's limit. `part_of`: the job decodes one of that many
    parts of it (`sampling_parts`)."""
    gpu_memory_gb = cluster.gpu_memory_gb
    generate, kv_read = generate / part_of, kv_read / part_of
    kind = classify(rule)
    limit = cluster.gpu_max_runtime if kind == "gpu" else cluster.cpu_max_runtime
    grow = GROWTH ** (attempt - 1)
    gpus = 0
    host_bytes = HOST_BYTES_PER_PARAM.get(rule, 0)
    # Minutes of tensors streamed through host memory at ~50 MB/s, model after model.
    streamed = streams * params * host_bytes / 50e6 / 60
    if kind == "gpu":
        need = memory or nominal_memory(rule, params)
        # A job no count holds asks for one GPU: more would sit idle (`misfit` says why it will not fit).
        gpus = need.gpus(gpu_memory_gb * 1e9, batch, most=cluster.gpus_per_node) or 1
        # A sharded job's GPUs each run a process: each loads the whole model in fp32 before FSDP shards it
        # (commands/fsdp.yaml: fsdp_cpu_ram_efficient_loading off), and each does its share of the work.
        processes = gpus if need.sharded else 1
        decode = max(generate / SAMPLE_FLOPS, kv_read / SAMPLE_BANDWIDTH)  # whichever bounds it
        work = (decode + compute / TRAIN_FLOPS) / 60
        room = cluster.gpu_max_runtime - SETUP_MIN - streamed
        if rule in CHUNKED and work > room > 0:
            # A sampling job one engine would take longer than its limit over runs as many engines at once as
            # bring it within (graftlab.sample_chunks.DataParallel), each on its own GPUs, a node's at most.
            processes = min(cluster.gpus_per_node // gpus, math.ceil(work / room))
            gpus *= processes
        mem_mb = BASE_MEM_MB + params * max(4 * processes, host_bytes) / 1e6
        runtime = SETUP_MIN + streamed + work / processes
    else:
        mem_mb = CPU_MEM_MB.get(rule, BASE_MEM_MB) + params * host_bytes / 1e6 + host / 1e6
        runtime = SETUP_MIN + streamed + compute / CPU_FLOPS / 60
    out = {
        "gpu": gpus,
        "mem_mb": math.ceil(mem_mb * grow),
        "runtime": min(limit if capped else math.inf, math.ceil(runtime * grow)),
        "cpus_per_task": GPU_JOB_CPUS if gpus else 1,
        # Every job is one node's: a multi-GPU job starts its processes itself (accelerate, on a free port),
        # so SLURM must not spread its GPUs over nodes.
        "nodes": 1,
    }
    if cluster.partition(kind):
        out["slurm_partition"] = cluster.partition(kind)
    if kind == "gpu":
        plugin_keys = {"gpu_model": cluster.gpu_type, "constraint": cluster.gpu_constraint, "qos": cluster.gpu_qos}
        out |= {key: value for key, value in plugin_keys.items() if value is not None}
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


def sampling_parts(rule: str, cluster: Cluster = Cluster(), **sizes) -> int | None:
    """The fewest jobs a job of `rule` (sized by `sizes`, as `job_resources` takes them) can be split into
    (`PARTS`, the config's `eval.parts`) whose parts, each with a node's engines, sample within the GPU
    partition's time limit; 1 for a rule that does not split; None where `MOST_PARTS` would not do."""
    if rule not in PARTS:
        return 1
    for parts in range(1, MOST_PARTS + 1):
        part = job_resources(rule, **sizes, cluster=cluster, capped=False, part_of=parts)
        if part["runtime"] <= cluster.gpu_max_runtime:
            return parts
    return None


def overtime(rule: str, cluster: Cluster = Cluster(), attempts: int = 1, **sizes) -> str | None:
    """Why a job of `rule` (sized by `sizes`, as `job_resources` takes them) will time out, in one line; None
    when it fits its partition's time limit. A job that resumes (its saved state or finished chunks) continues
    on each of its `attempts` (Snakemake's retries + 1), so it times out only beyond that many limits. SFT
    and GRPO resume on one GPU only: over several, their processes save no resume state."""
    cap = cluster.gpu_max_runtime if classify(rule) == "gpu" else cluster.cpu_max_runtime
    job = job_resources(rule, **sizes, cluster=cluster, capped=False)
    resumes = rule in CHUNKED + OWN_LOOPS or (rule in RESUMES and job["gpu"] <= 1)
    hours = f"{rule}: needs about {job['runtime'] / 60:,.0f} hours, more than its partition's {cap / 60:g}"
    if job["runtime"] <= cap or (resumes and job["runtime"] <= cap * attempts):
        return None
    if rule in PARTS and sizes.get("part_of", 1) == 1 and (parts := sampling_parts(rule, cluster, **sizes)):
        return f"{hours}: split its sampling over {parts} jobs at once (eval.parts: {parts}), or raise retries"
    if resumes:
        return f"{hours} x {attempts} attempts (Snakemake's retries + 1), each continuing the last: raise retries"
    why = "runs over several GPUs, where it saves no resume state" if rule in RESUMES else "does not resume"
    return f"{hours}, and {why}"


def nominal_memory(rule: str, params: float) -> Memory:
    """A job's memory from its kind and size alone: one `NOMINAL_TOKENS` sequence, the shape assumed from
    `params` (`Shape.of_params`)."""
    shape = Shape.of_params(params)
    if rule in SAMPLE:
        return memory.sampler(params, shape, tokens=NOMINAL_TOKENS)
    if rule in FISHER:
        return memory.fisher(params, shape, rollouts=1, sequence=NOMINAL_TOKENS)
    scorers = 1 if rule in TWO_MODELS else 0
    return memory.trainer(params, shape, tokens=NOMINAL_TOKENS, recompute=True, scorers=scorers, shards=rule in SHARDED)


def misfit(rule: str, need: Memory, cluster: Cluster = Cluster(), batch: int | None = None) -> str | None:
    """Why no count of the cluster's GPUs (up to a node's) holds a job of `rule`, in one line; None when one does."""
    gpu_memory_gb = cluster.gpu_memory_gb
    if need.gpus(gpu_memory_gb * 1e9, batch, most=cluster.gpus_per_node) is not None:
        return None
    share = f"{memory.GPU_SHARE:.0%} of a {gpu_memory_gb:g} GB GPU"
    if need.spans > 1:
        return f"{rule}: {need.describe(need.spans)} does not fit {share}: raise vllm.tensor_parallel_size"
    if not need.sharded:
        return (
            f"{rule}: needs {need.describe()}, more than {share}, and cannot shard over GPUs; "
            "set gpu_memory_gb to larger GPUs, or use a smaller model or shorter sequences"
        )
    most, parts = cluster.gpus_per_node, need.describe()
    return f"{rule}: no count of up to {most} GPUs dividing its batch of {batch} holds it within {share}: {parts}"
