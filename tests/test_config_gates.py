"""The workflow config's gates (issue 33, item 1), each for a whole kind of problem: every number finite
wherever it lies, every count bounded below by the schema, experiment names that are safe directories and
none of the workflow's own, every spelled list free of one value under two spellings, and no option set
where nothing reads it."""

import copy
import json
import re
from decimal import Decimal
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from graftlab.planning.config import ConfigError, resolve
from graftlab.planning.layout import worlds
from graftlab.schema import load_schema

REPO = Path(__file__).resolve().parents[1]
SCHEMA = load_schema()
DEFS = SCHEMA["$defs"]


def _refused(config: dict) -> str:
    with pytest.raises(ConfigError) as err:
        resolve(json.loads(json.dumps(config)) if _plain(config) else config)
    message = str(err.value)
    assert "\n" not in message, message
    return message


def _plain(config) -> bool:
    """Whether `config` survives JSON (NaN and Inf do not: they are passed as they are)."""
    try:
        json.dumps(config, allow_nan=False)
    except ValueError:
        return False
    return True


def _x(**section) -> dict:
    """A config of one experiment `x` with `section`."""
    return {"experiments": {"x": section}}


# --- Numbers -------------------------------------------------------------------------------------------

NAN, INF = float("nan"), float("inf")

NUMBER_CASES = [
    # NaN passes `minimum` and `maximum` (it compares false); Inf passes `minimum`.
    (_x(eval={"temperature": NAN}), "experiments.x.eval.temperature", "not a finite number"),
    (_x(mining={"max_pass_rate": NAN}), "experiments.x.mining.max_pass_rate", "not a finite number"),
    (_x(grpo={"beta": INF}), "experiments.x.grpo.beta", "not a finite number"),
    (_x(sft={"max_grad_norm": INF}), "experiments.x.sft.max_grad_norm", "not a finite number"),
    ({"world": {"pretrain": {"lr": INF}}}, "world.pretrain.lr", "not a finite number"),
    ({"world": {"corpus": {"chat_share": NAN}}}, "world.corpus.chat_share", "not a finite number"),
    ({"worlds": {"w": {"posttrain": {"lr": -INF}}}}, "worlds.w.posttrain.lr", "not a finite number"),
    ({"resume_minutes": INF}, "resume_minutes", "not a finite number"),
    ({"moe": {"lam": [0, INF]}}, "moe.lam.1", "not a finite number"),
    ({"models": {"m": {"source": "/m", "params": INF}}}, "models.m.params", "not a finite number"),
    # A count too large for the int64 every job reads it as.
    (_x(sft={"batch_size": 2**70}), "experiments.x.sft.batch_size", "64-bit"),
    # Numbers written as strings: "1e400" passes the pattern and is Inf.
    (_x(sft={"lr": ["1e400"]}), "experiments.x.sft.lr", "are not finite"),
    (_x(graft={"lam": ["0.5", "1e400"]}), "experiments.x.graft.lam", "are not finite"),
    (_x(opsd={"alpha": ["1e999"]}), "experiments.x.opsd.alpha", "are not finite"),
    (_x(sdpo={"teachers": ["ema:1e400"]}), "experiments.x.sdpo.teachers", "are not finite"),
    (_x(grpo={"lr": ["0"]}), "experiments.x.grpo.lr", "must be positive"),
    (_x(sdpo={"teachers": ["frozen"], "lr": ["1e-400"]}), "experiments.x.sdpo.lr", "must be positive"),
    # Zero and negative sizes, and seeds outside numpy's 0 .. 2^32 - 1.
    (_x(sft={"batch_size": 0}), "experiments.x.sft.batch_size", "less than the minimum"),
    (_x(eval={"samples": -1}), "experiments.x.eval.samples", "less than the minimum"),
    ({"seed": -1}, "seed", "less than the minimum of 0"),
    ({"seed": 2**32}, "seed", "greater than the maximum"),
    (_x(seed=-3), "experiments.x.seed", "less than the minimum of 0"),
    ({"worlds": {"w": {"seed": -1}}}, "worlds.w.seed", "less than the minimum of 0"),
]


@pytest.mark.parametrize(("config", "key", "words"), NUMBER_CASES, ids=[c[1] for c in NUMBER_CASES])
def test_a_number_that_is_no_setting_is_refused_naming_its_key(config, key, words):
    message = _refused(copy.deepcopy(config))
    assert message.startswith(f"config key {key}:") and words in message, message


