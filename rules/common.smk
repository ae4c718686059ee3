import dataclasses
import functools
import json
import re
import sys
from pathlib import Path

from snakemake_interface_executor_plugins.settings import DeploymentMethod

from graftlab.planning.config import ConfigError, resolve
from graftlab.io import warm
from graftlab.io.fetch import hub_offline, looks_local
from graftlab.fisher import KINDS as FISHER_KINDS
from graftlab.planning.chains import (
    GRAFT_FORMS,
    MERGE_CHAIN,
    Chain,
    Continual,
    is_continual,
    stage_data_kind,
)
from graftlab.planning.layout import (
    EVAL_JOB_SETTINGS,
    ROLLOUT_KEYS,
    TRAINED_KINDS,
    Experiment,
    SWEEP,
    checkpoint_groups,
    checkpoint_rule,
    fisher_options,
    kept_steps,
    mining_homes,
    retention_homes,
    section_of,
    shared_evaluations,
    shared_sources,
    source_file,
    study_experiments,
    sweep_groups,
    sweep_rule,
    worlds,
)
from graftlab.planning.resources import (
    Cluster,
    PARTS,
    TEMP_GRAFTS,
    job_resources,
    misfit,
    overtime,
)
from graftlab.planning.source import import_from
from graftlab.planning.work import continual_work, job_work, world_work

# config.yaml is the default, not a base layer: a `--configfile` replaces it, so its experiments never
# leak into a run that names its own (layer it explicitly: `--configfile config.yaml mine.yaml`).
if not config:

    configfile: Path(workflow.basedir) / "config.yaml"


try:
    resolve(config)
except ConfigError as err:
    raise WorkflowError(str(err)) from None

# The grafts' cap defaults here, not in profiles/default: a workflow profile's `resources` would replace a
# cluster profile's. A profile's or the command line's `--resources temp_grafts=N` wins.
if "temp_grafts" not in workflow.global_resources:
    workflow.register_resource("temp_grafts", TEMP_GRAFTS)

# Under --sdm conda, every job imports graftlab from this workflow's own src/: the environments (envs/) hold its
# dependencies only, since Snakemake copies an environment file away from the checkout it could name.
if DeploymentMethod.CONDA in workflow.deployment_settings.deployment_method:
    import_from(Path(workflow.basedir) / "src")


def start_warm_jobs():
    """Start the warm process every job of this run hands itself to (graftlab.io.warm): only where the jobs
    run here, in this interpreter (no cluster executor, no conda or container environment).
    """
    if (
        config["warm_jobs"]
        and workflow.local_exec
        and not workflow.deployment_settings.deployment_method
    ):
        WARM.append(warm.start(Path(workflow.basedir) / "workflow_scripts"))


WARM = []  # the warm process of this run, once started


def stop_warm_jobs():
    """End the warm process at the run's end, and remove its socket."""
    for proc in filter(None, WARM):
        warm.stop(proc)
    WARM.clear()


# Every job starts offline (graftlab.io.fetch.hub_offline); the local fetch rules switch the hub back on.
hub_offline()

# Continual experiments (with `stages`, rules/continual.smk) apart from the single-domain ones.
CONTINUAL = [e for e, x in config["experiments"].items() if is_continual(x)]
EXPERIMENTS = [e for e in config["experiments"] if e not in CONTINUAL]
MODELS = config["models"]
# Every tiny world by its directory under results/ (the `{world}` wildcard of rules/world.smk).
WORLDS = worlds(config)
# Which runs each experiment evaluates and where their inputs lie: graftlab.planning.layout and graftlab.planning.chains,
# unit-tested there.
LAYOUTS = {exp: Experiment.of(config, exp) for exp in EXPERIMENTS} | {
    exp: Continual.of(config, exp) for exp in CONTINUAL
}
CONTINUAL_PATTERN = "|".join(CONTINUAL) or "(?!)"
# The training runs whose checkpoints one job evaluates, by the checkpoints they keep (rules/evaluate.smk).
CHECKPOINT_GROUPS = checkpoint_groups([LAYOUTS[e] for e in EXPERIMENTS])
# The graft sweeps one job each makes and scores, by their lam values (rules/graft.smk).
SWEEP_GROUPS = sweep_groups([LAYOUTS[e] for e in EXPERIMENTS])


