"""Every method graftlab runs, one entry each: `METHODS[name]`.

An entry says what the rest of the package needs to know of a method: the config section holding its
settings and the torch-free spec that checks it (`graftlab.methods.spec`), the fields of its run keys, the
workflow rule that trains it and the one that chains it across continual stages, its trainer, and how
tables and plots name and draw it. The planning modules (layout, chains, plan, work, resources, config)
and the analyses read it, so a new method is an entry here, a spec, a trainer, a workflow script and its
rules (docs/extending.md), and no list of methods anywhere else.

`name` is what a run's key path starts with and what the summary's `method` column holds: `sft` of a
donor is `donor_sft`, and a graft whose donor is the post model is a `merge` (`graftlab.planning.layout`).

Standard library only: the workflow imports it on every parse.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from graftlab.methods.grpo import GrpoSpec
from graftlab.methods.opsd import OpsdSpec
from graftlab.methods.sdpo import SdpoSpec
from graftlab.methods.spec import OnPolicySpec, Spec, TrainerSpec


class GraftSpec(Spec):
    """A graft's or a merge's section: scales lam and, for masked ones, the masked shares rho."""

    sweeps = ("lam", "masks.rho")

    def __init__(self, section: str) -> None:
        self.section = section

    def check(self, section: dict) -> list[str]:
        wide = [r for r in section["masks"]["rho"] if float(r) > 1]
        return [f"masks.rho: {wide} outside [0, 1]: rho is the fraction of the update masked"] if wide else []


class SftSpec(TrainerSpec):
    section = "sft"


@dataclass(frozen=True)
class Method:
    """One method: how the workflow trains it, keys its runs and draws it."""

    name: str
    label: str  # its legend entry in plots
    short: str  # its name in tables and compact labels
    style: dict = field(default_factory=dict)  # its markers (matplotlib scatter keywords)
    section: str | None = None  # the experiment's config section of its settings
    spec: Spec | None = None
    rule: str | None = None  # the workflow rule that makes its runs
    chain_rule: str | None = None  # the rule that makes a continual chain's stage of it
    chain_wildcard: str | None = None  # the chain rule's wildcard naming the kind, where it serves several
    trainer: str | None = None  # "module:function", its training entry point
    updates: bool = False  # its runs are updates of the post model's weights (the sensitivity analysis)
    ingredient: bool = False  # a graft's ingredient (a donor before and after SFT), not a frontier candidate
    chained: bool = False  # a continual experiment trains it as a chain of stages
    kind: str | None = None  # its runs' key paths' first segment, where not its name (a merge is a graft)
    form: str | None = None  # a graft chain's name in `continual.graft_forms`
    run_keys: tuple[str, ...] = ()  # the fields of its runs' keys, an on-policy method's from its spec

    @property
    def on_policy(self) -> bool:
        return isinstance(self.spec, OnPolicySpec)

    @property
    def path(self) -> str:
        """The first segment of its runs' key paths (`graftlab.planning.layout`)."""
        return self.kind or self.name

    @property
    def grafts(self) -> bool:
        """Its runs add a scaled SFT update to the post model (a graft, or a merge): keyed by `lam`."""
        return "lam" in self.keys

    @property
    def chain_only(self) -> bool:
        """A continual experiment's method with no single-domain run (a graft chain's form)."""
        return self.chain_rule is not None and self.rule is None

    @property
    def keys(self) -> tuple[str, ...]:
        """The run key's fields after the base model, in path order; an on-policy run's end with `step`."""
        return (*self.spec.keys, "step") if self.on_policy else self.run_keys


_FAINT = {"color": "0.6", "alpha": 0.5}
_SFT_KEYS = ("lr", "epoch")
_GRAFT_KEYS = ("lr", "epoch", "lam", "mask", "rho")
_SDPO = {"section": "sdpo", "rule": "sdpo", "chain_rule": "chain_sdpo", "chain_wildcard": "sdpo"}
_SDPO |= {"trainer": "graftlab.train.sdpo:train_sdpo", "updates": True, "chained": True}

METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method("post", "post (reference)", "post", {"marker": "*", "color": "black", "s": 220, "zorder": 5}),
        Method("donor", "donor as it is (faint)", "donor", {"marker": "d", "s": 30} | _FAINT, ingredient=True),
        Method(
            "sft",
            "SFT of post",
            "SFT of post",
            {"marker": "^", "color": "tab:green"},
            section="sft",
            spec=SftSpec(),
            rule="sft",
            chain_rule="chain_sft",
            chain_wildcard="tune",
            trainer="graftlab.train.sft:finetune",
            updates=True,
            chained=True,
            run_keys=_SFT_KEYS,
        ),
        Method(
            "donor_sft",
            "donor SFT (faint)",
            "donor SFT",
            {"marker": "x", "s": 18} | _FAINT,
            section="sft",
            rule="sft",
            trainer="graftlab.train.sft:finetune",
            ingredient=True,
            kind="sft",
            run_keys=_SFT_KEYS,
        ),
        Method(
            "graft",
            "graft",
            "graft",
            {"marker": "o", "color": "tab:blue"},
            section="graft",
            spec=GraftSpec("graft"),
            rule="graft",
            trainer="graftlab.graft:masked_graft",
            updates=True,
            run_keys=_GRAFT_KEYS,
        ),
        Method(
            "merge",
            "merge (donor = post)",
            "merge",
            {"marker": "s", "color": "tab:orange"},
            section="merge",
            spec=GraftSpec("merge"),
            rule="graft",
            trainer="graftlab.graft:masked_graft",
            updates=True,
            kind="graft",
            run_keys=_GRAFT_KEYS,
        ),
        Method(
            "graft_chain",
            "graft, the donor tuned on each stage alone",
            "graft_chain",
            section="graft",
            chain_rule="chain_graft",
            chain_wildcard="form",
            chained=True,
            form="chain",
        ),
        Method(
            "graft_cumulative",
            "graft, the donor's own SFT chain",
            "graft_cumulative",
            section="graft",
            chain_rule="chain_graft",
            chain_wildcard="form",
            chained=True,
            form="cumulative",
        ),
        # The merge chained: each stage adds the current model's own SFT update on the stage, scaled by the
        # merge section's lam, to the current model (the single-domain merge, stage after stage).
        Method(
            "merge_chain",
            "merge, the current model's own update",
            "merge_chain",
            section="merge",
            chain_rule="chain_graft",
            chain_wildcard="form",
            chained=True,
            form="merge",
        ),
        Method(
            "opsd",
            "OPSD (on-policy self-distillation)",
            "OPSD",
            {"marker": "v", "color": "tab:purple"},
            section="opsd",
            spec=OpsdSpec(),
            rule="opsd",
            chain_rule="chain_opsd",
            trainer="graftlab.train.opsd:train_opsd",
            updates=True,
            chained=True,
        ),
        Method(
            "grpo",
            "GRPO",
            "GRPO",
            {"marker": "<", "color": "tab:red"},
            section="grpo",
            spec=GrpoSpec(),
            rule="grpo",
            chain_rule="chain_grpo",
            trainer="graftlab.train.grpo:train_grpo",
            updates=True,
            chained=True,
        ),
        Method(
            "sdpo",
            "SDPO (answer tokens)",
            "SDPO",
            {"marker": ">", "color": "tab:brown"},
            spec=SdpoSpec("teachers", cot=False),
            **_SDPO,
        ),
        Method(
            "sdpo_cot",
            "SDPO-CoT (every token)",
            "SDPO-CoT",
            {"marker": "h", "color": "tab:pink"},
            spec=SdpoSpec("cot_teachers", cot=True),
            **_SDPO,
        ),
    )
}


def on_policy() -> list[Method]:
    """The on-policy trainers of the post model, in table order."""
    return [m for m in METHODS.values() if m.on_policy]


def specs() -> dict[str, Spec]:
    """Each config section's spec, once per section (sdpo and sdpo_cot share one)."""
    out: dict[str, Spec] = {}
    for m in METHODS.values():
        if m.spec is not None:
            out.setdefault(m.section, m.spec)
    return out


def sections(methods: list[Method]) -> list[str]:
    """The config sections of `methods`, each once, in their order."""
    return list(dict.fromkeys(m.section for m in methods))


def trained_rules() -> list[str]:
    """The workflow rules that train a model: each method's rule and chain rule."""
    trained = [m for m in METHODS.values() if isinstance(m.spec, TrainerSpec)]
    return list(dict.fromkeys(r for m in trained for r in (m.rule, m.chain_rule) if r))