def _numeric_leaves(value, path=()):
    """The key path of every number (not a boolean) inside `value`."""
    if isinstance(value, dict):
        for key, sub in value.items():
            yield from _numeric_leaves(sub, (*path, key))
    elif isinstance(value, list):
        for i, sub in enumerate(value):
            yield from _numeric_leaves(sub, (*path, i))
    elif isinstance(value, int | float) and not isinstance(value, bool):
        yield path


# Resolved configs rich in numbers: the default run (masks, SDPO, a continual chain) and the smoke run
# (named worlds, stages, every data setting).
# (Through JSON: a YAML merge key shares one section between experiments, and a leaf is replaced in one.)
BASES = {
    name: json.loads(json.dumps(resolve(yaml.safe_load((REPO / name).read_text()))))
    for name in ("config.yaml", "configs/smoke.yaml")
}
LEAVES = [(name, path) for name, config in BASES.items() for path in _numeric_leaves(config)]


def test_the_bases_hold_numbers_everywhere():
    roots = {path[0] for _, path in LEAVES}
    assert {"experiments", "world", "worlds", "moe", "seed", "threads"} <= roots
    assert any("stages" in path for _, path in LEAVES)


@settings(max_examples=150, deadline=None)
@given(leaf=st.sampled_from(LEAVES), bad=st.sampled_from([NAN, INF, -INF]))
def test_any_number_anywhere_replaced_by_nan_or_inf_is_refused_naming_its_key(leaf, bad):
    name, path = leaf
    config = copy.deepcopy(BASES[name])
    node = config
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = bad
    with pytest.raises(ConfigError) as err:
        resolve(config)
    key = ".".join(map(str, path))
    assert str(err.value).startswith(f"config key {key}: {bad} is not a finite number"), str(err.value)


def _schema_numbers(node, path=""):
    """(key path, schema) of every integer or number of the schema, lists' items and $defs included."""
    types = node.get("type", [])
    types = types if isinstance(types, list) else [types]
    if {"integer", "number"} & set(types):
        yield path, node
    for key, sub in node.get("properties", {}).items():
        yield from _schema_numbers(sub, f"{path}.{key}" if path else key)
    for key, sub in node.get("$defs", {}).items():
        yield from _schema_numbers(sub, f"$defs.{key}")
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            yield from _schema_numbers(node[key], f"{path}[]" if key == "items" else f"{path}.<name>")
    for sub in node.get("oneOf", []):
        yield from _schema_numbers(sub, path)


def _bounded(node: dict) -> bool:
    return "minimum" in node or "exclusiveMinimum" in node


def test_every_count_and_number_of_the_schema_is_bounded_below():
    # A count of 0 or less (steps, batch sizes, tokens, samples) fails a job hours in, or silently does
    # nothing; a number without a lower bound must say it is meant so (with "unbounded" in its description).
    numbers = dict(_schema_numbers(SCHEMA))
    assert len(numbers) > 100, len(numbers)
    unbounded_ints = [p for p, n in numbers.items() if "integer" in str(n.get("type")) and not _bounded(n)]
    assert not unbounded_ints, unbounded_ints
    unbounded = [p for p, n in numbers.items() if not _bounded(n) and "unbounded" not in n.get("description", "")]
    assert not unbounded, unbounded


def test_refs_to_numbers_are_bounded_too():
    # $defs holding a number (max_grad_norm, updates_per_batch) are bounded where defined, so every use is.
    for name in ("max_grad_norm", "updates_per_batch", "epochs_per_batch"):
        assert _bounded(DEFS[name]), name
    assert _bounded(DEFS["epochs"]["items"])


# --- Names ---------------------------------------------------------------------------------------------

RESERVED = SCHEMA["properties"]["experiments"]["propertyNames"]["not"]["enum"]
# A string literal of a path the workflow or graftlab writes, whose first component under results/, logs/
# or benchmarks/jobs/ (where each experiment writes its own `{exp}/`) is a fixed name, not a wildcard.
WRITTEN = re.compile(r"""["'](?:results|logs|benchmarks/jobs)/([A-Za-z0-9_~-]+)(?=["'/])""")


def _own_directories() -> set[str]:
    files = [REPO / "Snakefile", *REPO.glob("rules/*.smk"), *REPO.glob("workflow_scripts/*.py")]
    files += REPO.glob("src/graftlab/**/*.py")
    names = {m[1] for f in files for m in WRITTEN.finditer(f.read_text())}
    # The tiny worlds' directories (`results/world`, `results/worlds/<name>`) come from layout.worlds.
    return names | {key.split("/")[0] for key in worlds(resolve({"worlds": {"w": {}}}))}


