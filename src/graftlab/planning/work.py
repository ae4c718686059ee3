"""The work of one job, from the resolved config: the model it loads, its FLOPs and the bytes it writes.

One model serves both the scheduler's limits (`graftlab.planning.resources`) and the cost plan before a launch
(`graftlab.planning.plan`), so a job's SLURM runtime and its share of the plan's GPU-hours follow from the same
count. FLOPs come in two kinds, since they run at different speeds: `generate`, decoding token by token
(memory-bound), and `compute`, forward or backward passes over whole sequences (compute-bound).

A generated or scored token costs 2 x params FLOPs (one forward pass); a trained token 6 x params
(forward and backward); a Fisher token also 6 x params, since per-example gradients are one backward
pass each. Attention's own FLOPs are left out, which undercounts long sequences. Decoding is also counted
in bytes of KV cache read (`decoding`): each new token reads the cache of every token before it, which
bounds a long reasoning decode more than its FLOPs do. An evaluation's answer to a benchmark is charged its
mean length where it is known (`response_tokens`: configured, or measured by a finished evaluation); every
other sample its whole budget (`max_new_tokens`) and at every attempt, an upper bound: STaR and teacher
traces stop at the first verified attempt.

Data set sizes are not known before the data is fetched and mined, so they are `Assumptions`. Standard
library only: the workflow imports this while it parses.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from graftlab import memory
from graftlab.memory import Memory, Shape
from graftlab.methods import METHODS, on_policy
from graftlab.planning.chains import KNOWLEDGE, Chain
from graftlab.planning.layout import (
    POST,
    SWEEP,
    Experiment,
    fisher_options,
    kept_steps,
    parse_run,
    world_checkpoint,
)
from graftlab.tasks import get_task

# The tiny world's character tokenizer: its specials plus its printable characters (graftlab.world.tokenizer).
WORLD_VOCAB = 84
FP32 = 4
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
# The on-policy methods by the rule that trains them (sdpo_cot's is sdpo's, sized alike).
TRAINED_BY = {m.rule: m for m in on_policy()}


@dataclass(frozen=True)
class Assumptions:
    """What the config does not say: the sizes of data that exist only after fetching and mining."""

    prompt_tokens: int = 512  # a competition problem in its chat template; the tiny world's are far shorter
    problems: int = 10_000  # candidate problems of a data set with no `limit` (MATH's training split has 7,500)
    benchmark_problems: int = 500  # an old-task benchmark with no `limit`: MATH-500's size
    kept: float = 0.5  # share of candidates that mining keeps as hard
    checkpoint_bytes: int = FP32  # the trainers keep and save fp32 weights
    # Share of an adaptive sweep's grafts (`eval.adaptive`) its screening keeps for full scoring: all, as the
    # default world's sweeps did (benchmarks/README.md, "Adaptive sweeps"); a sweep's own share is known once
    # it is screened.
    adaptive_kept: float = 1.0


@dataclass
class Model:
    """A model's parameter count, the bytes a parameter takes as stored, and where the count came from."""

    params: float
    bytes_per_param: int
    source: str
    # (in, out) of each linear layer, if known, grouped by the input they read (q/k/v one, gate/up another):
    # KFAC stores one A factor a group.
    groups: list[list[tuple[int, int]]] = field(default_factory=list)
    known_shape: Shape | None = None  # from its config.json

    @property
    def bytes(self) -> float:
        return self.params * self.bytes_per_param

    @property
    def linears(self) -> list[tuple[int, int]]:
        return [linear for group in self.groups for linear in group]

    @property
    def shape(self) -> Shape:
        """Its layers, width, KV heads and vocabulary: from its config, else assumed from its size."""
        return self.known_shape or Shape.of_params(self.params)


@dataclass(frozen=True)
class Work:
    """One job: its model, its FLOPs of each kind, and the bytes it writes (`kept`: of those, the bytes
    kept to the end of the run; temp() outputs are written but not kept)."""

    model: Model
    generate: float = 0.0
    compute: float = 0.0
    written: float = 0.0
    kept: float | None = None
    memory: Memory | None = None  # on one GPU, part by part (graftlab.memory); None: a CPU job
    kv_read: float = 0.0  # bytes of KV cache its decoding reads (`decoding`)
    batch: int | None = None  # examples of one optimizer step: a data-parallel job's GPUs must divide it
    host: float = 0.0  # a CPU job's peak host memory beyond its base, in bytes, where its work sets it
    # Models the job makes by streaming tensors through host memory, one after another (a sweep's grafts:
    # `graftlab.planning.resources.HOST_BYTES_PER_PARAM` each), for its runtime.
    streams: int = 1


