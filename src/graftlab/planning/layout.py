"""The results tree: which runs an experiment evaluates, the key path naming each, and where its inputs lie.

A run is named by its key path under `results/{exp}/` (its evaluation under `results/{exp}/eval/`): the
method, its base model (`post` or a donor such as `step~400`), then `name~value` segments:

    post                                            the post-trained model, the reference
    donor/step~400                                  a donor as it is, before SFT     -> "donor"
                                                    (`post~N`: a post-training checkpoint)
    sft/post/lr~1e-3/epoch~2                        SFT of the post model           -> "sft"
    sft/step~400/lr~1e-3/epoch~1                    SFT of a donor                  -> "donor_sft"
    graft/step~400/lr~.../lam~.../mask~.../rho~...  a donor's update added to post  -> "graft"
    graft/post/lr~.../lam~.../mask~.../rho~...      donor == post: model merging    -> "merge"
    opsd/post/alpha~0.5/lr~1e-4/step~60             on-policy self-distillation     -> "opsd"
    grpo/post/lr~1e-4/step~40                       GRPO                            -> "grpo"
    sdpo/post/teacher~ema:0.05/lr~1e-4/step~40      SDPO, answer tokens distilled   -> "sdpo"
    sdpo_cot/post/teacher~frozen/lr~1e-4/step~40    SDPO, every token distilled     -> "sdpo_cot"

`Run.key` writes that format and `parse_run` reads it; `Experiment` lists an experiment's runs from its
resolved config. Hyperparameter values stay strings, as in the paths, so `1e-3` is never reformatted.

Standard library only: the workflow imports this module on every parse, even a dry-run's.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import NamedTuple

from graftlab.methods import METHODS, on_policy

POST = "post"
# A tiny world's own checkpoints, named `prefix~N`: by prefix, the world section whose `ladder` lists the
# steps N kept and the directory of the world they are kept in. `step~N` of pretraining (the donor ladder),
# `post~N` of post-training (the grafting paper's §5.3 donors).
WORLD_LADDERS = {"step": ("pretrain", "ladder"), "post": ("posttrain", "post_ladder")}
KEY_COLUMNS = METHODS["graft"].keys  # lr, epoch, lam, mask, rho: a column each in every summary
# The on-policy trainers of the post model: each run keeps checkpoints by step (`kept_steps`).
ON_POLICY = {m.name: m.keys for m in on_policy()}
# Keys each kind of run must carry, by its path's first segment; a path lacking one was written by another
# layout.
REQUIRED_KEYS = {m.path: m.keys for m in METHODS.values() if m.name != POST and not m.chain_only}
# The summary's old- and new-task scores with their interval bounds, and the same on the validation
# problems: no key may take one of their names.
ROLE_COLUMNS = ("old", "new", "old_lo", "old_hi", "new_lo", "new_hi")
VALIDATION_COLUMNS = tuple(c.replace("old", "old_val").replace("new", "new_val") for c in ROLE_COLUMNS)
# Key names that would overwrite a summary column of another meaning.
RESERVED = {"exp", "run", "method", "donor", *ROLE_COLUMNS, *VALIDATION_COLUMNS}
UPDATES = tuple(m.name for m in METHODS.values() if m.updates)  # runs that update the post model's weights


class Run(NamedTuple):
    """One run: its kind (the key's first segment), the model its update starts from (`post` or a donor;
    none for the post model itself) and its `name~value` keys, in path order."""

    kind: str
    donor: str | None = None
    keys: dict[str, str] = {}

    @property
    def key(self) -> str:
        """The key path, e.g. `sft/post/lr~1e-3/epoch~2`."""
        for name, value in self.keys.items():
            if not name or "~" in name or "/" in name or not value or "/" in value:
                raise ValueError(f"run {self.kind}/{self.donor}: {name}~{value} is no key segment")
        return "/".join([self.kind, *([self.donor] if self.donor else []), *(f"{k}~{v}" for k, v in self.keys.items())])


def run(kind: str, donor: str | None = None, **keys: object) -> Run:
    """A Run with its key values as the strings the path holds (an epoch 2 is `epoch~2`)."""
    return Run(kind, donor, {k: str(v) for k, v in keys.items()})


def _parse_keys(key: str, segments: list[str]) -> dict[str, str]:
    keys: dict[str, str] = {}
    for seg in segments:
        name, sep, value = seg.partition("~")
        if not sep or not name or not value:
            raise ValueError(f"run {key!r}: segment {seg!r} is not name~value")
        if name in RESERVED:
            raise ValueError(f"run {key!r}: key {name!r} clashes with a summary column")
        if name in keys:
            raise ValueError(f"run {key!r}: key {name!r} appears twice")
        keys[name] = value
    return keys


def _method(key: str, kind: str, donor: str, keyed: bool) -> str:
    if kind == "donor":
        if keyed:
            raise ValueError(f"run {key!r}: a donor as it is takes no keys")
        return "donor"
    if kind in ON_POLICY:
        if donor != POST:
            raise ValueError(f"run {key!r}: {kind} trains the post model, not {donor!r}")
        return kind
    if kind == "sft":
        return "sft" if donor == POST else "donor_sft"
    return method_of(donor)


def parse_run(key: str) -> dict[str, str | None]:
    """Method, donor (the base model: `post` or e.g. `step~400`) and each `name~value` key of a run.

    The keys lr, epoch, lam, mask and rho are always present (None where the run has none); any
    other key in the path is kept as well, so a new sweep axis reaches the summary unchanged.
    """
    segments = key.strip("/").split("/")
    kind = segments[0]
    if kind == POST:
        if len(segments) != 1:
            raise ValueError(f"run {key!r}: the post model takes no keys")
        return {"method": "post", "donor": None} | dict.fromkeys(KEY_COLUMNS)
    if kind not in REQUIRED_KEYS:
        raise ValueError(f"run {key!r}: unknown method {kind!r}; expected post, {', '.join(REQUIRED_KEYS)}")
    if len(segments) < 2:
        raise ValueError(f"run {key!r}: {kind} needs a base model segment (post or a donor)")
    donor = segments[1]
    keys = _parse_keys(key, segments[2:])
    absent = [k for k in REQUIRED_KEYS[kind] if k not in keys]
    if absent:
        raise ValueError(f"run {key!r}: {kind} lacks key(s) {absent}")
    method = _method(key, kind, donor, bool(segments[2:]))
    return {"method": method, "donor": donor} | dict.fromkeys(KEY_COLUMNS) | keys


def eval_root(metrics: str, key: str) -> str:
    """The directory holding every evaluation of an experiment, from one run's metrics.json path."""
    suffix = f"/{key}/metrics.json"
    if not metrics.endswith(suffix):
        raise ValueError(f"{metrics} is not the metrics.json of run {key!r}")
    return metrics[: -len(suffix)]