def test_every_directory_the_workflow_writes_beside_the_experiments_is_reserved():
    own = _own_directories()
    assert {"world", "worlds", "fisher", "study", "moe", "tables"} <= own, own
    assert own <= set(RESERVED), own - set(RESERVED)


@pytest.mark.parametrize("name", RESERVED)
def test_a_reserved_name_is_refused_in_any_letter_case(name):
    for spelled in (name, name.upper(), name.capitalize()):
        message = _refused({"experiments": {spelled: {}}})
        assert message.startswith("config key experiments:") and repr(spelled) in message, message


NAME_CASES = [
    ({"experiments": {"../up": {}}}, "experiments", "is invalid"),
    ({"experiments": {"a/b": {}}}, "experiments", "is invalid"),
    ({"experiments": {".": {}}}, "experiments", "is invalid"),
    ({"experiments": {"-rf": {}}}, "experiments", "starting with a letter or a digit"),
    ({"experiments": {"_x": {}}}, "experiments", "starting with a letter or a digit"),
    ({"experiments": {"a b": {}}}, "experiments", "is invalid"),
    ({"experiments": {"x" * 101: {}}}, "experiments", "exceed 100 characters"),
    ({"experiments": {"run": {}, "Run": {}}}, "experiments", "differ only in letter case"),
    ({"worlds": {"w": {}, "W": {}}}, "worlds", "differ only in letter case"),
    ({"models": {"q": {"source": "/a"}, "Q": {"source": "/b"}}}, "models", "differ only in letter case"),
    (
        _x(benchmarks={"aime": {"source": "/a"}, "AIME": {"source": "/b"}}, fisher={"prompts": {"source": "/p"}}),
        "experiments.x.benchmarks",
        "differ only in letter case",
    ),
    ({"models": {"q": {"source": "/a", "rope_from": "r"}}}, "models.q.rope_from", "is no other name in models"),
]


@pytest.mark.parametrize(("config", "key", "words"), NAME_CASES, ids=[str(c[0])[:40] for c in NAME_CASES])
def test_a_name_that_is_no_safe_directory_is_refused(config, key, words):
    message = _refused(config)
    assert message.startswith(f"config key {key}:") and words in message, message


def test_names_that_are_safe_directories_pass():
    config = resolve({"experiments": {"a": {}, "B-2": {}, "3_c": {}, "world-s0": {}, "studies": {}}})
    assert set(config["experiments"]) == {"a", "B-2", "3_c", "world-s0", "studies"}


# --- One value, one spelling ---------------------------------------------------------------------------


def _spelled_lists(node, path=()):
    """Key paths (within an experiment) of every list of numbers written as strings, found in the schema."""
    if "$ref" in node:
        node = DEFS[node["$ref"].rsplit("/", 1)[1]] | {k: v for k, v in node.items() if k != "$ref"}
    items = node.get("items", {})
    if items.get("$ref", "").rsplit("/", 1)[-1] in ("number", "lam"):
        yield ".".join(path)
    for key, sub in node.get("properties", {}).items():
        yield from _spelled_lists(sub, (*path, key))


NUMBER_LISTS = sorted(_spelled_lists(DEFS["experiment"]))


def test_the_number_lists_are_found_in_the_schema():
    assert {"sft.lr", "graft.lam", "graft.masks.rho", "graft.masks.lam", "merge.masks.lam", "opsd.alpha"} <= set(
        NUMBER_LISTS
    )


def _overlay(dotted: str, values: list[str]) -> dict:
    """An experiment overlay setting the list at `dotted` to `values`, with what makes it read (a mask
    kind for a mask's lists, a teacher for SDPO's)."""
    section: dict = {}
    node = section
    *parents, last = dotted.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = values
    if "masks" in parents:
        node["kinds"] = ["diag"]
    if parents[0] == "sdpo":
        section["sdpo"]["teachers"] = ["frozen"]
    return section


def _spellings(mantissa: int, exponent: int) -> list[str]:
    """Spellings of mantissa x 10^exponent (exponent < 0) that the schema's pattern takes."""
    fixed = format(Decimal(mantissa).scaleb(exponent), "f")
    return [f"{mantissa}e{exponent}", fixed, fixed + "0", f"{mantissa}.0e{exponent}", f"{mantissa * 10}e{exponent - 1}"]