def decoder_model(c: dict, bytes_per_param: int, source: str) -> Model:
    """A decoder-only transformer from its HF config.json fields (dense or mixture-of-experts): every
    linear layer's shape, its norms (two per layer, q/k norms, the final one) and its embeddings."""
    c = c.get("text_config", c)
    hidden, layers, heads = c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"]
    head_dim = c.get("head_dim") or hidden // heads
    kv = c.get("num_key_value_heads") or heads
    qkv = [(hidden, heads * head_dim), (hidden, kv * head_dim), (hidden, kv * head_dim)]
    experts = c.get("num_experts") or c.get("num_local_experts") or 0
    inter = c.get("moe_intermediate_size", c["intermediate_size"]) if experts else c["intermediate_size"]
    # An MLP's gate and up read one input, its down another; each expert reads its own tokens.
    mlps = [[(hidden, inter), (hidden, inter)], [(inter, hidden)]] * max(1, experts)
    router = [[(hidden, experts)]] if experts else []
    groups = [qkv, [(heads * head_dim, hidden)], *mlps, *router] * layers
    linears = [linear for group in groups for linear in group]
    norms = layers * (2 * hidden + 2 * head_dim) + hidden
    embeddings = c["vocab_size"] * hidden * (1 if c.get("tie_word_embeddings") else 2)
    params = sum(i * o for i, o in linears) + norms + embeddings
    return Model(params, bytes_per_param, source, groups, Shape.of_config(c))


def world_model(world: dict) -> Model:
    """The tiny world's models: its architecture with the character vocabulary, tied, in fp32."""
    arch = world["model"]
    c = {
        "hidden_size": arch["hidden_size"],
        "intermediate_size": arch["intermediate_size"],
        "num_hidden_layers": arch["layers"],
        "num_attention_heads": arch["heads"],
        "num_key_value_heads": arch["kv_heads"],
        "head_dim": arch.get("head_dim"),
        "vocab_size": WORLD_VOCAB,
        "tie_word_embeddings": True,
    }
    return decoder_model(c, FP32, "the tiny world's architecture")


def from_config_json(path: Path) -> Model:
    c = json.loads(path.read_text())
    dtype = DTYPE_BYTES.get(c.get("torch_dtype") or c.get("dtype") or "bfloat16", 2)
    return decoder_model(c, dtype, str(path))


def size_in_name(name: str) -> float | None:
    """The parameter count a hub id states, e.g. `Qwen/Qwen3-8B` -> 8e9, `Qwen3-1.7B-Base` -> 1.7e9."""
    found = re.findall(r"(?<![A-Za-z0-9.])(\d+(?:\.\d+)?)([BM])(?![A-Za-z])", name.replace("/", " "))
    if not found:
        return None
    number, unit = found[-1]
    return float(number) * (1e9 if unit == "B" else 1e6)


def model_of(config: dict, layout: Experiment, name: str, root: Path = Path(".")) -> Model:
    """The model `name` (`post`, a world checkpoint `step~N` or `post~N`, or a name from `models`) of an
    experiment: from its fetched config.json when present, else its configured `params`, else the size in
    its hub id; the tiny world's from the world's architecture."""
    if name == POST:
        name = layout.x["post"]
    if name == POST or world_checkpoint(name):
        return world_model(layout.world)
    local = root / layout.model_dir(name) / "config.json"
    if local.is_file():
        return from_config_json(local)
    source = config["models"][name]["source"]
    if (Path(source) / "config.json").is_file():
        return from_config_json(Path(source) / "config.json")
    if stated := config["models"][name].get("params"):
        return Model(stated, 2, f"models.{name}.params, bf16 assumed (not fetched yet)")
    params = size_in_name(source)
    if params is None:
        raise ValueError(f"model {name!r} ({source}): no config.json fetched and no size such as 8B in its name")
    return Model(params, 2, f"the size in its hub id {source!r}, bf16 assumed (not fetched yet)")


def _limit(source: dict | None, default: int) -> int:
    return (source or {}).get("limit") or default


def candidates(layout: Experiment, a: Assumptions) -> int:
    """Problems mining samples: the data set's `limit` (else an assumption), or the world's candidates."""
    x = layout.x
    return _limit(x["problems"], a.problems) if x["problems"] else layout.world["candidates"]


