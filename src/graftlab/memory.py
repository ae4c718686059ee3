"""The GPU memory of one job, part by part: one model for the GPUs a job asks its scheduler for
(`graftlab.planning.resources`) and for a trainer's `auto` micro-batch (`graftlab.train.precision.micro_batch`).

Parts, in bytes (P parameters; a token is one position of one sequence of a micro-batch):

- a trained model: fp32 master weights, fp32 gradients and AdamW's two fp32 moments, `TRAINED_BYTES` = 16
  per parameter (bf16 autocast computes in bf16 but keeps all four in fp32), and on a GPU the optimizer
  step's temporaries, one more fp32 copy (torch's AdamW works on whole lists of tensors there: measured on
  an H200, benchmarks/README.md);
- a model that only scores (OPSD's and SDPO's teacher, GRPO's reference with beta > 0, the Fisher's model):
  its weights in the dtype it is loaded in (a frozen teacher of our own loops in bf16, else fp32);
- activations, per token and layer, what autograd keeps of a Qwen3-style layer with a fused attention
  kernel, at 16 bits: 2 bytes per unit of 8 hidden-wide tensors (the two norms' inputs, the q/k/v and
  output projections' inputs, q, the attention output), 3 KV-wide ones (k, v, k's norm input) and 4
  intermediate-wide ones (the SwiGLU's gate, its SiLU, up and their product): 16 h + 6 kv + 8 i bytes
  (Korthikanti et al. 2022 count 34 h for a GPT layer with dropout); twice that in fp32. With recomputation
  each layer keeps only its input (2 h) and one layer at a time holds its whole set. Plus the logits,
  `LOGIT_BYTES` per vocabulary entry at 16 bits (the logits, their fp32 copy in the loss, its log-softmax
  and gradient: 2 + 4 + 4 + 4 + 2), 20 in fp32;
- a sampling engine: its weights (bf16 on a GPU: 2 per parameter) and the KV cache of the longest
  sequence it must hold, 2 (K and V) x layers x kv heads x head dim x 2 bytes a token;
- a Fisher: its model's fp32 weights and an fp32 accumulator (8 per parameter), the activations of one
  batch, recomputed layer by layer (graftlab.fisher.backward), the per-rollout gradients of its
  widest weight, at most a chunk (`CHUNK_FLOATS`), and for KFAC its Kronecker factors
  and their eigenvectors (`graftlab.planning.work.kfac_factor_bytes`).

`benchmarks/memory_bench.py` measures each job kind's peak against this (benchmarks/README.md, "Memory").
Standard library only: the workflow imports it while it parses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

TRAINED_BYTES = 16
LOGIT_BYTES = 16
FP32, BF16 = 4, 2
CHUNK_FLOATS = 2**25  # the Fisher's per-rollout gradients are formed this many floats at a time (graftlab.fisher)
CHUNK_BYTES = CHUNK_FLOATS * FP32
# The share of a GPU a job's parts may fill: CUDA's context, its kernels' workspace and the allocator's
# fragmentation take the rest.
GPU_SHARE = 0.85


@dataclass(frozen=True)
class Shape:
    """What a decoder's activations and KV cache scale with."""

    layers: int
    hidden: int
    intermediate: int
    kv_heads: int
    head_dim: int
    vocab: int
    assumed: bool = False  # from the parameter count alone, not a config.json

    @classmethod
    def of_config(cls, c: dict) -> Shape:
        """From a HF config.json's fields (a multimodal model's `text_config`)."""
        c = c.get("text_config", c)
        heads = c["num_attention_heads"]
        return cls(
            layers=c["num_hidden_layers"],
            hidden=c["hidden_size"],
            intermediate=c.get("moe_intermediate_size") or c["intermediate_size"],
            kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            vocab=c["vocab_size"],
        )

    @classmethod
    def of_params(cls, params: float) -> Shape:
        """A dense decoder of `params` parameters in today's proportions, for a model known by its size
        alone: hidden about 100 x layers (params ~ 12 layers hidden^2), KV heads a quarter of the hidden
        width in heads of 128, an MLP 3 x as wide, a 152k vocabulary (Qwen3's). Qwen3-8B is 36 x 4096, this
        gives 40 x 4000."""
        layers = max(1, round((params / 1.2e5) ** (1 / 3)))
        hidden = max(128, round(100 * layers))
        return cls(layers, hidden, 3 * hidden, max(1, hidden // 4 // 128), 128, 151_936, assumed=True)

    def layer_bytes(self, dtype_bytes: int = BF16) -> int:
        """Activation bytes a layer keeps per token for its backward pass (the module docstring's count)."""
        return (16 * self.hidden + 6 * self.kv_heads * self.head_dim + 8 * self.intermediate) * dtype_bytes // BF16

    def kv_bytes(self, dtype_bytes: int = BF16) -> int:
        """KV cache bytes per token."""
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes


@dataclass(frozen=True)
class Memory:
    """A job's GPU memory by part, in bytes; `sharded`: the parts its code divides over its GPUs (FSDP's
    weights, gradients and optimizer state, a tensor-parallel engine's weights and KV cache); every other
    part each GPU holds whole."""

    parts: dict[str, float]
    sharded: frozenset[str] = field(default_factory=frozenset)
    spans: int = 1  # GPUs its code always spans (a vLLM engine's tensor parallelism); 1: as many as it needs

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    def per_gpu(self, gpus: int) -> float:
        return sum(v / gpus if k in self.sharded else v for k, v in self.parts.items())

    def gpus(self, gpu_bytes: float, batch: int | None = None, most: int = 64) -> int | None:
        """The fewest GPUs on which every GPU's share fits `GPU_SHARE` of `gpu_bytes`, and over which
        `batch` (examples of one optimizer step, each process taking an equal part) divides; None when no
        count up to `most` does (a job whose code cannot shard fits one GPU or none)."""
        if self.spans > 1:
            counts = (self.spans,) if self.spans <= most else ()
        else:
            counts = range(1, most + 1) if self.sharded else (1,)
        for n in counts:
            if (batch is None or batch % n == 0) and self.per_gpu(n) <= GPU_SHARE * gpu_bytes:
                return n
        return None

    def describe(self, gpus: int = 1) -> str:
        parts = ", ".join(f"{k} {gb(v / gpus if k in self.sharded else v)}" for k, v in self.parts.items())
        return f"{gb(self.per_gpu(gpus))} a GPU on {gpus} ({parts})"


def gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def activations(shape: Shape, tokens: float, *, act_bytes: int = BF16, recompute: bool = False) -> float:
    """Activation bytes of `tokens` positions of a micro-batch through the model and its loss."""
    per_layer = shape.layer_bytes(act_bytes)
    layers = shape.layers * shape.hidden * act_bytes + per_layer if recompute else shape.layers * per_layer
    logits = shape.vocab * (LOGIT_BYTES + 2 * (act_bytes - BF16))
    return tokens * (layers + logits)


def trainer(
    params: float,
    shape: Shape,
    *,
    tokens: float,
    act_bytes: int = BF16,
    recompute: bool = False,
    scorers: int = 0,
    scorer_bytes: int = FP32,
    engine_tokens: float = 0,
    engine_bytes: int = BF16,
    shards: bool = False,
    step_copy: bool = True,
) -> Memory:
    """A trainer of `params` parameters: the trained model, `scorers` models that only score beside it,
    one micro-batch of `tokens` positions and, with `engine_tokens`, a colocated sampling engine holding
    that many tokens of KV cache. `shards`: its code divides the trained and scoring models over its GPUs (FSDP);
    `step_copy`: the optimizer step's fp32 temporaries (a GPU's; a CPU's AdamW steps tensor by tensor)."""
    parts = {"trained model": params * TRAINED_BYTES}
    if step_copy:
        parts["optimizer step"] = params * FP32
    if scorers:
        parts["scoring models"] = scorers * params * scorer_bytes
    parts["activations"] = activations(shape, tokens, act_bytes=act_bytes, recompute=recompute)
    if engine_tokens:
        parts["sampling engine"] = params * engine_bytes + engine_tokens * shape.kv_bytes(engine_bytes)
    return Memory(parts, frozenset({"trained model", "optimizer step", "scoring models"}) if shards else frozenset())


def sampler(params: float, shape: Shape, *, tokens: float, weight_bytes: int = BF16) -> Memory:
    """A sampling engine: its weights and the KV cache of `tokens` positions (at least its longest sequence)."""
    return Memory({"weights": params * weight_bytes, "KV cache": tokens * shape.kv_bytes(weight_bytes)})


def fisher(
    params: float,
    shape: Shape,
    *,
    rollouts: int,
    sequence: int,
    factors: float = 0.0,
    act_bytes: int = FP32,
    recompute: bool = False,
    shards: bool = False,
) -> Memory:
    """A retention Fisher over a batch of `rollouts` of `sequence` tokens: fp32 weights and accumulator, the
    batch's activations (`recompute`: each layer's input and one layer's set, as both Fishers keep them;
    else every layer's), the per-rollout gradients of its widest weight (at most a chunk) and KFAC's
    `factors` bytes. `shards`: the weights, accumulator and factors divided over its GPUs (its processes each
    running every rollout)."""
    widest = max(shape.hidden * shape.intermediate, shape.vocab * shape.hidden)
    parts = {
        "weights and accumulator": params * 2 * FP32,
        "activations": activations(shape, rollouts * sequence, act_bytes=act_bytes, recompute=recompute),
        "per-rollout gradients": min(CHUNK_BYTES, rollouts * widest * FP32),
    }
    if factors:
        parts["KFAC factors"] = factors
    return Memory(parts, frozenset({"weights and accumulator", "KFAC factors"}) if shards else frozenset())


def largest_divisor(batch: int, most: float) -> int:
    """The largest divisor of `batch` that is at most `most` (at least 1)."""
    most = max(1, math.floor(most))
    return max(d for d in range(1, batch + 1) if batch % d == 0 and d <= most)