@settings(max_examples=80, deadline=None)
@given(
    dotted=st.sampled_from(NUMBER_LISTS),
    mantissa=st.integers(1, 99),
    exponent=st.integers(-8, -2),
    pick=st.lists(st.integers(0, 4), min_size=2, max_size=2, unique=True),
)
def test_one_decimal_under_two_spellings_in_any_number_list_is_refused(dotted, mantissa, exponent, pick):
    spellings = _spellings(mantissa, exponent)
    values = [spellings[i] for i in pick]
    message = _refused(_x(**_overlay(dotted, values)))
    assert message.startswith(f"config key experiments.x.{dotted}:"), message
    assert "one value spelled twice" in message and all(repr(v) in message for v in values), message


@settings(max_examples=60, deadline=None)
@given(
    dotted=st.sampled_from(NUMBER_LISTS),
    x=st.floats(min_value=1e-7, max_value=0.999, allow_nan=False, allow_infinity=False),
)
def test_one_float_formatted_two_ways_in_any_number_list_is_refused(dotted, x):
    values = [repr(x), f"{x:.17e}"]
    assert float(values[0]) == float(values[1]) and values[0] != values[1]
    message = _refused(_x(**_overlay(dotted, values)))
    assert message.startswith(f"config key experiments.x.{dotted}:") and "spelled twice" in message, message


@settings(max_examples=40, deadline=None)
@given(
    mantissa=st.integers(1, 99),
    exponent=st.integers(-4, -2),
    pick=st.lists(st.integers(0, 4), min_size=2, max_size=2, unique=True),
    cot=st.booleans(),
)
def test_one_teacher_schedule_under_two_spellings_is_refused(mantissa, exponent, pick, cot):
    spellings = _spellings(mantissa, exponent)
    field = "cot_teachers" if cot else "teachers"
    message = _refused(_x(sdpo={field: [f"ema:{spellings[i]}" for i in pick]}))
    assert message.startswith(f"config key experiments.x.sdpo.{field}:") and "spelled twice" in message, message


def test_distinct_values_pass():
    x = resolve(_x(sft={"lr": ["1e-3", "1e-4", "0.01"]}, graft={"lam": ["0.5", "0.25", "1"]}))["experiments"]["x"]
    assert x["sft"]["lr"] == ["1e-3", "1e-4", "0.01"]  # spellings kept, as result paths keep them


SPELLED_CASES = [
    (_x(sdpo={"teachers": ["refresh:0.5", "refresh:0.5:1"]}), "experiments.x.sdpo.teachers"),  # gamma 1
    (_x(sdpo={"teachers": ["ema:0.05", "ema:5e-2"]}), "experiments.x.sdpo.teachers"),
    (_x(donors=["step~100", "step~0100"]), "experiments.x.donors"),
    (_x(opsd={"lr": ["1e-4", "0.0001"]}), "experiments.x.opsd.lr"),
    (_x(merge={"lam": ["1", "1.0"]}), "experiments.x.merge.lam"),
]


@pytest.mark.parametrize(("config", "key"), SPELLED_CASES, ids=[c[1] + str(i) for i, c in enumerate(SPELLED_CASES)])
def test_a_value_spelled_twice_is_refused(config, key):
    message = _refused(config)
    assert message.startswith(f"config key {key}:") and "one value spelled twice" in message, message


# --- Options that nothing reads ------------------------------------------------------------------------

