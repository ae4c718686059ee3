"""The cost of a run before its launch: jobs, GPU-hours and disk per rule, from the resolved config.

GPU time is FLOPs / (GPU peak FLOP/s x utilisation). A sampled or scored token costs 2 x params FLOPs
(one forward pass); a trained token 6 x params (forward and backward); a Fisher token also 6 x params,
since the per-example gradients are one backward pass each. Attention's own FLOPs are left out, which
undercounts long sequences. Sampling is charged at its whole budget (`max_new_tokens`) and at every
attempt, an upper bound: STaR and teacher traces stop at the first verified attempt.

Data set sizes are not known before the data is fetched and mined, so they are assumptions (the flags
of `graftlab plan`), printed beside the table. Standard library only: planning needs no torch.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from graftlab.layout import POST, Experiment, on_tiny_world, opsd_steps, shows_takeover, study_experiments, world_key
from graftlab.tasks import get_task

# The tiny world's character tokenizer: its specials plus its printable characters (graftlab.world.tokenizer).
WORLD_VOCAB = 84
FP32 = 4
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
MINED = ("expert", "teacher", "star", "pedagogical")


@dataclass(frozen=True)
class Assumptions:
    """What the config does not say: the GPU, and the sizes of data that exist only after fetching."""

    mfu: float = 0.3  # share of the GPU's peak FLOP/s a job reaches
    gpu_flops: float = 989e12  # an H100's dense bf16 peak
    prompt_tokens: int = 256  # tokens of a prompt before the generated ones
    problems: int = 1000  # candidate problems of a data set with no `limit`
    benchmark_problems: int = 100  # problems of an old-task benchmark with no `limit`
    kept: float = 0.5  # share of candidates that mining keeps as hard
    checkpoint_bytes: int = FP32  # the trainers keep and save fp32 weights
    jobs: int = 1  # jobs at once (Snakemake's --jobs): bounds the grafts on disk together


@dataclass
class Cost:
    """One rule's total: jobs, FLOPs, bytes written, and of those the bytes kept to the end of the run
    (temp() outputs are written but not kept)."""

    jobs: int = 0
    flops: float = 0.0
    written: float = 0.0
    kept: float = 0.0

    def add(self, jobs: int = 1, flops: float = 0.0, written: float = 0.0, kept: float | None = None) -> None:
        self.jobs += jobs
        self.flops += flops
        self.written += written
        self.kept += written if kept is None else kept


@dataclass
class Model:
    """A model's parameter count, the bytes a parameter takes as stored, and where the count came from."""

    params: float
    bytes_per_param: int
    source: str
    linears: list[tuple[int, int]] = field(default_factory=list)  # (in, out) of each linear layer, if known

    @property
    def bytes(self) -> float:
        return self.params * self.bytes_per_param


def qwen3_shapes(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, head_dim: int):
    """(in, out) of every linear layer of a Qwen3 decoder, and its parameters besides them (norms)."""
    per_layer = [
        (hidden, heads * head_dim),
        (hidden, kv_heads * head_dim),
        (hidden, kv_heads * head_dim),
        (heads * head_dim, hidden),
        (hidden, intermediate),
        (hidden, intermediate),
        (intermediate, hidden),
    ]
    norms = layers * (2 * hidden + 2 * head_dim) + hidden  # two RMSNorms, q/k norms; the final norm
    return per_layer * layers, norms


def qwen3_model(arch: dict, vocab: int, tied: bool, bytes_per_param: int, source: str) -> Model:
    """A Qwen3 architecture's parameter count: linear layers, norms, embeddings (twice unless tied)."""
    hidden, heads = arch["hidden_size"], arch["heads"]
    head_dim = arch.get("head_dim") or hidden // heads
    linears, norms = qwen3_shapes(hidden, arch["intermediate_size"], arch["layers"], heads, arch["kv_heads"], head_dim)
    embeddings = vocab * hidden * (1 if tied else 2)
    params = sum(i * o for i, o in linears) + norms + embeddings
    return Model(params, bytes_per_param, source, linears)