def runs_pattern(runs, under="eval"):
    """A pattern of the `exp` wildcard matching each experiment only where the rest of the path is the
    evaluation (or, `under="screen"`, the screening) of one of its runs `runs[exp]` (a lookahead), so two
    experiments whose same run keeps other checkpoints never make two rules match one file.
    """
    tied = [
        f"{re.escape(exp)}(?=/{under}/(?:{'|'.join(map(re.escape, keys))})/)"
        for exp, keys in runs.items()
    ]
    return "|".join(tied)


def sweeps_pattern(sweeps):
    """A pattern of the `exp` wildcard matching each experiment only where the rest of the path is a file of
    one of its sweeps `sweeps[exp]` over the rule's lam values (a lookahead): its grafts' evaluations,
    sensitivity shares, screenings and seconds."""
    tied = []
    for exp, keys in sweeps.items():
        files = "|".join(
            re.escape(f"{donor}/lr~{lr}/epoch~{epoch}/")
            + "lam~[^/]+/"
            + re.escape(f"mask~{mask}/rho~{rho}/")
            for donor, lr, epoch, mask, rho in keys
        )
        tied.append(
            f"{re.escape(exp)}(?=/(?:eval/|sensitivity/|screen/)?graft/(?:{files}))"
        )
    return "|".join(tied)


# A graft sweep's wildcards each name one path segment (`SWEEP`).
SWEEP_CONSTRAINTS = {key: "[^/]+" for key in SWEEP}


def sweep_dir(w):
    """A graft sweep's directory under results/{exp}/: its grafts' paths without their lam."""
    return SWEEP_KEY.format(**{key: w[key] for key in SWEEP})


def sweep_inputs():
    """What every job of a graft sweep reads (rules/graft.smk): the post model, the donor and its SFT run, the
    mask's Fisher, the benchmarks."""
    return {
        "post": post_dir,
        "donor": lambda w: layout(w).model_input(w.donor),
        "tuned": "results/{exp}/sft/{donor}/lr~{lr}",
        "fisher": lambda w: layout(w).graft_fisher(w.mask, w.rho),
        "benchmarks": lambda w: [b[1] for b in layout(w).eval_benchmarks()],
    }


def sweep_outputs(pattern, lams):
    """A sweep rule's outputs of one kind: `pattern` for every lam, its `{lam}` filled in."""
    return [pattern.replace("{lam}", lam) for lam in lams]


# A graft's key path and its sweep's (all but lam), as rules/graft.smk's outputs, logs and parts spell them.
GRAFT_KEY = "graft/{donor}/lr~{lr}/epoch~{epoch}/lam~{lam}/mask~{mask}/rho~{rho}"
SWEEP_KEY = "graft/{donor}/lr~{lr}/epoch~{epoch}/mask~{mask}/rho~{rho}"


def checkpoint_keys(checkpoints):
    """The evaluation keys of a training run's checkpoints (a function, so the loop's list is bound)."""
    return lambda w: [f"{w.trainrun}/{c}" for c in checkpoints]


def checkpoint_models(checkpoints):
    return lambda w: [f"{layout(w).root}/{w.trainrun}/{c}" for c in checkpoints]


def checkpoint_metrics(checkpoints):
    return lambda w: [
        f"results/{w.exp}/eval/{w.trainrun}/{c}/metrics.json" for c in checkpoints
    ]


# Every configured data set by its id under results/sources/ (rules/data.smk), with the config key it is
# named by and its settings.
SOURCES = shared_sources(LAYOUTS.values())


# Each retention home (results/fisher/<id>/, rules/fisher.smk) with the experiments sharing it; the first
# one's layout serves its rules.
RETENTION = retention_homes(config)
RETENTION_PATTERN = "|".join(re.escape(home) for home in RETENTION) or "(?!)"


def retention_layout(wildcards):
    """The layout of the first experiment whose post model's retention Fisher lives in the job's home."""
    return RETENTION[wildcards.home][0]