STAGE = {"domain": "order"}
UNREAD_CASES = [
    (
        _x(graft={"masks": {"rho": ["0.1"]}}),
        "experiments.x.graft.masks.rho",
        "experiments.x.graft.masks.kinds is empty",
    ),
    (_x(merge={"masks": {"lam": ["1"]}}), "experiments.x.merge.masks.lam", "experiments.x.merge.masks.kinds is empty"),
    (_x(graft={"masks": {"scope": "tensor"}}), "experiments.x.graft.masks.scope", "masks.kinds is empty"),
    (_x(graft={"masks": {"score": "fisher"}}), "experiments.x.graft.masks.score", "masks.kinds is empty"),
    (_x(merge={"masks": {"epochs": [1]}}), "experiments.x.merge.masks.epochs", "masks.kinds is empty"),
    (_x(fisher={"ekfac": True}), "experiments.x.fisher.ekfac", "no mask kind is kfac"),
    (
        _x(fisher={"kfac_positions": "all"}, graft={"masks": {"kinds": ["diag"]}}),
        "experiments.x.fisher.kfac_positions",
        "no mask kind is kfac",
    ),
    (_x(teacher={"model": "post"}), "experiments.x.teacher.model", "experiments.x.data is 'expert', not teacher"),
    (_x(data="star", teacher={"model": "post"}), "experiments.x.teacher.model", "not teacher"),
    (_x(star={"rationalize_attempts": 2}), "experiments.x.star.rationalize_attempts", "star.rationalize is false"),
    (_x(continual={"kl_prompts": 8}), "experiments.x.continual.kl_prompts", "experiments.x.stages is empty"),
    (_x(stages=[STAGE], data="star"), "experiments.x.data", "continual experiment"),
    (_x(stages=[STAGE], problems={"source": "/p"}), "experiments.x.problems", "continual experiment"),
    (_x(stages=[STAGE], mining={"samples": 2}), "experiments.x.mining.samples", "continual experiment"),
    (
        _x(stages=[{"domain": "order", "knowledge": {"entities": 4}}]),
        "experiments.x.stages.0.knowledge",
        "stage 0 is no knowledge stage",
    ),
    (_x(opsd={"alpha": [], "steps": 5}), "experiments.x.opsd.steps", "experiments.x.opsd sweeps no run"),
    (_x(grpo={"beta": 0.1}), "experiments.x.grpo.beta", "experiments.x.grpo sweeps no run"),
    (_x(sdpo={"generations": 8}), "experiments.x.sdpo.generations", "experiments.x.sdpo sweeps no run"),
    (
        _x(sdpo={"teachers": ["frozen"], "cot_thinking": "strip"}),
        "experiments.x.sdpo.cot_thinking",
        "experiments.x.sdpo.cot_teachers is empty",
    ),
    (
        _x(sdpo={"cot_teachers": ["frozen"], "tokens": "answer"}),
        "experiments.x.sdpo.tokens",
        "experiments.x.sdpo.teachers is empty",
    ),
    ({"world": {"corpus": {"new_task_problems": 30}}}, "world.corpus.new_task_problems", "new_task_share is 0"),
    (
        {"worlds": {"w": {"corpus": {"new_task_problems": 30}}}},
        "worlds.w.corpus.new_task_problems",
        "worlds.w.corpus.new_task_share is 0",
    ),
]


@pytest.mark.parametrize(("config", "key", "reason"), UNREAD_CASES, ids=[c[1] for c in UNREAD_CASES])
def test_an_option_nothing_reads_is_refused_with_the_reason(config, key, reason):
    message = _refused(config)
    assert message.startswith(f"config key {key}: is set but ") and reason in message, message
    assert message.endswith("it would be ignored"), message


READ_CASES = [
    _x(graft={"masks": {"kinds": ["diag"], "rho": ["0.1"], "scope": "tensor"}}),
    _x(fisher={"ekfac": True, "kfac_positions": "all"}, merge={"masks": {"kinds": ["kfac"]}}),
    _x(data="teacher", teacher={"model": "post"}),
    _x(star={"rationalize": True, "rationalize_attempts": 2}),
    _x(stages=[STAGE], continual={"kl_prompts": 8}),
    _x(stages=[{"domain": "knowledge", "knowledge": {"entities": 8, "facts": 16}}]),
    _x(opsd={"alpha": [], "lr": ["1e-5"]}),  # a sweep axis is the switch itself: a preset may leave it
    _x(sdpo={"cot_teachers": ["frozen"], "cot_tokens": "answer"}),
    # An option the default keeps is no option set (a resolved config resolves again).
    _x(graft={"masks": {"rho": ["0.01"]}}),
    # The main world lends new_task_problems to a named world that reads it.
    {
        "world": {"corpus": {"new_task_problems": 30}},
        "worlds": {"w": {"candidates": 600, "corpus": {"new_task_share": 0.03}}},
    },
]


@pytest.mark.parametrize("config", READ_CASES, ids=[str(i) for i in range(len(READ_CASES))])
def test_an_option_that_is_read_passes(config):
    resolved = resolve(copy.deepcopy(config))
    assert resolve(copy.deepcopy(resolved)) == resolved


# --- Every shipped config still passes ------------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    ["config.yaml", "tests/slurm/cluster.yaml", "tests/vllm_cpu/world.yaml"]
    + sorted(str(p.relative_to(REPO)) for p in (REPO / "configs").glob("*.yaml")),
)
def test_every_shipped_config_passes_the_gates_and_resolves_again_unchanged(path):
    config = resolve(yaml.safe_load((REPO / path).read_text()))
    assert resolve(copy.deepcopy(config)) == config