def sft_examples(layout: Experiment, a: Assumptions) -> int:
    """Examples SFT trains on: every mined training problem (an upper bound where verification drops
    some), or the knowledge setting's training phrasings plus its replay."""
    x = layout.x
    if x["data"] == "knowledge":
        k = x["knowledge"]
        return k["facts"] * k["train_phrasings"] + k["replay"]
    return max(0, round(candidates(layout, a) * a.kept) - x["mining"]["heldout"])


def eval_answers(layout: Experiment, a: Assumptions) -> dict[str, int]:
    """Answers one evaluation draws, by benchmark: its problems times the samples its task draws (a greedy
    task, such as knowledge, answers once: `graftlab.tasks`)."""
    x, samples = layout.x, layout.x["eval"]["samples"]
    old = {n: _limit(s, a.benchmark_problems) for n, s in (x["benchmarks"] or {}).items()}
    old = old or dict.fromkeys(layout.world["old_tasks"], layout.world["benchmark_size"])
    k = x["knowledge"]
    new = k["facts"] * k["heldout_phrasings"] if x["data"] == "knowledge" else x["mining"]["heldout"]
    sizes = old | {layout.new_benchmark()[0]: new}
    tasks = {name: task for name, _, _, task in layout.eval_benchmarks()}
    return {name: n * (1 if get_task(tasks[name]).greedy else samples) for name, n in sizes.items()}


def decoding(model: Model, answers: float, prompt: float, new: float) -> dict[str, float]:
    """The `generate` FLOPs and `kv_read` bytes of decoding `answers` answers of `new` tokens after `prompt`
    tokens each: 2 x params FLOPs a token (the prompt's prefill counted alike), and each new token reads the
    KV cache of every token before it, prompt x new + new^2 / 2 token-reads an answer of `Shape.kv_bytes`."""
    return {
        "generate": 2 * model.params * answers * (prompt + new),
        "kv_read": answers * model.shape.kv_bytes() * (prompt * new + new * new / 2),
    }


def screened(layout, root: Path) -> dict[tuple[str, ...] | str, tuple[int, int]]:
    """(kept, screened) of each sweep (by its `SWEEP` values) and each screened training run (by its key:
    `Experiment.screened_trainruns`) that its experiment's finished screening has decided whole
    (`results/{exp}/screen/decisions.json` under `root`: graftlab.analysis.screen); one it has not (a sweep
    screened before it grew), or no such file, is left out."""
    try:
        decided = json.loads((root / layout.root / "screen" / "decisions.json").read_text())
    except (OSError, ValueError):
        return {}
    groups: dict[tuple[str, ...] | str, list[str]] = {s: [r.key for r in rs] for s, rs in layout.sweep_runs().items()}
    groups |= layout.screened_checkpoints()
    out = {}
    for group, runs in groups.items():
        kept = [d.get("kept") if isinstance(d := decided.get(run), dict) else None for run in runs]
        if all(isinstance(k, bool) for k in kept):
            out[group] = sum(kept), len(kept)
    return out


def sampled(layout, root: Path) -> dict[tuple[str, ...], tuple[int, int]]:
    """(kept, grafts) of each sweep (by its `SWEEP` values): its grafts whose samples an earlier job of the
    sweep kept under `root` (a chunk store under `resume/`: graftlab.sample_chunks), which a job of the sweep
    grown by a lam reads back instead of sampling, their inputs and the sampling code being unchanged."""
    from graftlab.train.resume import resume_dir

    def kept(run) -> bool:
        return any((root / resume_dir(f"{layout.root}/eval/{run.key}/metrics.json")).glob("*-*.json"))

    return {sweep: (sum(map(kept, runs)), len(runs)) for sweep, runs in layout.sweep_runs().items()}


def response_tokens(layout, name: str, bound: int, root: Path) -> float:
    """Tokens a model's answer to benchmark `name` takes on average: its data set's `response_tokens`, else
    the mean the experiment's finished evaluation of the post model measured (`response_tokens` in its
    metrics.json under `root`), else the whole `bound` (max_new_tokens, an upper bound). At most `bound`."""
    sources = dict(layout.x["benchmarks"] or {})  # the old benchmarks, then a continual stage's by its domain
    sources |= {stage["domain"]: stage["benchmark"] for stage in layout.x["stages"] if stage["benchmark"]}
    configured = (sources.get(name) or {}).get("response_tokens")
    if configured is None:
        try:
            metrics = json.loads((root / layout.root / "eval" / POST / "metrics.json").read_text())
            configured = metrics["benchmarks"][name]["response_tokens"]
        except (OSError, ValueError, KeyError, TypeError):
            return bound
    return min(float(configured), bound)


