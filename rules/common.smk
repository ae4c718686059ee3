from pathlib import Path

from graftlab.config import ConfigError, load_schema, resolve
from graftlab.fetch import looks_local
from graftlab.fisher import KINDS as FISHER_KINDS
from graftlab.layout import Experiment, opsd_steps, study_experiments, worlds

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
# Every tiny world by its directory under results/ (the `{world}` wildcard of rules/world.smk).
WORLDS = worlds(config)
# Which runs each experiment evaluates and where their inputs lie: graftlab.layout, unit-tested there.
LAYOUTS = {exp: Experiment.of(config, exp) for exp in EXPERIMENTS}

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


wildcard_constraints:
    exp="|".join(EXPERIMENTS),
    world="|".join(WORLDS),
    donor="|".join(["post", "step~[0-9]+"] + list(MODELS)),
    lr="[^/]+",
    epoch="[0-9]+",
    lam="[^/]+",
    alpha="[^/]+",
    mask="|".join(("none",) + FISHER_KINDS),
    rho="[^/]+",


def layout(wildcards):
    """The runs and paths of the experiment a job belongs to (graftlab.layout.Experiment)."""
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


def local_source(source):
    """[source] when it names a local path, else [] (a hub id): an input, so a local file or model
    another rule writes is built first, and an edited one is read again."""
    return [str(Path(source).expanduser())] if looks_local(source) else []
