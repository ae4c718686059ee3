"""A continual experiment's chains: each method trained stage after stage, and where every model lies.

An experiment with `stages` (issue 17, `docs/continual.md`) trains each method as one chain of cached jobs:
the model after stage k is trained from the same chain's model after stage k-1 (stage 0 is the post
model), so changing stage k's settings re-runs stages k and later of every chain, and nothing before.

    results/{exp}/stage~{k}/data/                           the stage's problems with their traces (SFT data;
                                                            `star.parquet` for a star stage), held-out
                                                            problems, facts
    results/{exp}/chain/sft/{base}/lr~L/stage~{k}/          SFT from the chain's stage k-1 (`epoch~e` inside);
                                                            base `post` is the SFT method, a donor the
                                                            graft_cumulative donor's own chain
    results/{exp}/chain/tune/{donor}/lr~L/stage~{k}/        the fixed donor tuned on stage k alone (graft_chain)
    results/{exp}/chain/graft_chain/{donor}/lr~L/lam~../mask~../rho~../stage~{k}/model
    results/{exp}/chain/graft_cumulative/.../stage~{k}/model
    results/{exp}/chain/merge_chain/post/lr~L/lam~../mask~../rho~../stage~{k}/model
    results/{exp}/chain/merge_chain/.../stage~{k}/sft/      the merge chain's SFT from its own stage k-1 model
    results/{exp}/chain/opsd/post/alpha~A/lr~L/stage~{k}/   on-policy chains, `step~S` inside; an EMA
    results/{exp}/chain/grpo/post/lr~L/stage~{k}/           SDPO teacher is kept beside, in `teacher/`,
    results/{exp}/chain/sdpo/post/teacher~T/lr~L/stage~{k}/ for the next stage to carry on with
    results/{exp}/eval/chain/<chain>/stage~{k}/metrics.json

A stage is also a single-domain experiment (`Continual.stage_view`): its data, epochs and steps laid over the
experiment's sections, so the SLURM sizing and the trainers' settings read one section per stage.

Standard library only, like `graftlab.planning.layout`: the workflow imports it on every parse.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import NamedTuple

from graftlab.methods import METHODS, on_policy, sections
from graftlab.methods.sdpo import parse_schedule
from graftlab.planning.layout import POST, Experiment, as_read, kept_steps, run, section_of, source_file

# The methods of a continual experiment, in the order tables and plots list them.
CHAIN_KINDS = tuple(m.name for m in METHODS.values() if m.chained)
# The graft forms (`continual.graft_forms`), each the name of its chains' method.
GRAFT_FORMS = {m.form: m.name for m in METHODS.values() if m.form}
MERGE_CHAIN = "merge_chain"  # the form whose donor is the chain's own current model
ON_POLICY = tuple(m.name for m in on_policy())
KNOWLEDGE = "knowledge"


class Chain(NamedTuple):
    """One method's chain: its kind, the model its updates start from, its keys (no stage)."""

    kind: str
    base: str
    keys: dict[str, str]

    @property
    def key(self) -> str:
        """The chain's path under `chain/`, e.g. `sdpo/post/teacher~ema:0.05/lr~1e-4`."""
        return run(self.kind, self.base, **self.keys).key

    @property
    def label(self) -> str:
        """The method as tables name it: the kind, with its teacher for SDPO (`sdpo:ema:0.05`)."""
        return f"{self.kind}:{self.keys['teacher']}" if "teacher" in self.keys else self.kind


def parse_chain(key: str) -> tuple[Chain, int]:
    """(chain, stage) of an evaluation key `chain/<kind>/<base>/<keys...>/stage~k`."""
    parts = key.strip("/").split("/")
    if len(parts) < 4 or parts[0] != "chain" or not parts[-1].startswith("stage~"):
        raise ValueError(f"{key!r} is no continual run: expected chain/<method>/<base>/<keys>/stage~k")
    keys = dict(seg.split("~", 1) for seg in parts[3:-1])
    return Chain(parts[1], parts[2], keys), int(parts[-1].split("~", 1)[1])


def parse_eval_key(key: str) -> tuple[Chain, int, int | None]:
    """(chain, stage, step) of an evaluation key: a stage's model `chain/.../stage~k` (step None), or an earlier
    kept checkpoint of an on-policy stage, `chain/.../stage~k/step~s`."""
    head, last = key.strip("/").rsplit("/", 1)
    if last.startswith("step~"):
        return (*parse_chain(head), int(last.split("~", 1)[1]))
    return (*parse_chain(key), None)


def stage_data_kind(stage: dict) -> str:
    """The stage's data setting: its `data`, else knowledge for the knowledge domain and expert otherwise."""
    return stage["data"] or (KNOWLEDGE if stage["domain"] == KNOWLEDGE else "expert")