# The evaluations several experiments ask for alike (the post model's, a donor's as it is), one job each
# (rules/evaluate.smk), by a digest of what they are computed from.
SHARED_EVALS = shared_evaluations(LAYOUTS[e] for e in EXPERIMENTS)


# The `exp` wildcard of the `evaluate` rule: any experiment, except where the rest of the path is an evaluation
# a shared job writes (a lookahead).
SHARED_EVALS_EXCLUDED = (
    "(?!(?:"
    + "|".join(
        re.escape(f"{exp}/eval/{run}/metrics.json")
        for members in SHARED_EVALS.values()
        for exp, run in members
    )
    + ")$)(?:"
    + "|".join(map(re.escape, EXPERIMENTS + CONTINUAL))
    + ")"
    if SHARED_EVALS
    else "|".join(map(re.escape, EXPERIMENTS + CONTINUAL))
)


class FixedWildcards(dict):
    """The wildcards of a job a wildcard-free rule runs for (a shared evaluation's, as its first experiment's)."""

    __getattr__ = dict.get


def bound(functions, wildcards):
    """A rule's input or params, each function of the wildcards called now with `wildcards`."""
    return {k: (f(wildcards) if callable(f) else f) for k, f in functions.items()}


def evaluate_inputs():
    """What an evaluation job reads (rules/evaluate.smk): the model, the benchmarks, its parts' markers."""
    return {
        "model": lambda w: layout(w).eval_model(w.run)[0],
        "benchmarks": lambda w: [b[1] for b in layout(w).eval_benchmarks()],
        "parts": part_files("evaluate", lambda w: f"results/{w.exp}/eval/{w.run}"),
    }


# Each mining home (results/mined/<id>/, rules/data.smk) with the experiments mining into it; the first one's
# layout serves its job.
MINING = mining_homes(LAYOUTS[e] for e in EXPERIMENTS)


def mining_layout(wildcards):
    """The layout of the first experiment whose mined problems live in the job's home."""
    return MINING[wildcards.mined][0]


# Each kind of home by the wildcard that names it: a job of one is sized as its first experiment's.
HOMES = {"home": RETENTION, "mined": MINING}


def experiments_with(*kinds):
    """The experiments whose new-task data is of one of `kinds`, as a wildcard pattern that matches no
    experiment name when there are none (a rule of that kind then never applies)."""
    names = [e for e in EXPERIMENTS if config["experiments"][e]["data"] in kinds]
    return "|".join(names) or "(?!)"


wildcard_constraints:
    exp="|".join(EXPERIMENTS + CONTINUAL),
    world="|".join(WORLDS),
    donor="|".join(["post", "step~[0-9]+", "post~[0-9]+"] + list(MODELS)),
    lr="[^/]+",
    epoch="[0-9]+",
    lam="[^/]+",
    alpha="[^/]+",
    teacher="[^/]+",
    sdpo="sdpo|sdpo_cot",
    mask="|".join(("none",) + FISHER_KINDS),
    rho="[^/]+",


def layout(wildcards):
    """The runs and paths of the experiment a job belongs to (graftlab.planning.layout.Experiment)."""
    return LAYOUTS[wildcards.exp]


def xcfg(wildcards, *keys):
    """One experiment's setting, e.g. xcfg(wildcards, "sft", "epochs")."""
    value = config["experiments"][wildcards.exp]
    for key in keys:
        value = value[key]
    return value


def wcfg(wildcards, *keys):
    """One setting of the world a world rule builds, e.g. wcfg(wildcards, "pretrain", "steps")."""
    value = WORLDS[wildcards.world]
    for key in keys:
        value = value[key]
    return value


def post_dir(wildcards):
    return layout(wildcards).post_dir


def eval_params(**first):
    """The params of an evaluation job, and of a graft job, which evaluates its own model, after `first`:
    only what sampling uses, so switching donor_sft on or off re-runs none."""
    return first | {
        "benchmarks": lambda w: layout(w).eval_benchmarks(),
        "sampling": lambda w: {
            k: v
            for k, v in xcfg(w, "eval").items()
            if k not in (*EVAL_JOB_SETTINGS, "validation")  # validation: its own param
        },
        "validation": lambda w: xcfg(w, "eval", "validation"),
        "seed": lambda w: xcfg(w, "seed"),
        "backend": {"backend": config["sampling_backend"], **config["vllm"]},
    }