class WorldCheckpoint(NamedTuple):
    section: str  # the world's config section listing the kept steps in its `ladder`
    directory: str  # the directory under the world's results holding them
    step: int


def world_checkpoint(name: str) -> WorldCheckpoint | None:
    """What the world checkpoint `name` (`step~N`, `post~N`) is, or None when `name` names none."""
    prefix, sep, step = name.partition("~")
    canonical = step.isdigit() and str(int(step)) == step  # `step~0100` would be a second path for step 100
    if not (sep and canonical and prefix in WORLD_LADDERS):
        return None
    return WorldCheckpoint(*WORLD_LADDERS[prefix], int(step))


def method_of(donor: str) -> str:
    """The config section of a graft of `donor`: grafting, or merging when the donor is the post model."""
    return "merge" if donor == POST else "graft"


def graft_keys(x: dict, method: str) -> list[tuple]:
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


def kept_steps(section: dict) -> list[int]:
    """The steps at which an on-policy run (OPSD, GRPO, SDPO) keeps a checkpoint: `checkpoints` evenly
    spaced, the last at `steps`."""
    n, steps = section["checkpoints"], section["steps"]
    return [round(steps * i / n) for i in range(1, n + 1)]


# The `eval` settings that shape how an evaluation runs, never what it scores.
EVAL_JOB_SETTINGS = ("donor_sft", "parts", "adaptive", "adaptive_checkpoints")