# Bytes a sampled token takes in a kept sample store: a completion's text in JSON (graftlab.sample_chunks),
# about 4 characters a token for a BPE vocabulary on English and mathematics.
SAMPLE_BYTES_PER_TOKEN = 4


def answer_lengths(layout, answers: dict[str, int], root: Path) -> dict[str, float]:
    """Tokens an answer to each benchmark of `answers` takes: its `response_tokens`, at most max_new_tokens."""
    bound = layout.x["eval"]["max_new_tokens"]
    return {b: response_tokens(layout, b, bound, root) for b in answers}


def sample_bytes(layout, answers: dict[str, float], root: Path) -> float:
    """The bytes of the samples kept for `answers` (by benchmark), each as long as `answer_lengths` says."""
    lengths = answer_lengths(layout, answers, root)
    return SAMPLE_BYTES_PER_TOKEN * sum(n * lengths[b] for b, n in answers.items())


def eval_decoding(model: Model, layout, answers: dict[str, int], a: Assumptions, root: Path) -> dict[str, float]:
    """`decoding` of an evaluation drawing `answers` by benchmark, each at its `response_tokens`."""
    lengths = answer_lengths(layout, answers, root)
    parts = [decoding(model, n, a.prompt_tokens, lengths[b]) for b, n in answers.items()]
    return {key: sum(part[key] for part in parts) for key in ("generate", "kv_read")}


# Tokens of a knowledge example's answer: a short value after an empty think block, or a replayed tiny-world
# trace (graftlab.world.knowledge; at most 57 ASCII characters over every task, so at most as many tokens
# under any tokenizer: tests/test_work.py generates the world and checks).
KNOWLEDGE_TRACE_TOKENS = 64


def trace_tokens(x: dict) -> int:
    """Tokens of one SFT example's answer: the budget of the stage that wrote it (evaluation's otherwise);
    a knowledge example's, its bound."""
    if x["data"] == "knowledge":
        return KNOWLEDGE_TRACE_TOKENS
    return x.get(x["data"], {}).get("max_new_tokens") or x["eval"]["max_new_tokens"]


def fisher_bytes(model: Model, kind: str, max_dim: int = 8192) -> float:
    """A Fisher file: fp32 diagonal; for kfac, per narrow enough linear layer both Kronecker factors and
    their eigenvectors (the rest diagonal). Without known layer shapes, the diagonal's size."""
    if kind == "diag" or not model.linears:
        return model.params * FP32
    factored = _factored(model, max_dim)
    rest = model.params - sum(i * o for i, o in factored)
    return FP32 * rest + kfac_factor_bytes(model, max_dim)


def kfac_factor_bytes(model: Model, max_dim: int = 8192) -> float:
    """KFAC's Kronecker factors and their eigenvectors and eigenvalues, in fp32: a G for every linear layer no
    wider than `max_dim`, an A for each input such layers read (graftlab.fisher.kfac stores a shared A once)."""
    total = 0
    for group in model.groups:
        factored = [(i, o) for i, o in group if max(i, o) <= max_dim]
        total += sum(2 * o * o + o for _, o in factored)
        total += 2 * factored[0][0] ** 2 + factored[0][0] if factored else 0
    return FP32 * total


def _factored(model: Model, max_dim: int) -> list[tuple[int, int]]:
    return [(i, o) for i, o in model.linears if max(i, o) <= max_dim]


def world_work(rule: str, world: dict) -> Work:
    """The tiny world's training: pretraining writes its initialisation and each ladder checkpoint."""
    model = world_model(world)
    block = world["corpus"]["block"]
    if rule == "world_pretrain":
        pre = world["pretrain"]
        flops = 6 * model.params * pre["steps"] * pre["batch_size"] * block
        return Work(model, compute=flops, written=(1 + len(pre["ladder"])) * model.bytes)
    if rule == "world_posttrain":
        post = world["posttrain"]
        examples = post["examples_per_task"] * len(world["old_tasks"]) * post["epochs"]
        written = (1 + len(post["ladder"])) * model.bytes  # the post model and its kept checkpoints
        return Work(model, compute=6 * model.params * examples * block, written=written)
    return Work(model)


