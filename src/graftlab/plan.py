"""The cost of a run before its launch: jobs, GPU-hours and disk per rule, from the resolved config.

Each job's work (its model, FLOPs and bytes written) comes from `graftlab.work`, the same count the
scheduler's limits are sized from (`graftlab.resources`). GPU time is FLOPs / (GPU peak FLOP/s x
utilisation), with decoding at a lower utilisation than whole-sequence passes, since it is memory-bound.
Data set sizes are assumptions (the flags of `graftlab plan`), printed beside the table. Standard
library only: planning needs no torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from graftlab import work
from graftlab.layout import POST, Experiment, on_tiny_world, section_of, shows_takeover, study_experiments, world_key
from graftlab.work import MINED, Work


@dataclass(frozen=True)
class Assumptions(work.Assumptions):
    """The data sizes of `graftlab.work.Assumptions`, and the GPU the run is costed on."""

    mfu: float = 0.3  # share of the GPU's peak FLOP/s a whole-sequence pass reaches
    decode_mfu: float = 0.1  # share that decoding reaches: it is bound by memory bandwidth
    gpu_flops: float = 989e12  # an H100's dense bf16 peak
    jobs: int = 1  # jobs at once (Snakemake's --jobs): bounds the grafts on disk together


@dataclass
class Cost:
    """One rule's total: jobs, FLOPs of each kind, bytes written, and of those the bytes kept to the
    end of the run (temp() outputs are written but not kept)."""

    jobs: int = 0
    generate: float = 0.0
    compute: float = 0.0
    written: float = 0.0
    kept: float = 0.0

    def add(self, w: Work | None = None, jobs: int = 1) -> None:
        self.jobs += jobs
        if w is not None:
            self.generate += w.generate
            self.compute += w.compute
            self.written += w.written
            self.kept += w.written if w.kept is None else w.kept

    @property
    def flops(self) -> float:
        return self.generate + self.compute


def experiment_jobs(layout: Experiment) -> list[tuple[str, dict]]:
    """Every job of an experiment's own rules, as (rule, wildcards): the wildcards `graftlab.work`
    reads (sft's donor, fisher's mask, evaluate's run)."""
    x = layout.x
    jobs: list[tuple[str, dict]] = [("mine", {})] if x["data"] in MINED else []
    jobs += {
        "expert": [("expert_traces", {})],
        "knowledge": [("knowledge", {})],
        "teacher": [("teacher_traces", {})],
        "star": [("star", {})],
        "pedagogical": [("pedagogical_teacher", {}), ("pedagogical_traces", {})],
    }[x["data"]]
    sources = (["problems"] if x["problems"] else []) + (["retention"] if x["fisher"]["prompts"] else [])
    jobs += [("dataset", {})] * (len(sources) + len(x["benchmarks"] or {}))
    jobs += [("sft", {"donor": d}) for d in [POST, *x["donors"]] for _ in x["sft"]["lr"]]
    jobs += [(section_of(r.kind), {}) for r in layout.on_policy_runs()]  # sdpo_cot runs are the sdpo rule's
    runs = layout.run_list()
    grafts = [r for r in runs if r.kind == "graft"]
    # The sensitivity analysis always ranks by the diagonal Fisher; masks may add kfac.
    kinds = sorted({"diag"} | {r.keys["mask"] for r in grafts} - {"none"})
    jobs += [("rollouts", {})] + [("fisher", {"mask": k}) for k in kinds] + [("graft", {})] * len(grafts)
    jobs += [("evaluate", {"run": r.key}) for r in runs]
    jobs += [("sensitivity_update", {})] * len(layout.sensitivity_runs())
    return jobs + [(rule, {}) for rule in ("summary", "pareto", "latency", "sensitivity", "gain_forgetting")]


def _world(costs: dict, world: dict, uses: list[dict]) -> None:
    """The tiny world's jobs, for the parts its experiments use: pretraining (the ladder) and
    post-training when one runs on its models, its benchmarks, its mining candidates."""
    models = any(x["post"] == POST or any(d.startswith("step~") for d in x["donors"]) for x in uses)
    benchmarks = models or any(not x["benchmarks"] for x in uses)
    if benchmarks:
        costs["world_benchmarks"].add(jobs=len(world["old_tasks"]))
    if any(x["data"] in MINED and not x["problems"] for x in uses):
        costs["world_candidates"].add()
    if not models:
        return
    for rule in ("world_tokenizer", "world_corpus", "world_pretrain", "world_posttrain"):
        costs[rule].add(work.world_work(rule, world))


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
        fields = ("jobs", "generate", "compute", "written", "kept")
        return Cost(*(sum(getattr(c, f) for c in self.costs.values()) for f in fields))

    def gpu_hours(self, cost: Cost) -> float:
        a = self.assumptions
        return (cost.generate / a.decode_mfu + cost.compute / a.mfu) / a.gpu_flops / 3600

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
        for rule, wildcards in experiment_jobs(layout):
            job = work.job_work(rule, config, layout, wildcards, a, root)
            costs[rule].add(job)
            if rule == "graft":
                grafts.append(job.written)
        fetched |= _fetched(config, layout)
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
    temp_peak = sum(sorted(grafts, reverse=True)[: 2 * a.jobs])
    return Plan({r: c for r, c in costs.items() if c.jobs}, a, notes, temp_peak)


class _Costs(dict):
    def __missing__(self, rule: str) -> Cost:
        self[rule] = Cost()
        return self[rule]


# Pipeline order for the table; a rule not listed here goes last.
ORDER = (
    "fetch_model world_tokenizer world_corpus world_pretrain world_posttrain world_benchmarks world_candidates "
    "dataset mine expert_traces knowledge teacher_traces star pedagogical_teacher pedagogical_traces sft "
    "opsd grpo sdpo rollouts fisher graft evaluate sensitivity_update summary pareto latency sensitivity "
    "gain_forgetting drift takeover study moe all"
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
        f"Assumed: {a.gpu_flops:.3g} FLOP/s per GPU at {a.mfu:g} utilisation for whole-sequence passes and "
        f"{a.decode_mfu:g} for decoding; 2 x params FLOPs per sampled or scored token, 6 x params per trained or "
        f"Fisher token; every sample uses its whole max_new_tokens; prompts of "
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