# The data kinds that learn from problems mined on the post model (rules/data.smk: `mine`).
MINED = ("expert", "teacher", "star", "pedagogical")

# The settings the retention rollouts are sampled with; the Fisher's batch size is memory, not results.
ROLLOUT_KEYS = ("rollouts", "temperature", "max_new_tokens")


def fisher_name(kind: str, ekfac: bool = False, positions: str = "completion") -> str:
    """A Fisher's directory name under its retention home: the kind, and for KFAC its options (`kfac-completion`,
    `kfac-all-ekfac`), so experiments sharing rollouts but not KFAC options never share a KFAC Fisher."""
    if kind != "kfac":
        return kind
    return f"kfac-{positions}" + ("-ekfac" if ekfac else "")


def fisher_options(name: str) -> tuple[str, dict]:
    """(kind, options of `graftlab.fisher.write_fisher`) of a Fisher's directory name (`fisher_name`)."""
    kind, *rest = name.split("-")
    if kind != "kfac":
        if rest:
            raise ValueError(f"Fisher {name!r}: only KFAC takes options")
        return kind, {}
    if not rest or rest[1:] not in ([], ["ekfac"]):
        raise ValueError(f"Fisher {name!r} is not kfac-<positions>[-ekfac]")
    return kind, {"ekfac": rest[1:] == ["ekfac"], "positions": rest[0]}


def section_of(kind: str) -> str:
    """The config section of a method: `sdpo_cot` runs are configured in `sdpo`."""
    return METHODS[kind].section


def world_key(x: dict) -> str:
    """The directory under results/ of the tiny world experiment config `x` runs on."""
    return "world" if x["world"] == "world" else f"worlds/{x['world']}"


def worlds(config: dict) -> dict[str, dict]:
    """Every tiny world by its directory under results/, each a whole section with its seed: the main
    `world`, and each of `worlds`, already merged over it by the config resolution."""
    named = {f"worlds/{name}": section for name, section in config["worlds"].items()}
    return {"world": config["world"] | {"seed": config["seed"]}} | named


# The kinds of run that keep checkpoints, each evaluated with its training run's others
# (`Experiment.checkpointed`): SFT and the on-policy trainers.
TRAINED_KINDS = ("sft", *ON_POLICY)
# The rules that evaluate a training run's checkpoints are named by them (`checkpoint_rule`), with this prefix.
EVALUATE_RUN = "evaluate_run"


def checkpoint_rule(checkpoints: list[str]) -> str:
    """The rule evaluating the training runs that keep `checkpoints` (`epoch~1`, `epoch~2` ->
    `evaluate_run_epoch_1_2`): a rule's outputs are fixed but for its wildcards, so each list has a rule."""
    names = {c.split("~", 1)[0] for c in checkpoints}
    if len(names) != 1:
        raise ValueError(f"checkpoints {checkpoints} are not of one kind")
    return "_".join([EVALUATE_RUN, *names, *(c.split("~", 1)[1] for c in checkpoints)])


# A graft sweep's wildcards: every key of its grafts but lam (`Experiment.sweeps`).
SWEEP = ("donor", "lr", "epoch", "mask", "rho")


def sweep_rule(prefix: str, lams: list[str]) -> str:
    """The rule making (`graft`) or screening (`graft_screen`) the sweeps over `lams`, named by them
    (["0.25", "1"] -> `graft_lam_0p25_1`): a rule's outputs are fixed but for its wildcards, so each list of
    lam values has its rule, as each list of checkpoints does (`checkpoint_rule`)."""
    spelled = [lam.replace(".", "p").replace("-", "m").replace("+", "") for lam in lams]
    return "_".join([prefix, "lam", *spelled])


def sweep_groups(layouts: list[Experiment]) -> dict[tuple[str, ...], dict[str, list[tuple[str, ...]]]]:
    """The graft sweeps of every experiment (`Experiment.sweeps`) by their lam values: for each list,
    {experiment: [its sweeps over that list]}."""
    groups: dict[tuple[str, ...], dict[str, list[tuple[str, ...]]]] = {}
    for layout in layouts:
        for sweep, lams in layout.sweeps().items():
            groups.setdefault(tuple(lams), {}).setdefault(layout.name, []).append(sweep)
    return groups