def sweep_lams(w):
    """The lam values of a graft sweep's job, in its outputs' order (graftlab.planning.layout.Experiment.sweeps)."""
    return layout(w).sweeps()[tuple(w[key] for key in SWEEP)]


def graft_runs(w):
    """The evaluation keys of a graft sweep's models (graftlab.planning.layout), one a lam."""
    return [
        GRAFT_KEY.format(lam=lam, **{key: w[key] for key in SWEEP})
        for lam in sweep_lams(w)
    ]


def screened_file(w):
    """The adaptive sweep's decisions a graft job reads (rules/graft.smk), None where `eval.adaptive` is off."""
    if xcfg(w, "eval", "adaptive"):
        return f"results/{w.exp}/screen/decisions.json"
    return None


def screened_checkpoints(w):
    """The decisions a training run's checkpoint evaluation reads (rules/evaluate.smk), None where its
    checkpoints are not screened (`eval.adaptive_checkpoints`)."""
    if w.trainrun in layout(w).screened_trainruns():
        return f"results/{w.exp}/screen/decisions.json"
    return None


def graft_params():
    """The params of a graft sweep's jobs (rules/graft.smk): what grafting and sampling read."""
    return eval_params(
        donor=lambda w: layout(w).model_dir(w.donor),
        runs=graft_runs,
        epoch=lambda w: w.epoch,
        lams=sweep_lams,
        mask=lambda w: w.mask,
        rho=lambda w: w.rho,
        mask_settings=lambda w: layout(w).mask_settings(w.donor, w.mask),
    )


# The share of coordinates the sensitivity analysis counts as the most sensitive (grafting paper §7).
SENSITIVITY_TOP = 0.01


def report_disk():
    """Write results/disk.tsv (graftlab.planning.disk) and log its table: the disk a finished run uses, per rule."""
    from graftlab.planning.disk import write_report

    table = write_report(Path("."), Path("results/disk.tsv"))
    logger.info(f"Disk used, per rule:\n{table}")


def rope_dir(name):
    """The fetched directory of the model whose rope scaling model `name` copies, or [] for none."""
    other = MODELS[name].get("rope_from")
    return f"resources/models/{other}" if other else []


def local_source(source):
    """[source] when it names a local path, else [] (a hub id): an input, so a local file or model
    another rule writes is built first, and an edited one is read again."""
    return [str(Path(source).expanduser())] if looks_local(source) else []


# Each job's resources, from the model it loads and the work it does (graftlab.planning.resources, unit-tested
# there): rules set them, and no profile sets per-rule resources, so nothing overrides them.
def profile_default(name):
    """The text of the profile's default-resources entry `name`, or None. Read from `args` (name=text), which
    Snakemake 9.15 (vLLM's environment, envs/vllm-cpu.sh) and 9.27 both have; newer ones also offer `get`.
    """
    defaults = workflow.resource_settings.default_resources
    given = dict(arg.split("=", 1) for arg in defaults.args) if defaults else {}
    return given.get(name)


# The cluster's shape, as the profile's default-resources state it (graftlab.planning.resources.Cluster): the
# partitions, one GPU's memory, GPUs a node, each partition's time limit, and the GPU rules' model,
# constraint and QoS; graftlab's defaults without a profile.
def profile_cluster():
    given = {f.name: profile_default(f.name) for f in dataclasses.fields(Cluster)}
    try:
        return Cluster.of(given)
    except ValueError as err:
        raise WorkflowError(f"the profile's default-resources: {err}") from None


CLUSTER = profile_cluster()


@functools.cache
def work_of(rule_name, exp, wildcards):
    """The work of one job (graftlab.planning.work): its model and FLOPs; None for a job of no model. Cached:
    each of a job's resources asks for it."""
    w = dict(wildcards)
    if rule_name in ("world_pretrain", "world_posttrain"):
        return world_work(rule_name, WORLDS[w["world"]])
    if exp is None:
        return None
    if exp in CONTINUAL:
        return continual_work(rule_name, config, LAYOUTS[exp], w)
    return job_work(rule_name, config, LAYOUTS[exp], w)


