from pathlib import Path

from graftlab.analysis.summary import parse_run
from graftlab.config import ConfigError, load_schema, resolve
from graftlab.fisher import KINDS as FISHER_KINDS
from graftlab.fetch import looks_local

# config.yaml is the default, not a base layer: a `--configfile` replaces it, so its experiments never
# leak into a run that names its own (layer it explicitly: `--configfile config.yaml mine.yaml`).
if not config:

    configfile: Path(workflow.basedir) / "config.yaml"


try:
    resolve(
        config, load_schema(Path(workflow.basedir) / "schemas" / "config.schema.yaml")
    )
except ConfigError as err:
    raise WorkflowError(str(err)) from None

EXPERIMENTS = list(config["experiments"])
MODELS = config["models"]
# Every tiny world by its directory under results/ (the `{world}` wildcard of rules/world.smk), each a
# whole section with its seed: the main `world`, and each of `worlds`, already merged over it by the
# config resolution.
WORLDS = {"world": config["world"] | {"seed": config["seed"]}} | {
    f"worlds/{name}": section for name, section in config["worlds"].items()
}


MINED = (
    "expert",
    "teacher",
    "star",
    "pedagogical",
)  # data kinds that learn from mined problems


def experiments_with(*kinds):
    """The experiments whose new-task data is of one of `kinds`, as a wildcard pattern that matches no
    experiment name when there are none (a rule of that kind then never applies)."""
    names = [e for e in EXPERIMENTS if config["experiments"][e]["data"] in kinds]
    return "|".join(names) or "(?!)"


MODEL_NAME = "|".join(["post", "step~[0-9]+"] + list(MODELS))


wildcard_constraints:
    exp="|".join(EXPERIMENTS),
    world="|".join(WORLDS),
    base=MODEL_NAME,
    donor=MODEL_NAME,
    model=MODEL_NAME,
    lr="[^/]+",
    e="[0-9]+",
    lam="[^/]+",
    alpha="[^/]+",
    kind="|".join(FISHER_KINDS),
    mask="|".join(("none",) + FISHER_KINDS),
    rho="[^/]+",


def xcfg(wildcards, *keys):
    """One experiment's setting, e.g. xcfg(wildcards, "sft", "epochs")."""
    value = config["experiments"][wildcards.exp]
    for key in keys:
        value = value[key]
    return value


def world_of(exp):
    """(directory, section) of the tiny world experiment `exp` runs on: `results/world` for the main
    section, `results/worlds/{name}` for a named one."""
    name = config["experiments"][exp]["world"]
    key = "world" if name == "world" else f"worlds/{name}"
    return f"results/{key}", WORLDS[key]


def wcfg(wildcards, *keys):
    """One setting of the world a world rule builds, e.g. wcfg(wildcards, "pretrain", "steps")."""
    value = WORLDS[wildcards.world]
    for key in keys:
        value = value[key]
    return value


def model_dir(name, exp):
    """Directory of a named model: `post` (experiment `exp`'s post model, its world's by default), a
    ladder checkpoint `step~N` of its world, or a name from `models`, fetched into resources/models/.
    """
    root, _ = world_of(exp)
    if name == "post":
        name = config["experiments"][exp]["post"]
        if name == "post":
            return f"{root}/post"
    if name.startswith("step~"):
        return f"{root}/ladder/{name}"
    return f"resources/models/{name}"


def model_input(name, exp):
    """The input that model `name` is read from (a rule's params carry model_dir): its directory, or
    for a ladder checkpoint the whole ladder. One pretraining job writes the ladder, and since its length
    differs between worlds it is one directory output, inside which Snakemake sees no checkpoint.
    """
    if name.startswith("step~"):
        return f"{world_of(exp)[0]}/ladder"
    return model_dir(name, exp)


def post_dir(wildcards):
    return model_dir("post", wildcards.exp)


def old_benchmarks(exp):
    """{name: (parquet, task)} of the old-task benchmarks: an experiment's own data sets, else its tiny
    world's arithmetic benchmarks."""
    sources = config["experiments"][exp]["benchmarks"]
    if sources:
        return {
            n: (f"results/{exp}/data/sources/benchmark~{n}.parquet", s["task"])
            for n, s in sources.items()
        }
    root, world = world_of(exp)
    return {t: (f"{root}/benchmarks/{t}.parquet", "arith") for t in world["old_tasks"]}


def new_benchmark(exp):
    """(name, task) of the held-out new-task problems, `results/{exp}/data/heldout.parquet`."""
    x = config["experiments"][exp]
    if x["data"] == "knowledge":
        return "knowledge", "knowledge"
    if x["problems"]:
        return "heldout", x["problems"]["task"]
    return world_of(exp)[1]["new_task"], "arith"