def sft_work(config: dict, model: Model, x: dict, examples: int, a: Assumptions) -> Work:
    """SFT of `model` on `examples` traces for `x`'s epochs: 6 x params per token, a checkpoint per epoch;
    its trained model sharded over its GPUs (FSDP), each process taking an equal share of the batch."""
    epochs, sequence = x["sft"]["epochs"], a.prompt_tokens + trace_tokens(x)
    flops = 6 * model.params * epochs * examples * sequence
    mem = trainer_memory(config, model, x["sft"], sequence, engine=False, shards=True)
    written = epochs * model.params * a.checkpoint_bytes
    return Work(model, compute=flops, written=written, memory=mem, batch=x["sft"]["batch_size"])


def _engine_tokens(config: dict, sequence: int) -> int:
    """KV-cache tokens a vLLM engine holds: `vllm.max_model_len`, else the sequence rounded up to a power of
    two, as the engine sizes itself (`graftlab.sampling`); none where transformers samples."""
    if config.get("sampling_backend", "auto") == "transformers":
        return 0
    return (config.get("vllm") or {}).get("max_model_len") or 1 << max(0, sequence - 1).bit_length()


def sampler_memory(config: dict, model: Model, sequence: int) -> Memory:
    """A sampling job: the engine's bf16 weights and the KV cache of its longest sequence, spread over
    `vllm.tensor_parallel_size` GPUs (transformers' generate: one sequence's KV cache beside the weights)."""
    tp = (config.get("vllm") or {}).get("tensor_parallel_size", 1)
    mem = memory.sampler(model.params, model.shape, tokens=_engine_tokens(config, sequence) or sequence)
    return replace(mem, sharded=frozenset(mem.parts), spans=tp) if tp > 1 else mem


def trainer_memory(
    config: dict,
    model: Model,
    section: dict,
    sequence: int,
    *,
    scorers: int = 0,
    scorer_bytes: int = FP32,
    engine: bool = True,
    shards=False,
) -> Memory:
    """A trainer on a GPU: bf16 autocast over fp32 weights, recomputation unless the config turns it off,
    one micro-batch (`auto`: the smallest, one sequence, since the trainer fits the largest that fits),
    `scorers` models beside it of `scorer_bytes` a parameter and, where it samples with vLLM, its colocated
    engine; `shards`: the trained and scoring models divided over its GPUs."""
    micro = section.get("micro_batch_size", "auto")
    return memory.trainer(
        model.params,
        model.shape,
        tokens=(1 if micro == "auto" else micro) * sequence,
        recompute=config.get("gradient_checkpointing", "auto") is not False,
        scorers=scorers,
        scorer_bytes=scorer_bytes,
        engine_tokens=_engine_tokens(config, sequence) if engine else 0,
        shards=shards,
    )