def checkpoint_groups(layouts: list[Experiment]) -> dict[tuple[str, ...], dict[str, list[str]]]:
    """The training runs of every experiment (`Experiment.checkpointed`) by the checkpoints they keep: for each
    list, {experiment: [run keys]}."""
    groups: dict[tuple[str, ...], dict[str, list[str]]] = {}
    for layout in layouts:
        for key, checkpoints in layout.checkpointed().items():
            groups.setdefault(tuple(checkpoints), {}).setdefault(layout.name, []).append(key)
    return groups


def shared_sources(layouts) -> dict[str, tuple[str, dict]]:
    """Each data set of any experiment (`Experiment.sources`, a continual one's stages too) by its
    `source_id`: the config key of its first reader, which its errors name, and its config as read."""
    found: dict[str, tuple[str, dict]] = {}
    for layout in layouts:
        for key, source in layout.sources().items():
            found.setdefault(source_id(source), (key, source))
    return found


def shared_evaluations(layouts) -> dict[str, list[tuple[str, str]]]:
    """The evaluations that several single-domain experiments ask for alike, by a digest of their spec
    (`Experiment.eval_spec`): [(experiment, run)] for each, of two or more. Only the runs whose model lies
    outside every experiment can be: the post model and the donors as they are."""
    found: dict[str, list[tuple[str, str]]] = {}
    for layout in layouts:
        for r in layout.run_list():
            if r.kind in (POST, "donor"):
                found.setdefault(layout.eval_digest(r.key), []).append((layout.name, r.key))
    return {digest: members for digest, members in found.items() if len(members) > 1}


def mining_homes(layouts) -> dict[str, list[Experiment]]:
    """Each mining home's id (its directory under results/mined/) with the single-domain experiments that mine
    into it, in config order: the first one's settings are its job's (`Experiment.mining_home`)."""
    homes: dict[str, list[Experiment]] = {}
    for layout in layouts:
        if layout.x["data"] in MINED:
            homes.setdefault(layout.mining_home().removeprefix("results/mined/"), []).append(layout)
    return homes


def retention_homes(config: dict) -> dict[str, list[Experiment]]:
    """Each retention home's id (its directory under results/fisher/) with the experiments that share it, in
    config order: the first one's settings are its rules' (`Experiment.retention_home`)."""
    homes: dict[str, list[Experiment]] = {}
    for name in config["experiments"]:
        x = Experiment.of(config, name)
        homes.setdefault(x.retention_home().removeprefix("results/fisher/"), []).append(x)
    return homes


def study_experiments(config: dict) -> list[dict]:
    """Every experiment's line of the study: its group, seed, summary, (on a tiny world) drift and takeover
    tables, and (under adaptive sweeps) its screened-out runs, which the verdict holds its grafts to."""
    chosen = config["study"]["experiments"] or config["experiments"]
    return [
        {
            "exp": name,
            "group": x["group"],
            "seed": x["seed"],
            "summary": f"results/{name}/summary.parquet",
            "drift": f"results/{name}/drift.parquet" if on_tiny_world(x) else None,
            "takeover": f"results/{name}/takeover.parquet" if shows_takeover(x) else None,
            "screened": f"results/{name}/screened.parquet" if x["eval"]["adaptive"] else None,
        }
        for name, x in config["experiments"].items()
        if name in chosen and not x.get("stages")  # a continual experiment has no single-domain summary
    ]


def on_tiny_world(x: dict) -> bool:
    """Whether the experiment's post model and donors are its tiny world's own: the drift ratio needs the
    world's initialisation, which a real model does not come with."""
    return x["post"] == POST and all(world_checkpoint(d) for d in x["donors"])


def shows_takeover(x: dict) -> bool:
    """Whether the experiment's old and new tasks are its tiny world's arithmetic, whose procedures tell
    apart in writing which task a model took a problem for (`graftlab.analysis.takeover`)."""
    return on_tiny_world(x) and x["data"] != "knowledge" and not x["problems"] and not x["benchmarks"]