WARNED = set()


def warn_once(rule_name, kind, problem):
    """Say once per rule and kind, for its first job, that its jobs do not fit the cluster
    (graftlab.planning.resources: `misfit`, the GPUs; `overtime`, the partition's time limit).
    """
    if (rule_name, kind) not in WARNED:
        WARNED.add((rule_name, kind))
        print(f"graftlab: warning: {problem}", file=sys.stderr)


# A part rule's own wildcards (rules/evaluate.smk, graft.smk), beside those of the job whose sampling it shares.
PART_WILDCARDS = ("part", "parts")
PART_OF = {part: whole for whole, part in PARTS.items()}


def job_sizes(rule_name, wildcards):
    """(the work of a job as `job_resources` takes it, its parts): a part rule's job sized as its share of
    the job it samples for (`part_of`), and that job, once split, sized without the sampling its parts did.
    """
    # A job of a retention or mining home is sized as its first experiment's.
    homes = [
        HOMES[key][home] for key in HOMES if (home := getattr(wildcards, key, None))
    ]
    exp = homes[0][0].name if homes else getattr(wildcards, "exp", None)
    whole = PART_OF.get(rule_name, rule_name)
    own = tuple(sorted((k, v) for k, v in wildcards.items() if k not in PART_WILDCARDS))
    work = work_of(whole, exp, own)
    sizes = (
        {}
        if work is None
        else {
            "params": work.model.params,
            "generate": work.generate,
            "kv_read": work.kv_read,
            "compute": work.compute,
            "memory": work.memory,
            "batch": work.batch,
            "host": work.host,
            "streams": work.streams,
        }
    )
    if whole not in PARTS:
        return work, sizes, 1
    # The experiment's `eval.parts`, not a count from the job's estimate: a part is an input of the job it
    # samples for, and a count that moved with an estimate (a measured response length, the profile) would
    # re-run finished evaluations (Snakemake's input trigger). `overtime` names the count a job needs.
    parts = config["experiments"][exp]["eval"]["parts"]
    if whole != rule_name:
        return work, sizes | {"part_of": parts}, parts
    return work, sizes | ({"generate": 0.0, "kv_read": 0.0} if parts > 1 else {}), parts


def part_files(rule_name, where):
    """The input function of a job's parts (`PARTS`, `eval.parts`): `where`/part~{i}of{n}, none for one part."""

    def files(wildcards):
        parts = job_sizes(rule_name, wildcards)[2]
        return (
            [f"{where(wildcards)}/part~{i}of{parts}" for i in range(parts)]
            if parts > 1
            else []
        )

    return files


def sized(rule_name, fixed=None):
    """The `resources:` of a rule: each a function of the job's wildcards (`fixed` ones for a wildcard-free
    rule) and attempt."""
    whole = PART_OF.get(rule_name, rule_name)

    def get(key):
        def resource(wildcards, attempt):
            wildcards = fixed or wildcards
            work, sizes, _ = job_sizes(rule_name, wildcards)
            if key == "gpu" and work is not None and work.memory is not None:
                if problem := misfit(whole, work.memory, CLUSTER, work.batch):
                    # A job that cannot shard would fail on every GPU: refused while the DAG is built,
                    # before anything is submitted. A sharded one may still fit in smaller micro-batches.
                    if not work.memory.sharded:
                        raise WorkflowError(problem)
                    warn_once(rule_name, "gpus", problem)
            # A job that resumes continues on each retry (the profile's `retries`); a report, which runs no
            # job, has no execution settings.
            attempts = getattr(workflow.execution_settings, "retries", 0) + 1
            if key == "runtime" and (
                problem := overtime(whole, CLUSTER, attempts, **sizes)
            ):
                warn_once(rule_name, "runtime", problem)
            return job_resources(whole, **sizes, attempt=attempt, cluster=CLUSTER)[key]

        return resource

    # Every resource it sizes on this cluster: a partition, a GPU model, constraint or QoS only where named.
    return {key: get(key) for key in job_resources(whole, cluster=CLUSTER)}