def _from_config_json(path: Path) -> Model:
    c = json.loads(path.read_text())
    arch = {
        "hidden_size": c["hidden_size"],
        "intermediate_size": c["intermediate_size"],
        "layers": c["num_hidden_layers"],
        "heads": c["num_attention_heads"],
        "kv_heads": c.get("num_key_value_heads", c["num_attention_heads"]),
        "head_dim": c.get("head_dim"),
    }
    dtype = DTYPE_BYTES.get(c.get("torch_dtype") or c.get("dtype") or "bfloat16", 2)
    tied = c.get("tie_word_embeddings", False)
    return qwen3_model(arch, c["vocab_size"], tied, dtype, f"{path} (Qwen3-style count)")


def size_in_name(name: str) -> float | None:
    """The parameter count a hub id states, e.g. `Qwen/Qwen3-8B` -> 8e9, `Qwen3-1.7B-Base` -> 1.7e9."""
    found = re.findall(r"(?<![A-Za-z0-9.])(\d+(?:\.\d+)?)([BM])(?![A-Za-z])", name.replace("/", " "))
    if not found:
        return None
    number, unit = found[-1]
    return float(number) * (1e9 if unit == "B" else 1e6)


def model_of(config: dict, layout: Experiment, name: str, root: Path = Path(".")) -> Model:
    """The model `name` (`post`, `step~N` or a name from `models`) of an experiment: from its fetched
    config.json when present, else its configured `params`, else the size in its hub id; the tiny
    world's from the world's architecture."""
    if name == POST:
        name = layout.x["post"]
    if name == POST or name.startswith("step~"):
        arch = layout.world["model"]
        return qwen3_model(arch, WORLD_VOCAB, True, FP32, "the tiny world's architecture")
    local = root / "resources" / "models" / name / "config.json"
    if local.is_file():
        return _from_config_json(local)
    source = config["models"][name]["source"]
    if (Path(source) / "config.json").is_file():
        return _from_config_json(Path(source) / "config.json")
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


def eval_sequences(layout: Experiment, a: Assumptions) -> int:
    """Answers one evaluation draws: each benchmark's problems times the samples its task draws (a
    greedy task, such as knowledge, answers once: `graftlab.tasks`)."""
    x, samples = layout.x, layout.x["eval"]["samples"]
    old = {n: _limit(s, a.benchmark_problems) for n, s in (x["benchmarks"] or {}).items()}
    old = old or dict.fromkeys(layout.world["old_tasks"], layout.world["benchmark_size"])
    k = x["knowledge"]
    new = k["facts"] * k["heldout_phrasings"] if x["data"] == "knowledge" else x["mining"]["heldout"]
    sizes = old | {layout.new_benchmark()[0]: new}
    tasks = {name: task for name, _, _, task in layout.eval_benchmarks()}
    return sum(n * (1 if get_task(tasks[name]).greedy else samples) for name, n in sizes.items())


def trace_tokens(x: dict) -> int:
    """Tokens of one SFT example's answer: the budget of the stage that wrote it (evaluation's otherwise)."""
    return x.get(x["data"], {}).get("max_new_tokens") or x["eval"]["max_new_tokens"]


def fisher_bytes(model: Model, kind: str, max_dim: int = 8192) -> float:
    """A Fisher file: fp32 diagonal; for kfac, per narrow enough linear layer both Kronecker factors and
    their eigenvectors (the rest diagonal). Without known layer shapes, the diagonal's size."""
    if kind == "diag" or not model.linears:
        return model.params * FP32
    factored = [(i, o) for i, o in model.linears if max(i, o) <= max_dim]
    rest = model.params - sum(i * o for i, o in factored)
    return FP32 * (rest + sum(2 * (i * i + o * o) + i + o for i, o in factored))