def new_task(exp):
    """The task registry name grading the new-task problems of mining and trace synthesis."""
    return new_benchmark(exp)[1]


def candidates(wildcards):
    """The problems mining samples: the experiment's data set, else the tiny world's candidates."""
    if xcfg(wildcards, "problems"):
        return f"results/{wildcards.exp}/data/sources/problems.parquet"
    return f"{world_of(wildcards.exp)[0]}/candidates.parquet"


def dataset(wildcards):
    """The config of data set `wildcards.source` of an experiment: problems, retention or benchmark~N."""
    x = config["experiments"][wildcards.exp]
    name = wildcards.source
    if name.startswith("benchmark~"):
        found = (x["benchmarks"] or {}).get(name.split("~", 1)[1])
    else:
        found = {"problems": x["problems"], "retention": x["fisher"]["prompts"]}.get(
            name
        )
    if found is None:
        raise WorkflowError(
            f"experiment {wildcards.exp} configures no data set {name!r}"
        )
    return found


def method_of(donor):
    """The config section of a graft of `donor`: grafting, or merging when the donor is the post model."""
    return "merge" if donor == "post" else "graft"


def graft_keys(x, method):
    """(epoch, lam, mask, rho) of one method's grafts: unmasked first, then every mask kind x rho."""
    section, masks = x[method], x[method]["masks"]
    epochs = section["epochs"] or range(1, x["sft"]["epochs"] + 1)
    plain = [(e, lam, "none", "0") for e in epochs for lam in section["lam"]]
    masked = [
        (e, lam, kind, rho)
        for kind in masks["kinds"]
        for rho in masks["rho"]
        for e in masks["epochs"] or epochs
        for lam in masks["lam"] or section["lam"]
    ]
    return plain + masked


def runs(exp):
    """Every evaluated model of an experiment, as its key path under results/{exp}/."""
    x = config["experiments"][exp]
    evaluated_donors = x["donors"] if x["eval"]["donor_sft"] else []
    sft = [
        f"sft/{base}/lr~{lr}/epoch~{e}"
        for base in ["post"] + evaluated_donors
        for lr in x["sft"]["lr"]
        for e in range(1, x["sft"]["epochs"] + 1)
    ]
    grafts = [
        f"graft/{donor}/lr~{lr}/epoch~{e}/lam~{lam}/mask~{mask}/rho~{rho}"
        for donor in x["donors"] + ["post"]
        for lr in x["sft"]["lr"]
        for e, lam, mask, rho in graft_keys(x, method_of(donor))
    ]
    opsd = [
        f"opsd/post/alpha~{alpha}/lr~{lr}/step~{s}"
        for alpha in x["opsd"]["alpha"]
        for lr in x["opsd"]["lr"]
        for s in opsd_steps(x["opsd"])
    ]
    donors = [f"donor/{d}" for d in evaluated_donors]
    return ["post"] + donors + sft + grafts + opsd


def opsd_steps(section):
    """The steps at which an OPSD run keeps a checkpoint: `checkpoints` evenly spaced, the last at `steps`."""
    n, steps = section["checkpoints"], section["steps"]
    return [round(steps * i / n) for i in range(1, n + 1)]


def graft_fisher(wildcards):
    """The Fisher a masked graft ranks by; none for an unmasked one."""
    if wildcards.mask == "none":
        if wildcards.rho != "0":
            raise WorkflowError(
                f"an unmasked graft is mask~none/rho~0, not rho~{wildcards.rho}"
            )
        return []
    return f"results/{wildcards.exp}/fisher/post/{wildcards.mask}"


def mask_settings(wildcards):
    # Only masked grafts see the ranking settings: changing them must not re-run unmasked grafts.
    if wildcards.mask == "none":
        return {}
    masks = xcfg(wildcards, method_of(wildcards.donor), "masks")
    return {"scope": masks["scope"], "score": masks["score"]}


def eval_model(wildcards):
    """The input directory of the model behind an evaluation key, and the model inside it."""
    run = wildcards.run
    if run == "post":
        return post_dir(wildcards), post_dir(wildcards)
    if run.startswith(("sft/", "opsd/")):
        run_dir = run.rsplit("/", 1)[0]
        return f"results/{wildcards.exp}/{run_dir}", f"results/{wildcards.exp}/{run}"
    if run.startswith("graft/"):
        path = f"results/{wildcards.exp}/{run}/model"
        return path, path
    if run.startswith("donor/"):
        name = run.split("/", 1)[1]
        return model_input(name, wildcards.exp), model_dir(name, wildcards.exp)
    raise WorkflowError(
        f"no model for evaluation key {run!r}: expected post, donor/..., sft/... or graft/..."
    )