def as_read(source: dict) -> dict:
    """A data set's config as its `dataset` job reads it: a benchmark's `response_tokens` sizes jobs only,
    and changing it must not re-read the data set."""
    return {key: value for key, value in source.items() if key != "response_tokens"}


def digest(spec: dict) -> str:
    """A short digest of all a shared job is computed from: the name under which experiments that agree on
    all of it share the job (a data set's, a mining or retention home's, an evaluation's)."""
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]


# Where every configured data set is read to: results/sources/<source_id>.parquet and .json.
SOURCES_DIR = "results/sources"


def source_id(source: dict) -> str:
    """A data set's name under `SOURCES_DIR`: the last part of its `source` and a digest of all it is read
    with (`as_read`), so experiments that read the same data set share one `dataset` job, its file, and every
    job keyed by that file (a retention home's rollouts, say)."""
    read = as_read(source)
    name = str(read["source"]).rstrip("/").rsplit("/", 1)[-1]
    stem = re.sub(r"[^A-Za-z0-9_]+", "-", re.sub(r"\.(parquet|jsonl?|csv|arrow)$", "", name)).strip("-")
    return f"{stem or 'data'}-{digest(read)}"


def source_file(source: dict, suffix: str = ".parquet") -> str:
    """The problems (`.parquet`) or read statistics (`.json`) of a configured data set."""
    return f"{SOURCES_DIR}/{source_id(source)}{suffix}"