def _new_data(costs: dict, config: dict, layout: Experiment, a: Assumptions, root: Path) -> None:
    """Mining and the stage that writes the SFT data."""
    x, p = layout.x, a.prompt_tokens
    post = model_of(config, layout, POST, root).params
    train = sft_examples(layout, a)
    if x["data"] in MINED:
        m = x["mining"]
        costs["mine"].add(flops=2 * post * candidates(layout, a) * m["samples"] * (p + m["max_new_tokens"]))
    if x["data"] in ("expert", "knowledge"):
        costs[f"{x['data']}_traces" if x["data"] == "expert" else "knowledge"].add()
    elif x["data"] in ("teacher", "star"):
        s = x[x["data"]]
        sampler = model_of(config, layout, s["model"], root).params if x["data"] == "teacher" else post
        attempts = s["attempts"] + (s["rationalize_attempts"] if s.get("rationalize") else 0)
        rule = "teacher_traces" if x["data"] == "teacher" else "star"
        costs[rule].add(flops=2 * sampler * train * attempts * (p + s["max_new_tokens"]))
    elif x["data"] == "pedagogical":
        g = x["pedagogical"]
        # GRPO: each sample is generated (2P), trained on (6P) and, with a KL term, scored by the reference (2P).
        per_token = (8 + (2 if g["kl"] else 0)) * post
        samples = g["steps"] * g["prompts_per_step"] * g["group_size"]
        # The teacher's prompt also holds the reference solution.
        tokens = p + trace_tokens(x) + g["max_new_tokens"]
        costs["pedagogical_teacher"].add(flops=per_token * samples * tokens, written=post * a.checkpoint_bytes)
        costs["pedagogical_traces"].add(flops=2 * post * train * g["attempts"] * tokens)
    sources = (["problems"] if x["problems"] else []) + (["retention"] if x["fisher"]["prompts"] else [])
    costs["dataset"].add(jobs=len(sources) + len(x["benchmarks"] or {}))


def _training(costs: dict, config: dict, layout: Experiment, a: Assumptions, root: Path) -> None:
    """SFT of the post model and every donor (a checkpoint per epoch), and OPSD (one per checkpoint)."""
    x, p = layout.x, a.prompt_tokens
    tokens = sft_examples(layout, a) * (p + trace_tokens(x))
    for base in [POST, *x["donors"]]:
        model = model_of(config, layout, base, root)
        for _ in x["sft"]["lr"]:
            epochs = x["sft"]["epochs"]
            costs["sft"].add(
                flops=6 * model.params * epochs * tokens, written=epochs * model.params * a.checkpoint_bytes
            )
    o = x["opsd"]
    post = model_of(config, layout, POST, root).params
    sampled = p + o["max_new_tokens"]
    # Per sample: the student generates (2P), the teacher scores it with the demonstration in its
    # prompt (2P), the student trains on it (6P).
    per_sample = 2 * post * sampled + 2 * post * (sampled + trace_tokens(x)) + 6 * post * sampled
    for _ in range(len(o["alpha"]) * len(o["lr"])):
        costs["opsd"].add(
            flops=o["steps"] * o["batch_size"] * per_sample,
            written=len(opsd_steps(o)) * post * a.checkpoint_bytes,
        )


def _fisher_and_grafts(costs: dict, config: dict, layout: Experiment, a: Assumptions, root: Path) -> list[float]:
    """Rollouts, the Fisher of each kind in use, and the grafts; returns each graft's size in bytes."""
    x, p = layout.x, a.prompt_tokens
    post = model_of(config, layout, POST, root)
    f = x["fisher"]
    tokens = f["rollouts"] * (p + f["max_new_tokens"])
    costs["rollouts"].add(flops=2 * post.params * tokens)
    grafts = [r for r in layout.run_list() if r.kind == "graft"]
    # The sensitivity analysis always ranks by the diagonal Fisher; masks may add kfac.
    kinds = sorted({"diag"} | {r.keys["mask"] for r in grafts} - {"none"})
    for kind in kinds:
        passes = 2 if kind == "kfac" and f["ekfac"] else 1
        costs["fisher"].add(flops=passes * 6 * post.params * tokens, written=fisher_bytes(post, kind))
    for _ in grafts:
        costs["graft"].add(written=post.bytes, kept=0)  # temp(): deleted once evaluated
    return [post.bytes] * len(grafts)


def _evaluation(costs: dict, config: dict, layout: Experiment, a: Assumptions, root: Path) -> None:
    x = layout.x
    e = x["eval"]
    tokens = eval_sequences(layout, a) * (a.prompt_tokens + e["max_new_tokens"])
    for r in layout.run_list():
        base = r.donor if r.kind in ("donor", "sft") and r.donor else POST
        costs["evaluate"].add(flops=2 * model_of(config, layout, base, root).params * tokens)
    costs["sensitivity_update"].add(jobs=len(layout.sensitivity_runs()))
    for rule in ("summary", "pareto", "latency", "sensitivity"):
        costs[rule].add()