def sensitivity_runs(exp):
    """The runs whose update the sensitivity analysis measures: SFT of post, OPSD, every graft and merge."""
    return [
        run
        for run in runs(exp)
        if run != "post"
        and parse_run(run)["method"] in ("sft", "graft", "merge", "opsd")
    ]


def latency_records(wildcards):
    """Every timing record the latency analysis charges an experiment's runs with: the SFT and OPSD runs
    (their steps.jsonl), each graft's seconds and, when a graft is masked, the Fisher and its rollouts.
    """
    root, x = f"results/{wildcards.exp}", config["experiments"][wildcards.exp]
    grafts = [r for r in runs(wildcards.exp) if r.startswith("graft")]
    masks = sorted({parse_run(r)["mask"] for r in grafts} - {"none"})
    return (
        [
            f"{root}/sft/{b}/lr~{lr}"
            for b in ["post"] + x["donors"]
            for lr in x["sft"]["lr"]
        ]
        + [
            f"{root}/opsd/post/alpha~{a}/lr~{lr}"
            for a in x["opsd"]["alpha"]
            for lr in x["opsd"]["lr"]
        ]
        + [f"{root}/{r}/seconds.json" for r in grafts]
        + [f"{root}/fisher/post/{kind}" for kind in masks]
        + ([f"{root}/fisher/post/rollouts.json"] if masks else [])
    )


def on_tiny_world(exp):
    """Whether the experiment's post model and donors are its tiny world's own: the drift ratio needs the
    world's initialisation, which a real model does not come with."""
    x = config["experiments"][exp]
    return x["post"] == "post" and all(d.startswith("step~") for d in x["donors"])


def drift_updates(wildcards):
    """Each grafted donor update (donor, lr, epoch) with its directories and the post model's SFT update
    at the same lr and epoch, for the drift table."""
    exp, x = wildcards.exp, config["experiments"][wildcards.exp]
    epochs = x["graft"]["epochs"] or range(1, x["sft"]["epochs"] + 1)
    return [
        {
            "donor": d,
            "lr": lr,
            "epoch": e,
            "donor_dir": model_dir(d, exp),
            "tuned_dir": f"results/{exp}/sft/{d}/lr~{lr}/epoch~{e}",
            "post_sft_dir": f"results/{exp}/sft/post/lr~{lr}/epoch~{e}",
        }
        for d in x["donors"]
        for lr in x["sft"]["lr"]
        for e in epochs
    ]


def shows_takeover(exp):
    """Whether the experiment's old and new tasks are its tiny world's arithmetic, whose procedures tell
    apart in writing which task a model took a problem for (`graftlab.analysis.takeover`).
    """
    x = config["experiments"][exp]
    return (
        on_tiny_world(exp)
        and x["data"] != "knowledge"
        and not x["problems"]
        and not x["benchmarks"]
    )


def study_experiments():
    """Every experiment's line of the study: its group, seed, summary and (on a tiny world) drift and
    takeover tables."""
    return [
        {
            "exp": exp,
            "group": x["group"],
            "seed": x["seed"],
            "summary": f"results/{exp}/summary.parquet",
            "drift": f"results/{exp}/drift.parquet" if on_tiny_world(exp) else None,
            "takeover": (
                f"results/{exp}/takeover.parquet" if shows_takeover(exp) else None
            ),
        }
        for exp, x in config["experiments"].items()
        if exp in (config["study"]["experiments"] or config["experiments"])
    ]


def local_source(source):
    """[source] when it names a local path, else [] (a hub id): an input, so a local file or model
    another rule writes is built first, and an edited one is read again."""
    return [str(Path(source).expanduser())] if looks_local(source) else []


def eval_benchmarks(wildcards):
    """[name, parquet, role, task] of every benchmark of the experiment, old ones first."""
    old = [[n, f, "old", t] for n, (f, t) in old_benchmarks(wildcards.exp).items()]
    name, task = new_benchmark(wildcards.exp)
    return old + [[name, f"results/{wildcards.exp}/data/heldout.parquet", "new", task]]


def retention_prompts(wildcards):
    """The configured old-domain prompts; none means fresh tiny-world problems."""
    if xcfg(wildcards, "fisher", "prompts"):
        return f"results/{wildcards.exp}/data/sources/retention.parquet"
    return []
