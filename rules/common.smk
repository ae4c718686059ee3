from pathlib import Path

from graftlab.analysis.summary import parse_run
from graftlab.config import ConfigError, load_schema, resolve
from graftlab.fisher import KINDS as FISHER_KINDS

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
WORLD = "results/world"
OLD_TASKS = config["world"]["old_tasks"]
NEW_TASK = config["world"]["new_task"]
LADDER = [
    f"step~{s}" for s in config["world"]["pretrain"]["ladder"]
]  # increasing: validated


wildcard_constraints:
    exp="|".join(EXPERIMENTS),
    base="post|step~[0-9]+",
    donor="post|step~[0-9]+",
    lr="[^/]+",
    e="[0-9]+",
    lam="[^/]+",
    kind="|".join(FISHER_KINDS),
    mask="|".join(("none",) + FISHER_KINDS),
    rho="[^/]+",


def xcfg(wildcards, *keys):
    """One experiment's setting, e.g. xcfg(wildcards, "sft", "epochs")."""
    value = config["experiments"][wildcards.exp]
    for key in keys:
        value = value[key]
    return value


def model_dir(name):
    """Directory of a named model of the tiny world: `post`, or a ladder checkpoint `step~N`."""
    return f"{WORLD}/post" if name == "post" else f"{WORLD}/ladder/{name}"


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
    sft = [
        f"sft/{base}/lr~{lr}/epoch~{e}"
        for base in ["post"] + (x["donors"] if x["eval"]["donor_sft"] else [])
        for lr in x["sft"]["lr"]
        for e in range(1, x["sft"]["epochs"] + 1)
    ]
    grafts = [
        f"graft/{donor}/lr~{lr}/epoch~{e}/lam~{lam}/mask~{mask}/rho~{rho}"
        for donor in x["donors"] + ["post"]
        for lr in x["sft"]["lr"]
        for e, lam, mask, rho in graft_keys(x, method_of(donor))
    ]
    return ["post"] + sft + grafts


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
        return model_dir("post"), model_dir("post")
    if run.startswith("sft/"):
        run_dir = run.rsplit("/", 1)[0]
        return f"results/{wildcards.exp}/{run_dir}", f"results/{wildcards.exp}/{run}"
    if run.startswith("graft/"):
        path = f"results/{wildcards.exp}/{run}/model"
        return path, path
    raise WorkflowError(
        f"no model for evaluation key {run!r}: expected post, sft/... or graft/..."
    )


def sensitivity_runs(exp):
    """The runs whose update the sensitivity analysis measures: SFT of post, every graft and merge."""
    return [
        run
        for run in runs(exp)
        if run != "post" and parse_run(run)["method"] in ("sft", "graft", "merge")
    ]