def _world(costs: dict, world: dict, uses: list[dict]) -> None:
    """The tiny world's jobs, for the parts its experiments use: pretraining (the ladder) and
    post-training when one runs on its models, its benchmarks, its mining candidates."""
    models = any(x["post"] == POST or any(d.startswith("step~") for d in x["donors"]) for x in uses)
    benchmarks = models or any(not x["benchmarks"] or x["data"] == "knowledge" for x in uses)
    if benchmarks:
        costs["world_benchmarks"].add(jobs=len(world["old_tasks"]))
    if any(x["data"] in MINED and not x["problems"] for x in uses):
        costs["world_candidates"].add()
    if not models:
        return
    model = qwen3_model(world["model"], WORLD_VOCAB, True, FP32, "")
    pre, post = world["pretrain"], world["posttrain"]
    block = world["corpus"]["block"]
    costs["world_tokenizer"].add()
    costs["world_corpus"].add()
    # Written: the initialisation and each ladder checkpoint; then the post model.
    costs["world_pretrain"].add(
        flops=6 * model.params * pre["steps"] * pre["batch_size"] * block,
        written=(1 + len(pre["ladder"])) * model.bytes,
    )
    examples = post["examples_per_task"] * len(world["old_tasks"]) * post["epochs"]
    costs["world_posttrain"].add(flops=6 * model.params * examples * block, written=model.bytes)


def _analysis(costs: dict, config: dict) -> None:
    for x in config["experiments"].values():
        if on_tiny_world(x):
            costs["drift"].add()
        if shows_takeover(x):
            costs["takeover"].add()
    if study_experiments(config):
        costs["study"].add()
    costs["moe"].add()
    costs["all"].add()


@dataclass
class Plan:
    """Per rule its Cost, the assumptions, notes on where figures came from, and the disk peak."""

    costs: dict[str, Cost]
    assumptions: Assumptions
    notes: list[str]
    temp_peak: float

    @property
    def total(self) -> Cost:
        return Cost(*(sum(getattr(c, f) for c in self.costs.values()) for f in ("jobs", "flops", "written", "kept")))

    def gpu_hours(self, cost: Cost) -> float:
        return cost.flops / (self.assumptions.gpu_flops * self.assumptions.mfu) / 3600

    @property
    def peak_disk(self) -> float:
        """Everything kept to the end (checkpoints, Fishers, fetched models) plus the temp() grafts on
        disk together at the worst moment."""
        return self.total.kept + self.temp_peak


def _fetched(config: dict, layout: Experiment) -> set[str]:
    x = layout.x
    named = {x["post"], *x["donors"]} | ({x["teacher"]["model"]} if x["data"] == "teacher" else set())
    return {n for n in named if n in config["models"]}


def estimate(config: dict, a: Assumptions = Assumptions(), root: Path = Path(".")) -> Plan:
    """The plan of a resolved config (graftlab.config.resolve): each rule's jobs, FLOPs and bytes.

    Peak disk assumes Snakemake deletes a temp() graft once its evaluation and sensitivity jobs are done
    and runs those as soon as the graft exists: then at most `a.jobs` grafts are being written and as
    many await evaluation. A scheduler that writes every graft first would need all of them at once.
    """
    costs = _Costs()
    grafts: list[float] = []
    fetched: set[str] = set()
    for name in config["experiments"]:
        layout = Experiment.of(config, name)
        for stage in (_new_data, _training, _evaluation):
            stage(costs, config, layout, a, root)
        grafts += _fisher_and_grafts(costs, config, layout, a, root)
        fetched |= _fetched(config, layout)
    notes = []
    for name in sorted(fetched):
        layout = next(Experiment.of(config, e) for e in config["experiments"])
        model = model_of(config, layout, name, root)
        costs["fetch_model"].add(written=model.bytes)
        notes.append(f"{name}: {model.params / 1e9:.3g}B parameters, from {model.source}")
    by_world: dict[str, list[dict]] = {}
    for x in config["experiments"].values():
        by_world.setdefault(world_key(x), []).append(x)
    worlds = {"world": config["world"], **{f"worlds/{n}": w for n, w in config["worlds"].items()}}
    for key, uses in by_world.items():
        _world(costs, worlds[key], uses)
    _analysis(costs, config)
    temp_peak = sum(sorted(grafts, reverse=True)[: 2 * a.jobs])
    return Plan({r: c for r, c in costs.items() if c.jobs}, a, notes, temp_peak)