def job_work(
    rule: str, config: dict, layout: Experiment, wildcards: dict, a: Assumptions = Assumptions(), root: Path = Path(".")
) -> Work:
    """One job of an experiment's `rule`, its wildcards (`donor` of sft, `mask` of fisher, `run` of
    evaluate) as the workflow names them."""
    x, p = layout.x, a.prompt_tokens
    post = model_of(config, layout, POST, root)
    P = post.params
    train = sft_examples(layout, a)
    if rule == "mine":
        m = x["mining"]
        decoded = decoding(post, candidates(layout, a) * m["samples"], p, m["max_new_tokens"])
        return Work(post, **decoded, memory=sampler_memory(config, post, p + m["max_new_tokens"]))
    if rule in ("teacher_traces", "star"):
        s = x["teacher" if rule == "teacher_traces" else "star"]
        sampler = model_of(config, layout, s["model"], root) if rule == "teacher_traces" else post
        attempts = s["attempts"] + (s["rationalize_attempts"] if s.get("rationalize") else 0)
        decoded = decoding(sampler, train * attempts, p, s["max_new_tokens"])
        return Work(sampler, **decoded, memory=sampler_memory(config, sampler, p + s["max_new_tokens"]))
    if rule in ("pedagogical_teacher", "pedagogical_traces"):
        g = x["pedagogical"]
        prompt = p + trace_tokens(x)  # the teacher's prompt holds the reference solution
        tokens = prompt + g["max_new_tokens"]
        if rule == "pedagogical_traces":
            decoded = decoding(post, train * g["attempts"], prompt, g["max_new_tokens"])
            return Work(post, **decoded, memory=sampler_memory(config, post, tokens))
        # GRPO: each sample is generated (2P), trained on (6P) and, with a KL term, scored by the reference (2P).
        samples = g["steps"] * g["prompts_per_step"] * g["group_size"]
        per_token = (6 + (2 if g["kl"] else 0)) * P
        # Beside the teacher it trains: the frozen student whose surprise it is rewarded by, and the reference.
        mem = trainer_memory(config, post, g, tokens, scorers=1 + (1 if g["kl"] else 0))
        batch = g["prompts_per_step"] * g["group_size"]
        written = P * a.checkpoint_bytes
        decoded = decoding(post, samples, prompt, g["max_new_tokens"])
        return Work(post, **decoded, compute=per_token * samples * tokens, written=written, memory=mem, batch=batch)
    if rule == "sft":
        return sft_work(config, model_of(config, layout, wildcards.get("donor", POST), root), x, train, a)
    if (method := TRAINED_BY.get(rule)) is not None:
        s = x[method.section]
        generate, compute = method.spec.flops(s, P, p, trace_tokens(x))
        spec = method.spec
        mem = trainer_memory(
            config,
            post,
            s,
            p + s["max_new_tokens"],
            scorers=spec.scorers(s),
            scorer_bytes=spec.scorer_bytes(s),
            shards=spec.shards,
        )
        written = len(kept_steps(s)) * P * a.checkpoint_bytes
        kv_read = decoding(post, spec.counts(s)[0], p, s["max_new_tokens"])["kv_read"]  # every answer it samples
        return Work(post, generate, compute, written, memory=mem, batch=spec.split(s), kv_read=kv_read)
    if rule in ("rollouts", "fisher"):
        f = x["fisher"]
        tokens = f["rollouts"] * (p + f["max_new_tokens"])
        if rule == "rollouts":
            decoded = decoding(post, f["rollouts"], p, f["max_new_tokens"])
            return Work(post, **decoded, memory=sampler_memory(config, post, p + f["max_new_tokens"]))
        # A retention home's Fisher names its options (`fisher_name`); a chain's takes the experiment's.
        kind, options = (
            fisher_options(wildcards["fisher"])
            if "fisher" in wildcards
            else (wildcards.get("kind", "diag"), {"ekfac": f["ekfac"]})
        )
        passes = 2 if kind == "kfac" and options["ekfac"] else 1
        factors = kfac_factor_bytes(post) if kind == "kfac" else 0
        # One rollout a pass at the least (on a GPU the Fisher takes as many of `batch_size` as fit:
        # graftlab.fisher.diag.fitting_batch); both kinds recompute each layer in their backward
        # (graftlab.fisher.backward) and shard over GPUs.
        sequence = p + f["max_new_tokens"]
        mem = memory.fisher(P, post.shape, rollouts=1, sequence=sequence, factors=factors, recompute=True, shards=True)
        return Work(post, compute=passes * 6 * P * tokens, written=fisher_bytes(post, kind), memory=mem)
    if rule == "evaluate":
        run = parse_run(wildcards.get("run", POST))
        # A donor and its SFT are the donor's size; everything else (a graft too) is the post model's.
        base = run["donor"] if run["donor"] and not METHODS[run["method"]].grafts else POST
        model = model_of(config, layout, base, root)
        decoded = eval_decoding(model, layout, eval_answers(layout, a), a, root)
        return Work(model, **decoded, memory=sampler_memory(config, model, p + x["eval"]["max_new_tokens"]))
    if rule in ("evaluate_run", "evaluate_run_screen"):  # each kept checkpoint of the run, one after another
        key = wildcards["trainrun"]
        checkpoints = layout.checkpointed()[key]
        # Its screening (`eval.adaptive_checkpoints`) scores the `eval.adaptive` share of the problems alone.
        n = len(checkpoints) * (x["eval"]["adaptive"] if rule == "evaluate_run_screen" else 1)
        one = job_work("evaluate", config, layout, {"run": f"{key}/{checkpoints[0]}"}, a, root)
        job = replace(one, generate=n * one.generate, kv_read=n * one.kv_read)
        if rule == "evaluate_run" and key in layout.screened_trainruns():  # its samples kept (evaluate.py)
            samples = sample_bytes(layout, {b: c * n for b, c in eval_answers(layout, a).items()}, root)
            job = replace(job, written=samples, kept=samples)
        return job
    if rule in ("graft", "graft_screen"):  # a sweep: each graft made in the job's scratch, evaluated, deleted
        # An adaptive sweep's first pass scores its share of the problems alone (graftlab.analysis.screen).
        share = x["eval"]["adaptive"] if rule == "graft_screen" else 1.0
        grafts = len(layout.sweeps()[tuple(str(wildcards[k]) for k in SWEEP)])
        answers = {b: n * share * grafts for b, n in eval_answers(layout, a).items()}
        decoded = eval_decoding(post, layout, answers, a, root)
        engine = sampler_memory(config, post, p + x["eval"]["max_new_tokens"])
        samples = 0.0
        if rule == "graft":  # its grafts' samples are kept, for a job of the sweep grown by a lam (graft.py)
            samples = sample_bytes(layout, answers, root)
        written = grafts * post.bytes + samples
        return Work(post, **decoded, written=written, kept=samples, memory=engine, streams=grafts)
    if rule == "fetch_model":
        model = model_of(config, layout, wildcards["name"], root)
        return Work(model, written=model.bytes)
    return Work(post)


