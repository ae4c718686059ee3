"""The methods registry (`graftlab.methods`): every method the workflow runs is one entry, no other module
lists methods, a new entry reaches planning and analysis with no edit there, and each config check lives
once, in the method's spec, which the config resolution and the trainer both run."""

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from graftlab.errors import GraftlabError
from graftlab.methods import METHODS, on_policy
from graftlab.planning.chains import Continual
from graftlab.planning.config import ConfigError, resolve
from graftlab.planning.layout import Experiment, parse_run

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "src" / "graftlab"


def test_every_method_the_default_and_smoke_configs_run_is_an_entry():
    for path in (REPO / "config.yaml", REPO / "configs" / "smoke.yaml"):
        config = resolve(yaml.safe_load(path.read_text()))
        for name, x in config["experiments"].items():
            if x["stages"]:
                kinds = {c.kind for c in Continual.of(config, name).chains()}
            else:
                kinds = {parse_run(key)["method"] for key in Experiment.of(config, name).runs()}
            assert kinds <= set(METHODS), (name, kinds - set(METHODS))


def test_every_rule_that_trains_an_on_policy_method_is_its_entrys():
    rules = set(re.findall(r"^rule (\w+):", "".join(p.read_text() for p in (REPO / "rules").glob("*.smk")), re.M))
    for m in on_policy():
        assert m.rule in rules and m.chain_rule in rules, m.name
        module, _, function = m.trainer.partition(":")
        assert (PACKAGE / (module.removeprefix("graftlab.").replace(".", "/") + ".py")).is_file(), m.trainer
        assert (
            f"def {function}(" in (PACKAGE / (module.removeprefix("graftlab.").replace(".", "/") + ".py")).read_text()
        )


def _literal_lists(tree: ast.AST):
    """Every collection written out in the code: tuples, lists, sets and dict keys of string constants."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            items = node.elts
        elif isinstance(node, ast.Dict):
            items = [k for k in node.keys if k is not None]
        else:
            continue
        yield node.lineno, [e.value for e in items if isinstance(e, ast.Constant) and isinstance(e.value, str)]


# Where the papers' claims compare particular methods, the analysis names them: not lists of methods,
# which a new method would join, but the comparisons themselves.
COMPARISONS = {
    # the study's takeover columns: SFT of post, the donors' SFT and the grafts they make
    ("analysis/study.py", ("donor_sft", "graft", "sft")),
    # the grafting paper's claim: a graft keeps more old-task accuracy than SFT at no less new-task accuracy
    ("analysis/verdict.py", ("graft", "sft")),
    # the baselines both papers hold a graft to: SFT of post, the on-policy OPSD, the post model's own update
    ("analysis/verdict.py", ("merge", "opsd", "sft")),
}


def test_no_module_but_the_registry_lists_methods():
    """A tuple, list, set or dict naming two methods or more is a list of methods kept by hand: adding a
    method would have to find and edit it. `post` and `donor` name models as well as methods, and count
    only beside another method."""
    names, found = set(METHODS), []
    for path in PACKAGE.rglob("*.py"):
        if path.parent.name == "methods":
            continue
        where = str(path.relative_to(PACKAGE))
        for line, strings in _literal_lists(ast.parse(path.read_text())):
            listed = tuple(sorted(set(strings) & names))
            if len(set(listed) - {"post", "donor"}) >= 1 and len(listed) >= 2 and (where, listed) not in COMPARISONS:
                found.append(f"{where}:{line} {list(listed)}")
    assert not found, found


# A new on-policy method, added as the registry says: an entry (here a twin of GRPO under its own name and
# rules, reusing GRPO's config section and spec). Nothing else is edited; a fresh interpreter adds it before
# the planning and analysis modules are imported.
NEW_METHOD = """
import dataclasses, json, yaml
from graftlab.methods import METHODS
METHODS["twin"] = dataclasses.replace(
    METHODS["grpo"], name="twin", label="twin", short="TWIN", rule="twin", chain_rule="chain_twin"
)
from graftlab.analysis.latency import METHOD_NAMES
from graftlab.analysis.pareto import STYLES, _front_label
from graftlab.planning import plan, resources, work
from graftlab.planning.chains import Continual
from graftlab.planning.config import resolve
from graftlab.planning.layout import Experiment, parse_run