class _Costs(dict):
    def __missing__(self, rule: str) -> Cost:
        self[rule] = Cost()
        return self[rule]


# Pipeline order for the table; a rule not listed here goes last.
ORDER = (
    "fetch_model world_tokenizer world_corpus world_pretrain world_posttrain world_benchmarks world_candidates "
    "dataset mine expert_traces knowledge teacher_traces star pedagogical_teacher pedagogical_traces sft opsd "
    "rollouts fisher graft evaluate sensitivity_update summary pareto latency sensitivity drift takeover study moe all"
).split()
GB = 1e9


def _hours(h: float) -> str:
    return f"{h:.3g}" if h >= 0.001 or h == 0 else "<0.001"


def render(plan: Plan) -> str:
    """The plan as Markdown: a row per rule, the totals, the disk peak and what it assumed."""
    a = plan.assumptions
    rules = sorted(plan.costs, key=lambda r: (ORDER.index(r) if r in ORDER else len(ORDER), r))
    lines = ["| rule | jobs | GPU-hours | disk written (GB) |", "|---|---:|---:|---:|"]
    for rule in rules:
        c = plan.costs[rule]
        lines.append(f"| {rule} | {c.jobs} | {_hours(plan.gpu_hours(c))} | {c.written / GB:.3g} |")
    t = plan.total
    lines.append(f"| **total** | **{t.jobs}** | **{_hours(plan.gpu_hours(t))}** | **{t.written / GB:.3g}** |")
    lines += [
        "",
        f"Peak disk: {plan.peak_disk / GB:.3g} GB = {t.kept / GB:.3g} GB kept to the end (checkpoints, Fishers, "
        f"fetched models) + {plan.temp_peak / GB:.3g} GB of temporary grafts (at most {2 * a.jobs} at once: "
        f"{a.jobs} being written and {a.jobs} awaiting evaluation, at --jobs {a.jobs}).",
        "",
        f"Assumed: {a.gpu_flops:.3g} FLOP/s per GPU at {a.mfu:g} utilisation; 2 x params FLOPs per sampled "
        f"token, 6 x params per trained or Fisher token; every sample uses its whole max_new_tokens; prompts of "
        f"{a.prompt_tokens} tokens; {a.problems} candidate problems and {a.benchmark_problems} per benchmark "
        f"where a data set sets no limit; mining keeps {a.kept:g} of them; checkpoints of "
        f"{a.checkpoint_bytes} bytes per parameter. CPU rules count at the same rate.",
    ]
    lines += [f"- {note}" for note in plan.notes]
    return "\n".join(lines)


def dag_jobs(snakemake_args: list[str]) -> dict[str, int]:
    """Jobs per rule of Snakemake's own dry-run of the whole workflow (`--forceall`), with the user's args."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "snakemake", "-n", "--forceall", "--quiet", "rules", "--cores", "1", *snakemake_args],
        capture_output=True,
        text=True,
    )
    if out.returncode:
        raise RuntimeError(f"snakemake dry-run failed: {' '.join((out.stdout + out.stderr).split()[-60:])}")
    stats = out.stdout.split("Job stats:")[-1]
    found = re.findall(r"^(\w+)\s+(\d+)$", stats, flags=re.M)
    return {rule: int(n) for rule, n in found if rule != "total"}


def load_config(configfiles: list[str], overrides: list[str], root: Path = Path(".")) -> dict:
    """The config Snakemake would run with, resolved: the config files merged in order, then the
    `--config` overrides; config.yaml only when neither is given, as rules/common.smk loads it."""
    from snakemake.cli import parse_config
    from snakemake.common.configfile import load_configfile
    from snakemake.utils import update_config

    from graftlab.config import resolve

    config: dict = {}
    for path in configfiles:
        update_config(config, load_configfile(path))
    update_config(config, parse_config(overrides))
    if not config:
        config = load_configfile(str(root / "config.yaml"))
    return resolve(config)