@dataclass(frozen=True)
class Continual:
    """A continual experiment's chains and paths: `x` its resolved config section, `world` its world's."""

    name: str
    x: dict
    world: dict

    @classmethod
    def of(cls, config: dict, name: str) -> Continual:
        base = Experiment.of(config, name)
        return cls(name, base.x, base.world)

    @property
    def base(self) -> Experiment:
        """The experiment as a single-domain one: its post model, donors, world and old benchmarks."""
        return Experiment(self.name, self.x, self.world)

    @property
    def root(self) -> str:
        return f"results/{self.name}"

    @property
    def post_dir(self) -> str:
        return self.base.post_dir

    def model_dir(self, name: str) -> str:
        return self.base.model_dir(name)

    def model_input(self, name: str) -> str:
        return self.base.model_input(name)

    def old_benchmarks(self) -> dict[str, tuple[str, str]]:
        return self.base.old_benchmarks()

    def retention_prompts(self) -> str | list:
        return self.base.retention_prompts()

    def sources(self) -> dict[str, dict]:
        """Every data set the experiment reads (`Experiment.sources`), each stage's problems and benchmark too."""
        stages = {
            f"experiments.{self.name}.stages.{i}.{part}": as_read(stage[part])
            for i, stage in enumerate(self.stages)
            for part in ("problems", "benchmark")
            if stage[part]
        }
        return self.base.sources() | stages

    @property
    def stages(self) -> list[dict]:
        return self.x["stages"]

    def stage(self, k: int) -> dict:
        if not 1 <= k <= len(self.stages):
            raise ValueError(f"experiment {self.name} has stages 1..{len(self.stages)}, not {k}")
        return self.stages[k - 1]

    def domain(self, k: int) -> str:
        return self.stage(k)["domain"]

    def stage_data(self, k: int, name: str = "") -> str:
        """The stage's data directory, or a file in it (`sft.parquet`, `heldout.parquet`, `facts.parquet`)."""
        root = f"{self.root}/stage~{k}/data"
        return f"{root}/{name}" if name else root

    def sft_data(self, k: int) -> str:
        """What SFT learns in stage k: the stage's traces, or for a `star` stage the post model's own."""
        name = "star.parquet" if stage_data_kind(self.stage(k)) == "star" else "sft.parquet"
        return self.stage_data(k, name)

    def epochs(self, k: int) -> int:
        return self.stage(k)["epochs"] or self.x["sft"]["epochs"]

    def section(self, kind: str, k: int) -> dict:
        """An on-policy method's config section in stage k: the stage's steps over the method's."""
        section = self.x[section_of(kind)]
        steps = self.stage(k)["steps"]
        return section | {"steps": steps} if steps else section

    def last_step(self, kind: str, k: int) -> int:
        return kept_steps(self.section(kind, k))[-1]

    def chains(self) -> list[Chain]:
        """Every method's chain: SFT, each graft form, then each on-policy method's (`graftlab.methods`)."""
        x = self.x
        lrs = x["sft"]["lr"]
        sft = [Chain("sft", POST, {"lr": lr}) for lr in lrs]
        grafts = [
            Chain(kind, d, {"lr": lr, "lam": lam, "mask": mask, "rho": rho})
            for kind in (GRAFT_FORMS[form] for form in x["continual"]["graft_forms"])
            for d in ([POST] if kind == MERGE_CHAIN else x["donors"])
            for lr in lrs
            for lam, mask, rho in self.graft_settings(METHODS[kind].section)
        ]
        trained = [Chain(m.name, POST, keys) for m in on_policy() for keys in m.spec.runs(x[m.section])]
        return sft + grafts + trained

    def graft_settings(self, section: str = "graft") -> list[tuple[str, str, str]]:
        """(lam, mask, rho) of the graft chains (the merge chains: `section` merge): every lam unmasked, then
        every mask kind x rho x lam."""
        g, masks = self.x[section], self.x[section]["masks"]
        plain = [(lam, "none", "0") for lam in g["lam"]]
        return plain + [
            (lam, kind, rho) for kind in masks["kinds"] for rho in masks["rho"] for lam in masks["lam"] or g["lam"]
        ]

    def stage_dir(self, chain: Chain, k: int) -> str:
        return f"{self.root}/chain/{chain.key}/stage~{k}"

    def stage_model(self, chain: Chain, k: int) -> tuple[str, str]:
        """(input, model directory) of the chain's model after stage k; stage 0 is its starting model.
        The input is the directory a job writes (an SFT or on-policy stage holds its checkpoints inside)."""
        if k == 0:
            start = chain.base if chain.kind == "sft" else POST
            return self.model_input(start), self.model_dir(start)
        out = self.stage_dir(chain, k)
        if chain.kind == "sft":
            return out, f"{out}/epoch~{self.epochs(k)}"
        if chain.kind in ON_POLICY:
            return out, f"{out}/step~{self.last_step(chain.kind, k)}"
        return f"{out}/model", f"{out}/model"

    def tune_dir(self, donor: str, lr: str, k: int) -> str:
        """The fixed donor tuned on stage k's data alone: graft_chain's update at stage k."""
        return f"{self.root}/chain/tune/{donor}/lr~{lr}/stage~{k}"

    def merge_sft_dir(self, chain: Chain, k: int) -> str:
        """A merge chain's SFT at stage k, from its own model after stage k-1 (`epoch~e` inside)."""
        return f"{self.stage_dir(chain, k)}/sft"

    def donor_pair(self, chain: Chain, k: int) -> tuple[tuple[str, str], tuple[str, str]]:
        """((input, model) of the donor before, (input, model) after) the update a graft chain adds at stage k.
        graft_chain: the fixed donor and its tuning on stage k alone. graft_cumulative: the donor's own SFT
        chain at stages k-1 and k, so only the new part of its update is added. merge_chain: the chain's own
        model after stage k-1 and its SFT on stage k."""
        lr, donor = chain.keys["lr"], chain.base
        last = f"epoch~{self.epochs(k)}"
        if chain.kind == "graft_chain":
            tuned = self.tune_dir(donor, lr, k)
            return (self.model_input(donor), self.model_dir(donor)), (tuned, f"{tuned}/{last}")
        if chain.kind == MERGE_CHAIN:
            tuned = self.merge_sft_dir(chain, k)
            return self.stage_model(chain, k - 1), (tuned, f"{tuned}/{last}")
        donor_chain = Chain("sft", donor, {"lr": lr})
        return self.stage_model(donor_chain, k - 1), self.stage_model(donor_chain, k)

    def teacher_start(self, chain: Chain, k: int) -> str | None:
        """The model an SDPO stage's teacher starts from: frozen, the post model all along; EMA, the teacher the
        previous stage left (`teacher/`); refresh (StableSDPO, S-SDPO with refresh:1), None: the student at the
        stage's start, since a refresh point falls at every stage start (a hard one, whatever a soft refresh's
        gamma: its blend applies within a stage)."""
        kind = parse_schedule(chain.keys["teacher"]).kind
        if kind == "refresh":
            return None
        if kind == "frozen" or k == 1:
            return self.post_dir
        return f"{self.stage_dir(chain, k - 1)}/teacher"

    def keeps_teacher(self, chain: Chain) -> bool:
        """Whether a stage writes its final teacher for the next stage: an SDPO stage's EMA teacher only."""
        method = METHODS[chain.kind]
        return method.on_policy and method.spec.keeps_teacher(chain.keys)

    def retention(self, k: int) -> tuple[list[str], list[str]]:
        """(tasks, files to exclude) of the retention rollouts of a model after stage k-1: fresh problems of
        the old tasks and of every earlier tiny-world stage, none from a benchmark."""
        earlier = [self.stage(j) for j in range(1, k)]
        tasks = list(self.world["old_tasks"]) + [
            s["domain"] for s in earlier if stage_data_kind(s) == "expert" and not s["problems"]
        ]
        files = [f for _, f, _, _ in self.eval_benchmarks()]
        return tasks, files

    def eval_keys(self) -> list[str]:
        """Every evaluated model: the post model (stage 0), each chain after each stage, then the earlier kept
        checkpoints of the on-policy stages."""
        stages = [f"chain/{c.key}/stage~{k}" for c in self.chains() for k in self.stage_numbers()]
        return [POST, *stages, *self.checkpoint_keys()]

    def checkpoint_keys(self) -> list[str]:
        """The kept checkpoints before the last of every on-policy stage (`checkpoints` > 1 in its section):
        scored too, for KL against forgetting across checkpoints."""
        return [
            f"chain/{c.key}/stage~{k}/step~{s}"
            for c in self.chains()
            if c.kind in ON_POLICY
            for k in self.stage_numbers()
            for s in kept_steps(self.section(c.kind, k))[:-1]
        ]

    def eval_metrics(self) -> list[str]:
        return [f"{self.root}/eval/{key}/metrics.json" for key in self.eval_keys()]

    def eval_model(self, key: str) -> tuple[str, str]:
        if key == POST:
            return self.post_dir, self.post_dir
        chain, k, step = parse_eval_key(key)
        if step is None:
            return self.stage_model(chain, k)
        return self.stage_dir(chain, k), f"{self.stage_dir(chain, k)}/step~{step}"

    def stage_benchmark(self, k: int) -> tuple[str, str, str]:
        """(name, parquet, task) of stage k's benchmark: its data set's, else its held-out problems."""
        stage = self.stage(k)
        task = (stage["problems"] or stage["benchmark"] or {}).get("task") or stage_data_kind(stage)
        task = "arith" if task == "expert" else task  # a tiny-world operation is graded as arithmetic
        if stage["benchmark"]:
            return stage["domain"], source_file(stage["benchmark"]), task
        return stage["domain"], self.stage_data(k, "heldout.parquet"), task

    def eval_benchmarks(self) -> list[list[str]]:
        """[name, parquet, role, task]: the old benchmarks, then each stage's (role `new`)."""
        old = [[n, f, "old", t] for n, (f, t) in self.old_benchmarks().items()]
        return old + [[n, f, "new", t] for n, f, t in map(self.stage_benchmark, range(1, len(self.stages) + 1))]

    def stage_numbers(self) -> range:
        return range(1, len(self.stages) + 1)

    def model_inputs(self) -> list[str]:
        """The directory of every chain's model after every stage (what the drift analyses read)."""
        return sorted({self.stage_model(c, k)[0] for c in self.chains() for k in self.stage_numbers()})

    def results_spec(self) -> list[dict]:
        """Each chain with its stages' evaluation directories and training logs (None for SFT and grafts),
        for `graftlab.analysis.continual_results`."""

        def log(c: Chain, k: int) -> str | None:
            return f"{self.stage_dir(c, k)}/steps.jsonl" if c.kind in ON_POLICY else None

        return [
            {
                "label": c.label,
                "chain": c.key,
                "stages": [
                    {
                        "stage": k,
                        "eval_dir": f"{self.root}/eval/chain/{c.key}/stage~{k}",
                        "log": log(c, k),
                        "model": self.stage_model(c, k)[1],
                    }
                    for k in self.stage_numbers()
                ],
            }
            for c in self.chains()
        ]

    def probe_benchmarks(self) -> list[dict]:
        """[{name, path, task, stage}] of every benchmark, stage None for an old one (response drift, KL)."""
        old = [{"name": n, "path": f, "task": t, "stage": None} for n, (f, t) in self.old_benchmarks().items()]
        return old + [
            {"name": n, "path": f, "task": t, "stage": k}
            for k in self.stage_numbers()
            for n, f, t in [self.stage_benchmark(k)]
        ]

    def checkpoint_spec(self) -> list[dict]:
        """Every scored checkpoint before a stage's last, for KL against forgetting: chain, stage, step, its
        evaluation directory and model."""
        return [
            {"chain": chain.key, "stage": k, "step": step, "eval_dir": f"{self.root}/eval/{key}", "model": model}
            for key in self.checkpoint_keys()
            for (chain, k, step), (_, model) in [(parse_eval_key(key), self.eval_model(key))]
        ]

    def drift_pairs(self) -> list[dict]:
        """Every chain's model after every stage against the stage's starting model and against the post model,
        each with the `inputs` holding its two models."""
        return [
            {
                "method": c.label,
                "chain": c.key,
                "stage": k,
                "against": against,
                "base": base[1],
                "model": self.stage_model(c, k)[1],
                "inputs": [self.stage_model(c, k)[0], base[0]],
            }
            for c in self.chains()
            for k in self.stage_numbers()
            for against, base in (("stage_start", self.stage_model(c, k - 1)), ("post", (self.post_dir,) * 2))
        ]

    def stage_drift_pairs(self, chain: str, k: int) -> list[dict]:
        """The drift pairs (`drift_pairs`) of chain `chain`'s model after stage k: one job's (rule stage_drift)."""
        pairs = [pair for pair in self.drift_pairs() if pair["chain"] == chain and pair["stage"] == k]
        if not pairs:
            raise ValueError(f"{self.name}: no chain {chain!r} at stage {k}")
        return pairs

    def stage_view(self, k: int) -> Experiment:
        """Stage k as a single-domain experiment: its data setting, problems, knowledge world, SFT epochs and
        on-policy steps over the experiment's sections (what the sizing and the cost model read)."""
        stage, x = self.stage(k), copy.deepcopy(self.x)
        x["data"] = stage_data_kind(stage)
        x["problems"] = stage["problems"]
        x["knowledge"] = stage["knowledge"]
        x["sft"]["epochs"] = self.epochs(k)
        x["mining"]["heldout"] = stage["heldout"]
        for section in sections(on_policy()):
            x[section] = self.section(section, k)
        return Experiment(self.name, x, self.world)


def is_continual(x: dict) -> bool:
    return bool(x.get("stages"))