# The rules of a continual experiment (rules/continual.smk) are sized as the single-domain rule each one
# runs (chain_sft as `sft`, chain_rollouts as `rollouts`, ...), on the stage it trains in
# (`graftlab.planning.chains.Continual.stage_view`); evaluate and response_kl score every stage's benchmark.
def continual_work(
    rule: str, config: dict, layout, wildcards: dict, a: Assumptions = Assumptions(), root: Path = Path(".")
) -> Work:
    """One job of a continual experiment, `layout` a `graftlab.planning.chains.Continual`, `rule` the name it is
    sized as (`sized(...)` in rules/continual.smk) and `wildcards` the job's."""
    if rule == "evaluate":
        return continual_eval_work(config, layout, a, root)
    if rule == "response_kl":
        return response_kl_work(config, layout, a, root)
    if rule == "stage_drift":
        pairs = layout.stage_drift_pairs(wildcards["chain"], int(wildcards["k"]))
        return param_drift_work(config, layout, len(pairs), root)
    if "k" not in wildcards:  # the stage-1 retention Fisher of the post model, data sets, tables
        return job_work(rule, config, layout.stage_view(1), wildcards, a, root)
    k = int(wildcards["k"])
    # A chain's retention Fisher after stage k is read by its graft at stage k+1.
    view = layout.stage_view(min(k + 1 if rule in ("rollouts", "fisher") else k, len(layout.stages)))
    if rule == "sft":  # a merge chain's SFT (chain_merge_sft) names no donor: it tunes a model of post's size
        model = model_of(config, view, wildcards.get("donor", POST), root)
        return sft_work(config, model, view.x, stage_examples(layout, k, a), a)
    if rule == "chain_graft":
        post = model_of(config, view, POST, root)
        return Work(post, written=post.bytes)  # kept: the chain's next stage starts from it
    if rule == "star":  # a `data: star` stage: the post model samples its training problems
        s, post = view.x["star"], model_of(config, view, POST, root)
        attempts = s["attempts"] + (s["rationalize_attempts"] if s["rationalize"] else 0)
        decoded = decoding(post, stage_examples(layout, k, a) * attempts, a.prompt_tokens, s["max_new_tokens"])
        return Work(post, **decoded, memory=sampler_memory(config, post, a.prompt_tokens + s["max_new_tokens"]))
    job = job_work(rule, config, view, wildcards, a, root)
    if (method := TRAINED_BY.get(rule)) is not None:
        kind = wildcards[method.chain_wildcard] if method.chain_wildcard else method.name
        chain = Chain(kind, POST, {k: wildcards[k] for k in METHODS[kind].spec.keys})
        if layout.keeps_teacher(chain):  # a stage writes its moving teacher for the next (SDPO's EMA)
            return replace(job, written=job.written + job.model.params * a.checkpoint_bytes)
    return job


def stage_examples(layout, k: int, a: Assumptions) -> int:
    """Examples SFT trains on in stage k (`graftlab.synth.stage_data`): a knowledge stage's training phrasings
    plus its replay; else the stage's `train` problems, at most what its data set holds after the held-out ones."""
    stage = layout.stage(k)
    if stage["domain"] == KNOWLEDGE:
        knowledge = stage["knowledge"]
        return knowledge["facts"] * knowledge["train_phrasings"] + knowledge["replay"]
    if not stage["problems"]:
        return stage["train"]
    held = 0 if stage["benchmark"] else stage["heldout"]
    return max(0, min(stage["train"], _limit(stage["problems"], a.problems) - held))