config = resolve(yaml.safe_load(open("config.yaml")))
layout = Experiment.of(config, "expert")
chains = Continual.of(config, "continual")
twin = [k for k in layout.runs() if k.startswith("twin/")]
print(json.dumps({
    "runs": twin,
    "parsed": parse_run(twin[-1])["method"],
    "jobs": sum(rule == "twin" for rule, _ in plan.experiment_jobs(layout)),
    "chains": sorted({c.key for c in chains.chains() if c.kind == "twin"}),
    "sized": [resources.classify("twin"), resources.classify("chain_twin"), plan.SIZED_AS["chain_twin"]],
    "flops": work.job_work("twin", config, layout, {}).compute == work.job_work("grpo", config, layout, {}).compute,
    "label": [METHOD_NAMES["twin"], STYLES["twin"]["label"], _front_label({"method": "twin", "lr": "1e-4", "step": 4})],
}))
"""


def test_a_new_entry_reaches_planning_and_analysis_with_no_other_edit():
    done = subprocess.run([sys.executable, "-c", NEW_METHOD], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    grpo = resolve(yaml.safe_load((REPO / "config.yaml").read_text()))["experiments"]["expert"]["grpo"]
    assert out["runs"] and all(re.fullmatch(r"twin/post/lr~[^/]+/step~\d+", k) for k in out["runs"])
    assert out["parsed"] == "twin" and out["jobs"] == len(grpo["lr"])
    assert out["chains"] and all(k.startswith("twin/post/lr~") for k in out["chains"])
    assert out["sized"] == ["gpu", "gpu", "twin"] and out["flops"]
    assert out["label"] == ["TWIN", "twin", "TWIN lr=1e-4 s4"]


# The checks of a method's section live once, in its spec: the config refuses a section exactly when the
# trainer refuses the run it describes.
def _sdpo_refusals(batch_size, generations, updates, micro, alpha, schedule):
    section = {
        "batch_size": batch_size,
        "generations": generations,
        "updates_per_batch": updates,
        "micro_batch_size": micro,
        "alpha": alpha,
        "teachers": [schedule],
        "steps": 4,
        "checkpoints": 1,
    }
    try:
        resolve({"experiments": {"x": {"sdpo": dict(section)}}})  # resolve fills defaults in place
        config_ok = True
    except ConfigError as err:
        config_ok = False
        assert "experiments.x.sdpo." in str(err), err
    from graftlab.train.sdpo import SdpoConfig

    run = {k: v for k, v in section.items() if k not in ("teachers", "checkpoints")}
    try:
        SdpoConfig(lr=1e-3, teacher=schedule, save_steps=(4,), **run)
        trainer_ok = True
    except GraftlabError:
        trainer_ok = False
    return config_ok, trainer_ok


@settings(max_examples=60, deadline=None)
@given(
    batch_size=st.integers(1, 6),
    generations=st.integers(2, 6),
    updates=st.integers(1, 4),
    micro=st.one_of(st.just("auto"), st.integers(1, 12)),
    alpha=st.sampled_from([0.0, 0.5, 1.0, 1.5]),
    schedule=st.sampled_from(["frozen", "ema:0.05", "refresh:1", "ema:2", "refresh:x"]),
)
def test_config_and_trainer_refuse_the_same_sdpo_sections(batch_size, generations, updates, micro, alpha, schedule):
    config_ok, trainer_ok = _sdpo_refusals(batch_size, generations, updates, micro, alpha, schedule)
    assert config_ok == trainer_ok


@pytest.mark.parametrize("method", [m.name for m in on_policy()])
def test_each_on_policy_spec_accepts_its_default_section(method):
    m = METHODS[method]
    assert m.spec.check(resolve({})["experiments"]["expert"][m.section]) == []


# Literal text without "}": no placeholder can form across a literal and its neighbour, so each piece of
# the template is either text that stays or one placeholder that is filled.
LITERAL = st.text(alphabet=st.characters(blacklist_characters="}"), max_size=8)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.one_of(LITERAL, st.sampled_from(["{problem}", "{solution}"])), max_size=8),
    st.text(max_size=12),
    st.text(max_size=12),
)
def test_a_template_is_filled_placeholder_by_placeholder_and_never_inside_a_value(pieces, problem, solution):
    """OPSD's, SDPO's and the Pedagogical teacher's templates (graftlab.methods.spec.fill): each placeholder
    becomes its value, and a value holding a placeholder or braces (LaTeX: `x^{2}`, `{solution}`) is
    inserted as it is, whatever the order of the values."""
    from graftlab.methods.spec import fill

    values = {"problem": problem + "{solution}", "solution": "{problem}" + solution}
    expected = "".join(values[p[1:-1]] if p in ("{problem}", "{solution}") else p for p in pieces)
    assert fill("".join(pieces), problem=values["problem"], solution=values["solution"]) == expected
    assert fill("".join(pieces), solution=values["solution"], problem=values["problem"]) == expected