@dataclass(frozen=True)
class Experiment:
    """One experiment's runs and paths: `x` its resolved config section, `world` its tiny world's."""

    name: str
    x: dict
    world: dict

    @classmethod
    def of(cls, config: dict, name: str) -> Experiment:
        x = config["experiments"][name]
        return cls(name, x, worlds(config)[world_key(x)])

    @property
    def root(self) -> str:
        return f"results/{self.name}"

    @property
    def world_dir(self) -> str:
        return f"results/{world_key(self.x)}"

    def model_dir(self, name: str) -> str:
        """Directory of a named model: `post` (the experiment's post model, its world's by default), a
        checkpoint of its world (`step~N`, `post~N`), or a name from `models`, fetched into resources/models/.
        """
        if name == POST:
            name = self.x["post"]
            if name == POST:
                return f"{self.world_dir}/post"
        if checkpoint := world_checkpoint(name):
            return f"{self.world_dir}/{checkpoint.directory}/{name}"
        return f"resources/models/{name}"

    def model_input(self, name: str) -> str:
        """The input that model `name` is read from (a rule's params carry model_dir): its directory, or
        for a world checkpoint its whole ladder. One pretraining (post-training) job writes the ladder, and
        since its length differs between worlds it is one directory output, inside which Snakemake sees
        no checkpoint."""
        checkpoint = world_checkpoint(name)
        return f"{self.world_dir}/{checkpoint.directory}" if checkpoint else self.model_dir(name)

    @property
    def post_dir(self) -> str:
        return self.model_dir(POST)

    def run_list(self) -> list[Run]:
        """Every evaluated model: post, the donors as they are, SFT, grafts and merges, then OPSD, GRPO and SDPO."""
        x = self.x
        evaluated = x["donors"] if x["eval"]["donor_sft"] else []
        epochs = range(1, x["sft"]["epochs"] + 1)
        sft = [run("sft", b, lr=lr, epoch=e) for b in [POST, *evaluated] for lr in x["sft"]["lr"] for e in epochs]
        grafts = [
            run("graft", d, lr=lr, epoch=e, lam=lam, mask=mask, rho=rho)
            for d in [*x["donors"], POST]
            for lr in x["sft"]["lr"]
            for e, lam, mask, rho in graft_keys(x, method_of(d))
        ]
        kept = [r._replace(keys=r.keys | {"step": str(s)}) for r in self.on_policy_runs() for s in self.steps(r)]
        return [Run(POST), *(run("donor", d) for d in evaluated), *sft, *grafts, *kept]

    def checkpointed(self) -> dict[str, list[str]]:
        """Each training run whose kept checkpoints are evaluated, by its key (`sft/post/lr~1e-3`), with the
        last key segment of each checkpoint (`epoch~1`, `epoch~2`): one job evaluates them all
        (rules/evaluate.smk), paying the start-up once."""
        evaluated = self.x["donors"] if self.x["eval"]["donor_sft"] else []
        epochs = [f"epoch~{e}" for e in range(1, self.x["sft"]["epochs"] + 1)]
        sft = {run("sft", b, lr=lr).key: epochs for b in [POST, *evaluated] for lr in self.x["sft"]["lr"]}
        return sft | {r.key: [f"step~{s}" for s in self.steps(r)] for r in self.on_policy_runs()}

    def screened_trainruns(self) -> list[str]:
        """The training runs (`checkpointed`) whose checkpoints an adaptive experiment scores first on its
        screening share (`eval.adaptive_checkpoints`): SFT of the post model and the on-policy runs, the
        frontier's candidates, not the donors' SFT."""
        if not (self.x["eval"]["adaptive"] and self.x["eval"]["adaptive_checkpoints"]):
            return []
        return [key for key in self.checkpointed() if key.split("/")[1] == POST]

    def screened_checkpoints(self) -> dict[str, list[str]]:
        """The run keys of each `screened_trainruns` run's checkpoints, by the training run's key."""
        trained = self.checkpointed()
        return {key: [f"{key}/{c}" for c in trained[key]] for key in self.screened_trainruns()}

    def screenings(self) -> list[str]:
        """Every run an adaptive experiment screens (`eval.adaptive`), each a `screen/{run}/metrics.json`:
        its grafts and merges, and the checkpoints of `screened_trainruns`."""
        if not self.x["eval"]["adaptive"]:
            return []
        grafts = [r.key for r in self.run_list() if r.kind == "graft"]
        return grafts + [run for runs in self.screened_checkpoints().values() for run in runs]

    def sweeps(self) -> dict[tuple[str, ...], list[str]]:
        """Each graft sweep, its (donor, lr, epoch, mask, rho) as the path holds them (`SWEEP`), with its lam
        values in `run_list` order: the grafts of a sweep share every input but lam, so one job makes and
        scores them all (rules/graft.smk), paying its start-up and its sampling engine's once."""
        return {key: [r.keys["lam"] for r in runs] for key, runs in self.sweep_runs().items()}

    def sweep_runs(self) -> dict[tuple[str, ...], list[Run]]:
        """The grafts of each sweep (`sweeps`), by the sweep's (donor, lr, epoch, mask, rho)."""
        swept: dict[tuple[str, ...], list[Run]] = {}
        for r in self.run_list():
            if r.kind == "graft":
                swept.setdefault((r.donor, *(r.keys[k] for k in SWEEP[1:])), []).append(r)
        return swept

    def on_policy_runs(self) -> list[Run]:
        """Every on-policy training run (a directory of checkpoints), without its step key, in method order."""
        return [run(m.name, POST, **keys) for m in on_policy() for keys in m.spec.runs(self.x[m.section])]

    def steps(self, r: Run) -> list[int]:
        """The kept checkpoints of an on-policy run."""
        return kept_steps(self.x[section_of(r.kind)])

    def runs(self) -> list[str]:
        """Every evaluated model as its key path under results/{exp}/."""
        return [r.key for r in self.run_list()]

    def eval_metrics(self) -> list[str]:
        """The metrics.json of every run, in the order of `runs`."""
        return [f"{self.root}/eval/{key}/metrics.json" for key in self.runs()]

    def sensitivity_runs(self) -> list[str]:
        """The runs whose update the sensitivity analysis measures: SFT of post, the on-policy runs, every
        graft and merge."""
        return [key for key in self.runs() if parse_run(key)["method"] in UPDATES]

    def sft_dirs(self) -> list[str]:
        """The SFT run directories (a checkpoint per epoch) of the post model and of every donor."""
        x = self.x
        return [f"{self.root}/{run('sft', b, lr=lr).key}" for b in [POST, *x["donors"]] for lr in x["sft"]["lr"]]

    def on_policy_dirs(self) -> list[str]:
        return [f"{self.root}/{r.key}" for r in self.on_policy_runs()]

    def latency_records(self) -> list[str]:
        """Every timing record the latency analysis charges the runs with: the SFT and on-policy runs (their
        steps.jsonl), each graft's seconds and, when a graft is masked, the Fisher and its rollouts."""
        grafts = [r for r in self.run_list() if r.kind == "graft"]
        masks = self.mask_kinds()
        fisher = [self.fisher_dir(kind) for kind in masks]
        rollouts = [f"{self.retention_home()}/rollouts.json"] if masks else []
        seconds = [f"{self.root}/{r.key}/seconds.json" for r in grafts]
        return self.sft_dirs() + self.on_policy_dirs() + seconds + fisher + rollouts

    def drift_updates(self) -> list[dict]:
        """Each grafted donor update (donor, lr, epoch) with its directories and the post model's SFT
        update at the same lr and epoch, for the drift table."""
        x = self.x
        epochs = x["graft"]["epochs"] or range(1, x["sft"]["epochs"] + 1)
        return [
            {
                "donor": d,
                "lr": lr,
                "epoch": e,
                "donor_dir": self.model_dir(d),
                "tuned_dir": f"{self.root}/{run('sft', d, lr=lr, epoch=e).key}",
                "post_sft_dir": f"{self.root}/{run('sft', POST, lr=lr, epoch=e).key}",
            }
            for d in x["donors"]
            for lr in x["sft"]["lr"]
            for e in epochs
        ]

    def eval_model(self, key: str) -> tuple[str, str]:
        """The input directory of the model behind an evaluation key, and the model inside it."""
        kind = key.split("/", 1)[0]
        if key == POST:
            return self.post_dir, self.post_dir
        if kind == "sft" or kind in ON_POLICY:
            return f"{self.root}/{key.rsplit('/', 1)[0]}", f"{self.root}/{key}"
        if kind == "graft":
            model = f"{self.root}/{key}/model"
            return model, model
        if kind == "donor":
            name = key.split("/", 1)[1]
            return self.model_input(name), self.model_dir(name)
        raise ValueError(f"no model for evaluation key {key!r}: expected post, donor/..., sft/... or graft/...")

    def eval_spec(self, key: str) -> dict:
        """What run `key`'s evaluation is computed from: its model, the benchmarks, the settings that shape its
        scores and the seed (its job's inputs and params, less the sampling backend and `EVAL_JOB_SETTINGS`)."""
        scoring = {k: v for k, v in self.x["eval"].items() if k not in EVAL_JOB_SETTINGS}
        return {
            "run": key,
            "model": self.eval_model(key)[1],
            "benchmarks": self.eval_benchmarks(),
            "eval": scoring,
            "seed": self.x["seed"],
        }

    def eval_digest(self, key: str) -> str:
        """A digest of run `key`'s `eval_spec`: equal for the evaluations that are one computation."""
        return digest(self.eval_spec(key))

    def _home(self, where: str, spec: dict) -> str:
        """`where/<post model>-<digest of spec>`: the directory of a job the post model's experiments share."""
        model = self.post_dir.removeprefix("results/").removeprefix("resources/models/").replace("/", "-")
        return f"{where}/{model}-{digest(spec)}"

    def retention_home(self) -> str:
        """The directory of the post model's retention rollouts and Fishers, `results/fisher/<model>-<digest>`,
        keyed by all they are computed from: the model, the benchmarks the fresh prompts avoid, the configured
        prompts, the old tasks, the sampling settings and the seed. Experiments that agree on all of it share
        one computation; a change to any of it makes a new home (`retention_spec`)."""
        return self._home("results/fisher", self.retention_spec())

    def retention_spec(self) -> dict:
        """What the retention rollouts are computed from (the rollouts rule's inputs and params, less the
        sampling backend, which changes no sample's distribution)."""
        f = self.x["fisher"]
        return {
            "model": self.post_dir,
            "benchmarks": [file for file, _ in self.old_benchmarks().values()],
            "prompts": self.retention_prompts() or None,
            "tasks": list(self.world["old_tasks"]),
            "rollouts": {k: f[k] for k in ROLLOUT_KEYS},
            "seed": self.x["seed"],
        }

    def mask_kinds(self) -> list[str]:
        """The Fisher kinds the experiment's masked grafts and merges rank by."""
        return sorted({r.keys["mask"] for r in self.run_list() if r.kind == "graft"} - {"none"})

    def fisher_dir(self, kind: str) -> str:
        """The post model's retention Fisher of `kind` (`fisher_name`)."""
        f = self.x["fisher"]
        return f"{self.retention_home()}/{fisher_name(kind, f['ekfac'], f['kfac_positions'])}"

    def graft_fisher(self, mask: str, rho: str) -> str | list:
        """The Fisher a masked graft ranks by; none for an unmasked one."""
        if mask != "none":
            return self.fisher_dir(mask)
        if rho != "0":
            raise ValueError(f"an unmasked graft is mask~none/rho~0, not rho~{rho}")
        return []

    def mask_settings(self, donor: str, mask: str) -> dict:
        # Only masked grafts see the ranking settings: changing them must not re-run unmasked grafts.
        if mask == "none":
            return {}
        masks = self.x[method_of(donor)]["masks"]
        return {"scope": masks["scope"], "score": masks["score"]}

    def old_benchmarks(self) -> dict[str, tuple[str, str]]:
        """{name: (parquet, task)} of the old-task benchmarks: the experiment's own data sets, else its
        tiny world's arithmetic benchmarks."""
        if sources := self.x["benchmarks"]:
            return {n: (source_file(s), s["task"]) for n, s in sources.items()}
        return {t: (f"{self.world_dir}/benchmarks/{t}.parquet", "arith") for t in self.world["old_tasks"]}

    def new_benchmark(self) -> tuple[str, str]:
        """(name, task) of the held-out new-task problems (`new_data("heldout")`)."""
        if self.x["data"] == "knowledge":
            return "knowledge", "knowledge"
        if self.x["problems"]:
            return "heldout", self.x["problems"]["task"]
        return self.world["new_task"], "arith"

    @property
    def new_task(self) -> str:
        """The task registry name grading the new-task problems of mining and trace synthesis."""
        return self.new_benchmark()[1]

    def eval_benchmarks(self) -> list[list[str]]:
        """[name, parquet, role, task] of every benchmark, old ones first."""
        old = [[n, f, "old", t] for n, (f, t) in self.old_benchmarks().items()]
        name, task = self.new_benchmark()
        return old + [[name, self.new_data("heldout"), "new", task]]

    def new_data(self, part: str) -> str:
        """The new-task problems trained on (`train`) or held out (`heldout`): mined ones in their mining
        home, shared by every experiment that mines alike (`mining_home`); a knowledge world's its own."""
        if self.x["data"] in MINED:
            return f"{self.mining_home()}/{part}.parquet"
        return f"{self.root}/data/{part}.parquet"

    def mining_home(self) -> str:
        """The directory of the problems mined on the post model, `results/mined/<model>-<digest>`, keyed by all
        they are mined from: the model, the candidates, the benchmarks a candidate must not leak from, the
        mining settings, the task grading them and the seed. Experiments that agree on all of it share one
        mining job (star, teacher and pedagogical experiments over one data set, say)."""
        spec = {
            "model": self.post_dir,
            "candidates": self.candidates(),
            "benchmarks": [file for file, _ in self.old_benchmarks().values()],
            "mining": self.x["mining"],
            "task": self.new_task,
            "seed": self.x["seed"],
        }
        return self._home("results/mined", spec)

    def candidates(self) -> str:
        """The problems mining samples: the experiment's data set, else the tiny world's candidates."""
        if self.x["problems"]:
            return source_file(self.x["problems"])
        return f"{self.world_dir}/candidates.parquet"

    def retention_prompts(self) -> str | list:
        """The configured old-domain prompts; none means fresh tiny-world problems."""
        return source_file(self.x["fisher"]["prompts"]) if self.x["fisher"]["prompts"] else []

    def sources(self) -> dict[str, dict]:
        """Every data set the experiment reads, by its config key (`experiments.<name>.problems`), as read."""
        named = {"problems": self.x["problems"], "fisher.prompts": self.x["fisher"]["prompts"]}
        named |= {f"benchmarks.{n}": s for n, s in (self.x["benchmarks"] or {}).items()}
        return {f"experiments.{self.name}.{key}": as_read(s) for key, s in named.items() if s}