def continual_benchmarks(layout, a: Assumptions) -> list[tuple[str, int, str]]:
    """(name, problems, task) of every benchmark a continual model is scored on: the old ones, then each
    stage's (a knowledge stage's held-out phrasings, its benchmark data set, or its held-out problems)."""
    x, world = layout.x, layout.world
    old = [
        (n, _limit(x["benchmarks"][n], a.benchmark_problems) if x["benchmarks"] else world["benchmark_size"], task)
        for n, (_, task) in layout.old_benchmarks().items()
    ]
    new = []
    for k, stage in enumerate(layout.stages, 1):
        if stage["domain"] == KNOWLEDGE:
            problems = stage["knowledge"]["facts"] * stage["knowledge"]["heldout_phrasings"]
        else:
            problems = _limit(stage["benchmark"], a.benchmark_problems) if stage["benchmark"] else stage["heldout"]
        name, _, task = layout.stage_benchmark(k)
        new.append((name, problems, task))
    return old + new


def continual_eval_work(config: dict, layout, a: Assumptions, root: Path = Path(".")) -> Work:
    """An evaluation on the old benchmarks and every stage's: each one's problems times the samples its task
    draws (one answer for a greedy task)."""
    post = model_of(config, layout.stage_view(1), POST, root)
    x, samples = layout.x, layout.x["eval"]["samples"]
    answers = {name: n * (1 if get_task(task).greedy else samples) for name, n, task in continual_benchmarks(layout, a)}
    decoded = eval_decoding(post, layout, answers, a, root)
    return Work(post, **decoded, memory=sampler_memory(config, post, a.prompt_tokens + x["eval"]["max_new_tokens"]))


def param_drift_work(config: dict, layout, pairs: int, root: Path = Path(".")) -> Work:
    """Parameter drift (`graftlab.analysis.param_drift`) of `pairs` drift pairs (rule stage_drift: a chain's
    model after a stage): each weight matrix of both models decomposed in float64, a thin SVD of an m x n
    matrix (m >= n) about 6 m n^2 FLOPs, one matrix at a time: its peak is the widest matrix's two copies,
    two U factors and their work space, about 6 float64 copies of it."""
    post = model_of(config, layout.stage_view(1), POST, root)
    shape = post.shape
    matrices = post.linears or [(shape.hidden, shape.intermediate)] * 3 * shape.layers
    matrices = [*matrices, (shape.vocab, shape.hidden)]  # the embedding (and an untied head, as large)
    svd = sum(6 * max(m, n) * min(m, n) ** 2 for m, n in matrices)
    return Work(post, compute=2 * svd * pairs, host=6 * 8 * max(m * n for m, n in matrices))


def response_kl_work(config: dict, layout, a: Assumptions, root: Path = Path(".")) -> Work:
    """Response drift and KL (`graftlab.analysis.continual_probes`) over every chain's model after every stage.
    Drift: the post model embeds the first `response_prompts` answers of each benchmark of the post model and
    of each model (2P per token). KL both ways: each model samples `kl_samples` answers to the first
    `kl_prompts` problems of its stage's benchmark (2P per token, decoded), scored by itself and by the post
    model (2 x 2P); the post model samples as many once a stage, each scored by it and by every model of
    the stage (2 x 2P a model)."""
    post = model_of(config, layout.stage_view(1), POST, root)
    c, P = layout.x["continual"], post.params
    tokens = a.prompt_tokens + layout.x["eval"]["max_new_tokens"]
    chains, benchmarks = len(layout.chains()), continual_benchmarks(layout, a)
    models = chains * len(layout.stages)  # every chain's model after every stage
    embedded = (models + 1) * sum(min(c["response_prompts"], n) for _, n, _ in benchmarks)
    new = benchmarks[len(benchmarks) - len(layout.stages) :]  # each stage's, whose models sample on it
    post_sampled = c["kl_samples"] * sum(min(c["kl_prompts"], n) for _, n, _ in new)
    sampled = chains * post_sampled
    compute = 2 * P * (embedded + 2 * sampled + 2 * chains * post_sampled) * tokens
    decoded = decoding(post, sampled + post_sampled, a.prompt_tokens, layout.x["eval"]["max_new_tokens"])
    return Work(post, **decoded, compute=compute, memory=sampler_memory(config, post, tokens))
