"""The cost of a run before its launch: jobs, GPU-hours and disk per rule, from the resolved config.

Each job's work (its model, FLOPs and bytes written) comes from `graftlab.planning.work`, the same count the
scheduler's limits are sized from (`graftlab.planning.resources`). GPU time is FLOPs / (GPU peak FLOP/s x
utilisation), with decoding at a lower utilisation than whole-sequence passes, since it is memory-bound.
Data set sizes are assumptions (the flags of `graftlab plan`), printed beside the table. A continual
experiment's jobs come from its chains (`graftlab.planning.chains`, `continual_jobs`), each sized as the rule it runs
(`SIZED_AS`). Standard library only: planning needs no torch.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from graftlab.memory import Memory
from graftlab.methods import METHODS
from graftlab.planning import work
from graftlab.planning.chains import (
    GRAFT_FORMS,
    MERGE_CHAIN,
    ON_POLICY,
    Chain,
    Continual,
    is_continual,
    parse_chain,
    stage_data_kind,
)
from graftlab.planning.layout import (
    EVALUATE_RUN,
    MINED,
    POST,
    SOURCES_DIR,
    SWEEP,
    TRAINED_KINDS,
    Experiment,
    checkpoint_rule,
    shared_evaluations,
    source_file,
    source_id,
    study_experiments,
    sweep_rule,
    world_checkpoint,
    world_key,
)
from graftlab.planning.resources import GPU_MEMORY_GB, PARTS, TEMP_GRAFTS, Cluster, misfit
from graftlab.planning.work import Work


@dataclass(frozen=True)
class Assumptions(work.Assumptions):
    """The data sizes of `graftlab.planning.work.Assumptions`, and the GPU the run is costed on."""

    mfu: float = 0.3  # share of the GPU's peak FLOP/s a whole-sequence pass reaches
    decode_mfu: float = 0.1  # share that decoding reaches: it is bound by memory bandwidth
    gpu_flops: float = 989e12  # an H100's dense bf16 peak
    gpu_bandwidth: float = 3.35e12  # an H100 SXM's HBM3, bytes a second
    # Share of it a long decode's KV-cache reads reach: about 3k tokens/s per GPU for Qwen3-1.7B at 8k-token
    # answers (issue 31's figure: 2.5-3.5k), each token reading some 530 MB of cache.
    kv_utilisation: float = 0.5
    gpu_memory_gb: float = GPU_MEMORY_GB  # one GPU's memory, as the cluster profile's gpu_memory_gb
    jobs: int = 1  # jobs at once (Snakemake's --jobs)
    temp_grafts: int = TEMP_GRAFTS  # grafts on disk at once (`--resources temp_grafts=N`)


@dataclass
class Cost:
    """One rule's total: jobs, FLOPs of each kind, bytes written, and of those the bytes kept to the
    end of the run (temp() outputs are written but not kept)."""

    jobs: int = 0
    generate: float = 0.0
    kv_read: float = 0.0
    compute: float = 0.0
    written: float = 0.0
    kept: float = 0.0
    # The GPU memory (graftlab.memory) and batch, which its GPUs must divide, of its jobs, each distinct once.
    needs: dict = field(default_factory=dict)

    def add(self, w: Work | None = None, jobs: int = 1) -> None:
        self.jobs += jobs
        if w is not None:
            self.generate += w.generate
            self.kv_read += w.kv_read
            self.compute += w.compute
            self.written += w.written
            self.kept += w.written if w.kept is None else w.kept
            if w.memory is not None:
                m = w.memory
                self.needs.setdefault((tuple(sorted(m.parts.items())), m.sharded, m.spans, w.batch), (m, w.batch))

    def hardest(self, cluster) -> tuple[Memory, int | None, int | None] | None:
        """(memory, batch, GPUs) of the job that needs the most of the cluster's GPUs, one that no count holds
        (None GPUs) first; on a tie, the most memory a GPU. None for a rule without GPU jobs."""
        gpu_bytes, most = cluster.gpu_memory_gb * 1e9, cluster.gpus_per_node
        sized = [(m, b, m.gpus(gpu_bytes, b, most=most)) for m, b in self.needs.values()]
        return max(sized, key=lambda job: (job[2] is None, job[2] or 0, job[0].per_gpu(job[2] or 1)), default=None)

    @property
    def flops(self) -> float:
        return self.generate + self.compute


def experiment_jobs(layout: Experiment) -> list[tuple[str, dict]]:
    """Every job of an experiment's own rules, as (rule, wildcards): the wildcards `graftlab.planning.work`
    reads (sft's donor, fisher's mask, evaluate's run)."""
    x = layout.x
    # Mined once for every experiment that mines alike (rules/data.smk), its home's job.
    mined = [("mine", {"mined": layout.mining_home().removeprefix("results/mined/")})] if x["data"] in MINED else []
    jobs: list[tuple[str, dict]] = mined
    jobs += {
        "expert": [("expert_traces", {})],
        "knowledge": [("knowledge", {})],
        "teacher": [("teacher_traces", {})],
        "star": [("star", {})],
        "pedagogical": [("pedagogical_teacher", {}), ("pedagogical_traces", {})],
    }[x["data"]]
    # Each data set read once, whichever experiments read it (rules/data.smk).
    jobs += [("dataset", {"source": source_id(s)}) for s in layout.sources().values()]
    jobs += [("sft", {"donor": d}) for d in [POST, *x["donors"]] for _ in x["sft"]["lr"]]
    jobs += [(METHODS[r.kind].rule, {}) for r in layout.on_policy_runs()]  # sdpo_cot runs are the sdpo rule's
    runs = layout.run_list()
    grafts = [r for r in runs if r.kind == "graft"]
    # The sensitivity analysis always ranks by the diagonal Fisher; masks may add kfac.
    kinds = sorted({"diag", *layout.mask_kinds()})
    # A graft sweep's job makes, evaluates and measures the sensitivity share of each of its grafts
    # (rules/graft.smk); an adaptive experiment screens each sweep first, in a job of its own.
    sweeps = [(lams, dict(zip(SWEEP, sweep))) for sweep, lams in layout.sweeps().items()]
    jobs += retention_jobs(layout, kinds) + [(sweep_rule("graft", lams), w) for lams, w in sweeps]
    if x["eval"]["adaptive"]:
        jobs += [(sweep_rule("graft_screen", lams), w) for lams, w in sweeps] + [("screen", {})]
    # A training run's checkpoints are evaluated in one job (rules/evaluate.smk).
    trained = layout.checkpointed()
    # The post model's evaluation and the donors' as they are may be another experiment's too (`shared`).
    jobs += [
        ("evaluate", {"run": r.key} | ({"shared": layout.eval_digest(r.key)} if r.kind in (POST, "donor") else {}))
        for r in runs
        if r.kind not in ("graft", *TRAINED_KINDS)
    ]
    jobs += [(checkpoint_rule(cs), {"trainrun": key}) for key, cs in trained.items()]
    jobs += [(f"{checkpoint_rule(trained[key])}_screen", {"trainrun": key}) for key in layout.screened_trainruns()]
    grafted = {r.key for r in grafts}
    jobs += [("sensitivity_update", {})] * len(set(layout.sensitivity_runs()) - grafted)
    return jobs + [(rule, {}) for rule in ("summary", "pareto", "latency", "sensitivity", "gain_forgetting")]


def retention_jobs(layout: Experiment, kinds: list[str]) -> list[tuple[str, dict]]:
    """The post model's retention rollouts and its Fisher of each kind, named by their retention home: jobs
    that experiments share (rules/fisher.smk), which the plan counts once."""
    home = layout.retention_home().removeprefix("results/fisher/")
    names = [layout.fisher_dir(k).rsplit("/", 1)[1] for k in kinds]
    return [("rollouts", {"home": home})] + [("fisher", {"home": home, "fisher": n}) for n in names]


# The rule each continual rule is sized as: its `sized(...)` in rules/continual.smk (tests/test_plan.py
# reads them there). A rule not listed is sized under its own name.
SIZED_AS = {"chain_rollouts": "rollouts", "chain_fisher": "fisher", "stage_star": "star", "chain_merge_sft": "sft"}
SIZED_AS |= {m.chain_rule: m.rule for m in METHODS.values() if m.chain_rule and m.rule}


def sized_as(rule: str) -> str:
    """The rule name `graftlab.planning.work` sizes a job of `rule` as: a continual rule's single-domain one
    (`SIZED_AS`), `evaluate_run` for each rule evaluating a training run's checkpoints (`evaluate_run_part`
    for each of their parts' rules), `graft` and `graft_screen` for each rule making or screening the graft
    sweeps over one list of lam values (`sweep_rule`), `evaluate` for an evaluation experiments share."""
    if rule.startswith(f"{EVALUATE_RUN}_"):  # a checkpoint list's evaluation, its parts' or its screening's
        return next((f"{EVALUATE_RUN}_{k}" for k in ("part", "screen") if rule.endswith(f"_{k}")), EVALUATE_RUN)
    for swept in ("graft_screen", "graft"):  # the rules making or screening each list of lam values' sweeps
        if rule.startswith(f"{swept}_lam_"):
            return swept
    if rule.startswith("evaluate_shared_"):  # an evaluation several experiments share
        return "evaluate"
    return SIZED_AS.get(rule, rule)


# The rule of each kind of chain directory (`chain/<kind>/...`), and the wildcard naming the kind in it:
# each chained method's, and `tune`, graft_chain's donor tuned on one stage alone (by chain_sft).
CHAIN_RULES = {m.name: m.chain_rule for m in METHODS.values() if m.chained} | {"tune": "chain_sft"}
KIND_WILDCARD = {m.name: m.chain_wildcard for m in METHODS.values() if m.chained and m.chain_wildcard}
KIND_WILDCARD |= {"tune": "tune"}


def chain_wildcards(chain: Chain, k: int) -> dict:
    """The wildcards of a chain's job at stage k, as rules/continual.smk names them: its keys, the stage, the
    kind where the rule serves several (tune, form, sdpo) and the base model where the path names it (donor)."""
    w = {**chain.keys, "k": str(k)}
    if chain.kind in KIND_WILDCARD:
        w[KIND_WILDCARD[chain.kind]] = chain.kind
    return w if chain.kind in ON_POLICY else w | {"donor": chain.base}


def _sft_stages(c: Continual) -> list[tuple[Chain, int]]:
    """Every SFT stage a continual experiment trains (chain_sft): the SFT chains' stages, and the donor
    stages each graft chain's update is taken between (`donor_pair`): the donor tuned on stage k alone, or
    the cumulative donor's own SFT chain."""
    dirs = [c.stage_model(ch, k)[0] for ch in c.chains() if ch.kind == "sft" for k in c.stage_numbers()]
    dirs += [
        side[0]
        for ch in c.chains()
        if ch.kind in GRAFT_FORMS.values() and ch.kind != MERGE_CHAIN  # its SFT: chain_merge_sft, `_stage_jobs`
        for k in c.stage_numbers()
        for side in c.donor_pair(ch, k)
    ]
    prefix = f"{c.root}/"
    return [parse_chain(d.removeprefix(prefix)) for d in dict.fromkeys(dirs) if d.startswith(f"{prefix}chain/")]


def _stage_jobs(c: Continual, chain: Chain, k: int) -> list[tuple[str, dict]]:
    """A method chain's jobs at stage k. A masked graft chain's model after stage k < last also gets its
    retention Fisher, which its graft at stage k+1 reads (rules/continual.smk, `graft_inputs`)."""
    w = chain_wildcards(chain, k)
    jobs = [("chain_merge_sft", w)] if chain.kind == MERGE_CHAIN else []  # the update it adds, from its own model
    jobs += [(CHAIN_RULES[chain.kind], w)]
    if chain.kind in GRAFT_FORMS.values() and chain.keys["mask"] != "none" and k < len(c.stages):
        jobs += [("chain_rollouts", w), ("chain_fisher", w | {"kind": chain.keys["mask"]})]
    return jobs


def _continual_sources(c: Continual, fisher: bool) -> list[str]:
    """The data sets (the `dataset` rule's `source`) a continual experiment reads: its old benchmarks, each
    stage's problems and benchmark, and the retention prompts where a Fisher is computed."""
    prefix = f"{SOURCES_DIR}/"
    files = [f for _, f, _, _ in c.eval_benchmarks()]
    files += [source_file(s["problems"]) for s in c.stages if s["problems"]]
    files += [c.retention_prompts()] if fisher and c.retention_prompts() else []
    kept = [f.removeprefix(prefix).removesuffix(".parquet") for f in files if f.startswith(prefix)]
    return list(dict.fromkeys(kept))


def continual_jobs(c: Continual) -> list[tuple[str, dict]]:
    """Every job of a continual experiment (rules/continual.smk, and the shared dataset, rollouts, fisher and
    evaluate), as (rule, wildcards) under the workflow's rule names."""
    masks = sorted({ch.keys["mask"] for ch in c.chains() if ch.keys.get("mask", "none") != "none"})
    jobs = [("stage_data", {"k": str(k)}) for k in c.stage_numbers()]
    jobs += [("stage_star", {"k": str(k)}) for k in c.stage_numbers() if stage_data_kind(c.stage(k)) == "star"]
    jobs += [("dataset", {"source": s}) for s in _continual_sources(c, bool(masks))]
    # The post model's retention Fisher, read by each masked graft chain at stage 1.
    jobs += retention_jobs(c.base, masks) if masks else []
    jobs += [("chain_sft", chain_wildcards(ch, k)) for ch, k in _sft_stages(c)]
    methods = [ch for ch in c.chains() if ch.kind != "sft"]
    jobs += [job for ch in methods for k in c.stage_numbers() for job in _stage_jobs(c, ch, k)]
    jobs += [("evaluate", {"run": key}) for key in c.eval_keys()]
    jobs += [("stage_drift", {"chain": ch.key, "k": str(k)}) for ch in c.chains() for k in c.stage_numbers()]
    return jobs + [(rule, {}) for rule in ("continual", "param_drift", "response_kl")]


def _world(costs: dict, world: dict, uses: list[dict]) -> None:
    """The tiny world's jobs, for the parts its experiments use: pretraining (the ladder) and
    post-training when one runs on its models, its benchmarks, its mining candidates."""
    models = any(x["post"] == POST or any(world_checkpoint(d) for d in x["donors"]) for x in uses)
    benchmarks = models or any(not x["benchmarks"] for x in uses)
    if benchmarks:
        costs["world_benchmarks"].add(jobs=len(world["old_tasks"]))
    if any(x["data"] in MINED and not x["problems"] and not is_continual(x) for x in uses):
        costs["world_candidates"].add()
    if not models:
        return
    for rule in ("world_tokenizer", "world_corpus", "world_pretrain", "world_posttrain"):
        costs[rule].add(work.world_work(rule, world))


def _analysis(costs: dict, config: dict) -> None:
    """The analyses over experiments: the study, where it holds an experiment, with the drift and takeover
    tables of its experiments, the MoE model and the report's tables. A continual experiment is
    no part of the study; its own analyses are among its jobs (`continual_jobs`)."""
    study = study_experiments(config)
    for e in study:
        if e["drift"]:
            costs["drift"].add()
        if e["takeover"]:
            costs["takeover"].add()
    for rule in ("study", "moe", "report_tables", "all") if study else ("moe", "report_tables", "all"):
        costs[rule].add()


@dataclass
class Plan:
    """Per rule its Cost, the assumptions, notes on where figures came from, and the disk peak."""

    costs: dict[str, Cost]
    assumptions: Assumptions
    notes: list[str]
    temp_peak: float

    @property
    def total(self) -> Cost:
        fields = ("jobs", "generate", "kv_read", "compute", "written", "kept")
        return Cost(*(sum(getattr(c, f) for c in self.costs.values()) for f in fields))

    def gpu_hours(self, cost: Cost) -> float:
        """GPU-hours of a rule's jobs: decoding bound by its FLOPs or by reading the KV cache, whichever is
        slower over the rule's jobs together (its jobs decode alike), and whole-sequence passes."""
        a = self.assumptions
        decode = max(cost.generate / a.decode_mfu / a.gpu_flops, cost.kv_read / a.kv_utilisation / a.gpu_bandwidth)
        return (decode + cost.compute / a.mfu / a.gpu_flops) / 3600

    @property
    def total_gpu_hours(self) -> float:
        return sum(map(self.gpu_hours, self.costs.values()))

    @property
    def peak_disk(self) -> float:
        """Everything kept to the end (checkpoints, Fishers, fetched models, grafts' samples) plus the temp()
        grafts on disk together at the worst moment."""
        return self.total.kept + self.temp_peak

    @property
    def cluster(self) -> Cluster:
        """The cluster the run is sized for: GPUs of the assumed memory."""
        return Cluster(gpu_memory_gb=self.assumptions.gpu_memory_gb)

    def unrunnable(self) -> str | None:
        """Why the run would fail on its GPUs, in one line: the first job that cannot shard and that no count
        of them holds (`misfit`: a sampling engine, the Pedagogical RL teacher); None when there is none. A
        sharded job no count holds is only listed: smaller micro-batches may still fit it."""
        for rule, cost in self.costs.items():
            for need, batch in cost.needs.values():
                if not need.sharded and (problem := misfit(sized_as(rule), need, self.cluster, batch)):
                    return problem
        return None

    def shortfall(self, free: float) -> str | None:
        """Why the run would not fit in `free` bytes of disk, or None when it fits."""
        if self.peak_disk <= free:
            return None
        biggest = max(self.costs, key=lambda rule: self.costs[rule].kept)
        return (
            f"the run needs {self.peak_disk / GB:.3g} GB of disk at its peak but {free / GB:.3g} GB are free; "
            f"{biggest} keeps the most ({self.costs[biggest].kept / GB:.3g} GB): fewer sweep values, "
            f"save_dtype bf16 or fewer --resources temp_grafts shrink it"
        )


def free_disk(directory: Path) -> float:
    """Free bytes on the file system `directory` would live on (its nearest existing ancestor)."""
    import shutil

    directory = directory.resolve()
    while not directory.exists():
        directory = directory.parent
    return float(shutil.disk_usage(directory).free)


def _fetched(config: dict, x: dict) -> set[str]:
    """The models an experiment fetches: its post model, donors and (teacher traces) teacher; a continual
    experiment reads no `data` setting."""
    teacher = x["data"] == "teacher" and not is_continual(x)
    named = {x["post"], *x["donors"]} | ({x["teacher"]["model"]} if teacher else set())
    return {n for n in named if n in config["models"]}


# The wildcards that name a job experiments share: a retention home, a mining home, a data set, an evaluation.
SHARED_KEYS = {"home", "mined", "source", "shared"}


def _shared_once(rule: str, wildcards: dict, seen: set) -> bool:
    """Whether the job is one experiments share (`SHARED_KEYS`) that an earlier experiment already counted."""
    if not SHARED_KEYS & set(wildcards):
        return False
    key = (rule, tuple(sorted(wildcards.items())))
    if key in seen:
        return True
    seen.add(key)
    return False


def _experiment_costs(
    costs: dict, config: dict, name: str, a: Assumptions, root: Path, seen: set, evaluations: dict, stored: dict
) -> list[float]:
    """Add an experiment's jobs to `costs`; returns the bytes of its temp() grafts. A continual experiment's
    jobs are sized as the rule each one runs (`SIZED_AS`), by `graftlab.planning.work.continual_work`.
    `stored`: by single-domain experiment, its sweeps' grafts whose samples are kept (`work.sampled`)."""
    if is_continual(config["experiments"][name]):
        c = Continual.of(config, name)
        for rule, wildcards in continual_jobs(c):
            if not _shared_once(rule, wildcards, seen):
                costs[rule].add(work.continual_work(sized_as(rule), config, c, wildcards, a, root))
        return []  # a chain's grafts are kept: the next stage starts from them
    layout, grafts = Experiment.of(config, name), []
    parts = layout.x["eval"]["parts"]
    decided = work.screened(layout, root) if layout.x["eval"]["adaptive"] else {}
    for rule, wildcards in experiment_jobs(layout):
        if _shared_once(rule, wildcards, seen):
            continue
        if wildcards.get("shared") in evaluations:  # one job for every experiment asking (rules/evaluate.smk)
            rule = f"evaluate_shared_{wildcards['shared']}"
        kind = sized_as(rule)
        job = work.job_work(kind, config, layout, wildcards, a, root)
        sweep = tuple(str(wildcards[k]) for k in SWEEP) if kind == "graft" else None
        # A graft sweep, or a training run whose checkpoints are screened: sampling only the share screening
        # keeps, as its finished screening decided, else as assumed; the runs scored fully keep their samples.
        screened = sweep if layout.x["eval"]["adaptive"] else None
        if kind == EVALUATE_RUN and wildcards["trainrun"] in layout.screened_trainruns():
            screened = wildcards["trainrun"]
        if screened is not None:
            kept, of = decided.get(screened, (a.adaptive_kept, 1))
            share, samples = kept / of, job.kept
            job = replace(job, generate=share * job.generate, kv_read=share * job.kv_read)
            job = replace(job, kept=share * samples, written=job.written - (1 - share) * samples)
        if sweep is not None:
            read_back, of = stored[name].get(sweep, (0, 1))  # grafts whose samples an earlier job kept
            fresh = 1 - read_back / of
            job = replace(job, generate=fresh * job.generate, kv_read=fresh * job.kv_read)
        if kind in PARTS and parts > 1:
            # Sampled by its parts (rules/evaluate.smk, graft.smk), each a share; the job itself then grades.
            # Each checkpoint list's parts rule; one for every sweep, and every evaluation, shared or not.
            part_rule = f"{rule}_part" if kind == EVALUATE_RUN else PARTS[kind]
            costs[part_rule].add(replace(job, written=0.0, kept=0.0), jobs=parts)
            costs[rule].add(replace(job, generate=0.0, kv_read=0.0))
        else:
            costs[rule].add(job)
        if kind == "graft":  # one graft of the sweep on disk at a time, the post model's size
            grafts.append(job.model.bytes)
    return grafts


def estimate(config: dict, a: Assumptions = Assumptions(), root: Path = Path("."), compare: bool = True) -> Plan:
    """The plan of a resolved config (graftlab.planning.config.resolve): each rule's jobs, FLOPs and bytes;
    with adaptive sweeps and `compare`, a note pricing them against full scoring.

    A grafted model lives in its own job's scratch, which evaluates and deletes it (rules/graft.smk), and
    each job holds a `temp_grafts` resource: at most min(`a.jobs`, `a.temp_grafts`) are on disk at once.
    """
    costs = _Costs()
    single = [Experiment.of(config, e) for e, x in config["experiments"].items() if not is_continual(x)]
    evaluations = shared_evaluations(single)
    stored = {layout.name: work.sampled(layout, root) for layout in single}
    grafts: list[float] = []
    fetched: set[str] = set()
    shared: set = set()  # the retention jobs counted so far, which experiments share
    for name, x in config["experiments"].items():
        grafts += _experiment_costs(costs, config, name, a, root, shared, evaluations, stored)
        fetched |= _fetched(config, x)
    notes = []
    for name in sorted(fetched):
        layout = next(Experiment.of(config, e) for e in config["experiments"])
        fetch = work.job_work("fetch_model", config, layout, {"name": name}, a, root)
        costs["fetch_model"].add(fetch)
        model = fetch.model
        notes.append(f"{name}: {model.params / 1e9:.3g}B parameters, from {model.source}")
    by_world: dict[str, list[dict]] = {}
    for x in config["experiments"].values():
        by_world.setdefault(world_key(x), []).append(x)
    worlds = {"world": config["world"], **{f"worlds/{n}": w for n, w in config["worlds"].items()}}
    for key, uses in by_world.items():
        _world(costs, worlds[key], uses)
    _analysis(costs, config)
    notes += _shared_starts(single, shared, evaluations)
    sweeps = [sweep for by_sweep in stored.values() for sweep in by_sweep.values()]
    if kept := sum(k for k, _ in sweeps):
        notes.append(
            f"Kept samples: {kept} of the {sum(n for _, n in sweeps)} grafts' samples were kept by an earlier "
            "job of their sweep (resume/), read back instead of sampled: their inputs and the sampling code "
            "taken as unchanged"
        )
    temp_peak = sum(sorted(grafts, reverse=True)[: min(a.jobs, a.temp_grafts)])
    plan = Plan({r: c for r, c in costs.items() if c.jobs}, a, notes, temp_peak)
    adaptive = [e for e, x in config["experiments"].items() if x["eval"]["adaptive"]]
    if adaptive and compare:
        notes.append(_adaptive_note(config, adaptive, plan, a, root))
    return plan


def _adaptive_note(config: dict, adaptive: list[str], plan: Plan, a: Assumptions, root: Path) -> str:
    """The adaptive plan's GPU-hours against the same config with every sweep scored fully, and the kept
    share at which they are a third of those: the hours are linear in `--adaptive-kept`, so two more
    estimates (none kept, all kept) give the line. Sweeps already screened are charged as their screening
    decided (`graftlab.planning.work.screened`), whatever is assumed; the line is over the others."""
    full = copy.deepcopy(config)
    for e in adaptive:
        full["experiments"][e]["eval"]["adaptive"] = 0
    full_h = estimate(full, a, root, compare=False).total_gpu_hours
    none, every = (estimate(config, replace(a, adaptive_kept=k), root, compare=False).total_gpu_hours for k in (0, 1))
    decided = [d for e in adaptive for d in work.screened(Experiment.of(config, e), root).values()]
    measured = f"{sum(k for k, _ in decided)} of the {sum(n for _, n in decided)} runs screened so far kept"
    measured += " (results/EXP/screen/decisions.json)"
    checkpoints = any(Experiment.of(config, e).screened_trainruns() for e in adaptive)
    runs = "graft and merge" + (" and training checkpoint" if checkpoints else "")
    head = f"Adaptive sweeps ({', '.join(adaptive)}): every {runs} first scored on its eval.adaptive share, "
    hours = f"{_hours(plan.total_gpu_hours)} GPU-hours, against {_hours(full_h)} with every run scored fully"
    if every - none <= 1e-9 * full_h:  # every sweep screened: nothing is assumed
        return f"{head}{measured}, then scored fully: {hours}, {plan.total_gpu_hours / full_h:.2g} of it"
    rest = "the others" if decided else "them"
    third = full_h / 3
    if none >= third:
        reach = (
            f"none of {rest} kept, screening and every other job take {_hours(none)}: "
            "a third of full scoring's is out of reach"
        )
    else:
        reach = f"a third of those ({_hours(third)}) needs at most {(third - none) / (every - none):.2g} of {rest} kept"
    assumed = f"{a.adaptive_kept:g} of {rest} then fully (--adaptive-kept)"
    return f"{head}{measured + ', ' if decided else ''}{assumed}: {hours}; {reach}"


def _shared_starts(single: list[Experiment], shared: set, evaluations: dict) -> list[str]:
    """What the single-domain experiments `single` save by evaluating a training run's checkpoints and a
    sweep's grafts in one job, and by sharing retention homes (`shared`, the retention jobs counted), mining
    and `evaluations`: job starts, each an interpreter, a model load and (with vLLM) an engine."""
    runs = [cs for layout in single for cs in layout.checkpointed().values()]
    models = sum(len(cs) for cs in runs)
    sweeps = [lams for layout in single for lams in layout.sweeps().values()]
    grafts = sum(len(lams) for lams in sweeps)
    notes = [
        f"Evaluation: {len(runs)} jobs score the {models} kept checkpoints of {len(runs)} training runs, "
        f"{models - len(runs)} job starts (and vLLM engine starts) fewer than a job per checkpoint",
        f"Grafts: {len(sweeps)} jobs make and score the {grafts} grafts and merges of {len(sweeps)} sweeps, "
        f"{grafts - len(sweeps)} job starts (and vLLM engine starts) fewer than a job per graft",
    ]
    # Every single-domain experiment has a retention Fisher: its sensitivity analysis ranks by it.
    homes = sum(1 for rule, _ in shared if rule == "rollouts")
    if len(single) > homes:
        notes.append(f"Retention rollouts and Fishers: {homes} computed, shared by {len(single)} experiments")
    mining = [layout for layout in single if layout.x["data"] in MINED]
    if (mined := len({layout.mining_home() for layout in mining})) < len(mining):
        notes.append(f"Mining: {mined} jobs, shared by {len(mining)} experiments")
    if evaluations:
        runs = sum(len(members) for members in evaluations.values())
        notes.append(
            f"Evaluations shared by experiments: {runs} runs of the post model or a donor scored in {len(evaluations)}"
        )
    return notes


class _Costs(dict):
    def __missing__(self, rule: str) -> Cost:
        self[rule] = Cost()
        return self[rule]


# Pipeline order for the table; a rule not listed here goes last.
ORDER = (
    "fetch_model world_tokenizer world_corpus world_pretrain world_posttrain world_benchmarks world_candidates "
    "dataset stage_data mine expert_traces knowledge teacher_traces star pedagogical_teacher pedagogical_traces "
    "sft chain_sft opsd grpo sdpo chain_opsd chain_grpo chain_sdpo rollouts fisher graft_screen evaluate_run_screen "
    "screen graft graft_part chain_graft "
    "chain_rollouts chain_fisher evaluate evaluate_run sensitivity_update summary pareto latency sensitivity "
    "gain_forgetting continual stage_drift param_drift response_kl drift takeover study moe report_tables all"
).split()
GB = 1e9


def _hours(h: float) -> str:
    return f"{h:.3g}" if h >= 0.001 or h == 0 else "<0.001"


def render(plan: Plan) -> str:
    """The plan as Markdown: a row per rule, the totals, the disk peak and what it assumed."""
    a = plan.assumptions
    rules = sorted(plan.costs, key=lambda r: (ORDER.index(sized_as(r)) if sized_as(r) in ORDER else len(ORDER), r))
    # "kept" is what the rule's outputs use on disk after the run: `graftlab.planning.disk` measures the same per rule.
    head = "| rule | jobs | GPU-hours | disk written (GB) | kept (GB) | GPUs a job | GB a GPU |"
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|"]
    misfits, cluster = [], plan.cluster
    for rule in rules:
        c = plan.costs[rule]
        gpus, memory = "", ""
        if (hardest := c.hardest(cluster)) is not None:
            need, batch, n = hardest
            gpus, memory = (str(n), f"{need.per_gpu(n) / GB:.3g}") if n else ("none", f"{need.per_gpu(1) / GB:.3g}")
            if problem := misfit(sized_as(rule), need, cluster, batch):
                misfits.append(problem)
        cells = f"{c.jobs} | {_hours(plan.gpu_hours(c))} | {c.written / GB:.3g} | {c.kept / GB:.3g} | {gpus} | {memory}"
        lines.append(f"| {rule} | {cells} |")
    t = plan.total
    hours = _hours(plan.total_gpu_hours)
    total = (f"**{t.jobs}**", f"**{hours}**", f"**{t.written / GB:.3g}**", f"**{t.kept / GB:.3g}**")
    lines.append("| **total** | " + " | ".join(total) + " | | |")
    lines += [
        "",
        f"Peak disk: {plan.peak_disk / GB:.3g} GB = {t.kept / GB:.3g} GB kept to the end (checkpoints, Fishers, "
        f"fetched models, grafts' samples) + {plan.temp_peak / GB:.3g} GB of temporary grafts (at most "
        f"{min(a.jobs, a.temp_grafts)} at once: --jobs {a.jobs}, --resources temp_grafts={a.temp_grafts}).",
        "",
        f"Assumed: {a.gpu_flops:.3g} FLOP/s per GPU at {a.mfu:g} utilisation for whole-sequence passes and "
        f"{a.decode_mfu:g} for decoding, or where slower, decoding bound by reading the KV cache "
        f"at {a.kv_utilisation:g} of {a.gpu_bandwidth:.3g} B/s; 2 x params FLOPs per sampled or scored token, "
        f"6 x params per trained or Fisher token; an evaluation's answer as long as its benchmark's "
        f"response_tokens where configured or measured, every other sample its whole max_new_tokens; prompts of "
        f"{a.prompt_tokens} tokens; {a.problems} candidate problems and {a.benchmark_problems} per benchmark "
        f"where a data set sets no limit; mining keeps {a.kept:g} of them; checkpoints of "
        f"{a.checkpoint_bytes} bytes per parameter. CPU rules count at the same rate.",
    ]
    lines += [f"- {note}" for note in plan.notes]
    if misfits:
        lines += ["", f"Does not fit a {a.gpu_memory_gb:g} GB GPU (the hardest job of each rule):"]
        lines += [f"- {problem}" for problem in misfits]
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
    from snakemake.utils import update_config

    from graftlab.errors import UsageError
    from graftlab.planning.config import resolve

    config: dict = {}
    for path in configfiles:
        update_config(config, _config_file(path, "--configfile " + path))
    try:
        update_config(config, parse_config(overrides))
    except (ValueError, TypeError) as err:  # Snakemake's own words for an override it cannot parse
        raise UsageError(f"--config {' '.join(overrides)}: {err}") from None
    if not config:
        config = _config_file(str(root / "config.yaml"), "the workflow's config.yaml")
    return resolve(config)


def _config_file(path: str, name: str) -> dict:
    """The config file at `path` as Snakemake loads it, refused in one line naming it (`name`) when it is
    missing, is not YAML or JSON, or holds no mapping."""
    from snakemake.common.configfile import load_configfile
    from snakemake_interface_common.exceptions import WorkflowError

    from graftlab.errors import GraftlabError

    if not Path(path).is_file():
        raise GraftlabError(f"{name}: no such file")
    try:
        loaded = load_configfile(path)
    except WorkflowError as err:
        raise GraftlabError(f"{name}: {str(err).strip().splitlines()[0]}") from None
    if not isinstance(loaded, dict):
        raise GraftlabError(f"{name}: holds {type(loaded).__name__}, not a mapping of config keys")
    return loaded