# The continual experiments' chains (rules/continual.smk; graftlab.planning.chains).
def chains(w):
    """The continual layout of the job's experiment (graftlab.planning.chains.Continual)."""
    return LAYOUTS[w.exp]


def stage_of(w):
    return int(w.k)


def wchain(w, kind):
    """The chain a job's wildcards name: its kind, base model and keys (no stage)."""
    keys = {
        name: getattr(w, name)
        for name in ("alpha", "teacher", "lr", "lam", "mask", "rho")
        if hasattr(w, name)
    }
    base = getattr(w, "donor", "post")
    return Chain(kind, base, keys)


def previous(w, kind):
    """(input, model) of the chain's model before the job's stage."""
    return chains(w).stage_model(wchain(w, kind), stage_of(w) - 1)


def stage_file(name):
    return lambda w: chains(w).stage_data(stage_of(w), name)


def knowledge_facts(w):
    """A knowledge stage's facts, which OPSD's teacher reads with each question."""
    stage = chains(w).stage(stage_of(w))
    return (
        stage_file("facts.parquet")(w) if stage_data_kind(stage) == "knowledge" else []
    )


def graft_inputs(w):
    """The current model, the donor before and after its update of this stage, and the current model's
    retention Fisher for a masked graft: the post model's at stage 1, else the chain's own.
    """
    c, k = chains(w), stage_of(w)
    chain = wchain(w, w.form)
    (donor_in, donor), (tuned_in, tuned) = c.donor_pair(chain, k)
    fisher = []
    if w.mask != "none":
        fisher = (
            c.base.fisher_dir(w.mask)
            if k == 1
            else f"{c.stage_dir(chain, k - 1)}/fisher/{w.mask}"
        )
    return {
        "post": c.stage_model(chain, k - 1)[0],
        "donor": donor_in,
        "tuned": tuned_in,
        "fisher": fisher,
    }


def on_policy_params(kind, exclude):
    """The params every on-policy stage passes its trainer: the stage's section without the swept keys."""
    return {
        # `sdpo` and `sdpo_cot` share a rule: the job's own kind names its chain.
        "model": lambda w: previous(w, getattr(w, "sdpo", kind))[1],
        "lr": lambda w: float(w.lr),
        "save_steps": lambda w: kept_steps(chains(w).section(kind, stage_of(w))),
        "seed": lambda w: xcfg(w, "seed"),
        "precision": config["precision"],
        "gradient_checkpointing": config["gradient_checkpointing"],
        "save_dtype": config["save_dtype"],
        "resume_minutes": config["resume_minutes"],
        "backend": {"backend": config["sampling_backend"], **config["vllm"]},
        section_of(kind): lambda w: {
            k: v
            for k, v in chains(w).section(kind, stage_of(w)).items()
            if k not in exclude
        },
    }


# The tables report_tables (rules/analysis.smk) renders for the report: each summary-level table of the run.
SINGLE_TABLES = ("summary", "gain_forgetting", "latency", "sensitivity")
CONTINUAL_TABLES = (
    "summary",
    "continual",
    "param_drift",
    "response_quantiles",
    "kl_forgetting",
)


def report_tables():
    """[{category, name, path}]: each experiment's summary tables under its name, the study's (with the
    drift and takeover tables it reads) under `study`, the MoE model's under `moe`."""
    tables = [
        {"category": exp, "name": name, "path": f"results/{exp}/{name}.parquet"}
        for exp in EXPERIMENTS
        for name in SINGLE_TABLES
    ]
    tables += [
        {"category": exp, "name": name, "path": f"results/{exp}/{name}.parquet"}
        for exp in CONTINUAL
        for name in CONTINUAL_TABLES
    ]
    for e in study_experiments(config):
        tables += [
            {"category": e["exp"], "name": kind, "path": e[kind]}
            for kind in ("drift", "takeover")
            if e[kind]
        ]
    if study_experiments(config):
        tables += [
            {"category": "study", "name": n, "path": f"results/study/{n}.parquet"}
            for n in ("study", "groups")
        ]
    return tables + [
        {"category": "moe", "name": "moe", "path": "results/moe/moe.parquet"}
    ]
