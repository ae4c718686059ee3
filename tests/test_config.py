"""Configuration: schema defaults, unknown keys, cross-key checks, and the generated reference page."""

from pathlib import Path

import pytest
import yaml

from graftlab.planning.config import REFERENCE_PAGE, REGENERATE, ConfigError, load_schema, render_page, resolve

REPO = Path(__file__).resolve().parents[1]


def test_empty_config_gets_every_default_from_the_schema():
    config = resolve({})
    assert config["experiments"]["expert"]["graft"]["lam"] == ["0.25", "0.5", "1"]
    assert config["world"]["model"]["hidden_size"] == 128
    assert config["experiments"]["expert"]["graft"]["epochs"] is None  # a default behind a $ref


@pytest.mark.parametrize("name", ["config.yaml", "configs/smoke.yaml"])
def test_shipped_configs_validate(name):
    resolve(yaml.safe_load((REPO / name).read_text()))


@pytest.mark.parametrize(
    "config, message",
    [
        ({"wrld": {}}, "config key (top level): Additional properties are not allowed ('wrld'"),
        ({"world": {"model": {"layers": 0}}}, "config key world.model.layers: 0 is less than the minimum of 1"),
        (
            {"experiments": {"x": {"graft": {"lam": [0.5]}}}},
            "config key experiments.x.graft.lam.0: 0.5 is not of type 'string'",
        ),
        (
            {"world": {"pretrain": {"steps": 500}}},
            "config key world.pretrain.ladder: must increase and end at step 500",
        ),
        ({"world": {"pretrain": {"ladder": [400, 100]}}}, "config key world.pretrain.ladder: must increase"),
        ({"world": {"candidates": 800}}, "config key world.candidates: exceeds the 720 distinct mul problems"),
        ({"world": {"model": {"kv_heads": 3}}}, "config key world.model.kv_heads: must divide world.model.heads = 4"),
        (
            {"world": {"candidates": 700, "corpus": {"new_task_share": 0.03, "new_task_problems": 40}}},
            "config key world.corpus.new_task_problems: with world.candidates = 700 exceeds the 720 distinct mul",
        ),
        (
            {"world": {"candidates": 600, "corpus": {"chat_share": 0.8, "new_task_share": 0.3}}},
            "config key world.corpus.new_task_share: with world.corpus.chat_share = 0.8 exceeds 1",
        ),
        (
            {"world": {"corpus": {"families": ["div"]}}},
            "config key world.corpus.families: need world.corpus.chat_share > 0",
        ),
        ({"experiments": {"x": {"sft": {"lr": ["1.2.3"]}}}}, "config key experiments.x.sft.lr.0: '1.2.3' is invalid"),
        ({"experiments": {"x": {"mining": {"heldout": 720}}}}, "config key experiments.x.mining.heldout: leaves no"),
        (
            {"experiments": {"x": {"sft": {"epochs": 2}, "graft": {"epochs": [3]}}}},
            "config key experiments.x.graft.epochs: [3] exceed sft.epochs = 2",
        ),
        (
            {"experiments": {"x": {"graft": {"masks": {"rho": ["0.01", "1.5"]}}}}},
            "config key experiments.x.graft.masks.rho: ['1.5'] outside [0, 1]",
        ),
        (
            {"experiments": {"x": {"merge": {"masks": {"rho": ["-0.1"]}}}}},
            "config key experiments.x.merge.masks.rho.0: '-0.1' is invalid",
        ),
        (
            {"experiments": {"x": {"graft": {"masks": {"kinds": ["diag", "eigen"]}}}}},
            "config key experiments.x.graft.masks.kinds.1: 'eigen' is not one of ['diag', 'kfac']",
        ),
        (
            {"experiments": {"x": {"graft": {"masks": {"scope": "layer"}}}}},
            "config key experiments.x.graft.masks.scope: 'layer' is not one of",
        ),
        (
            {"experiments": {"x": {"sft": {"epochs": 2}, "merge": {"masks": {"epochs": [1, 4]}}}}},
            "config key experiments.x.merge.masks.epochs: [4] exceed sft.epochs = 2",
        ),
        (
            {"experiments": {"x": {"fisher": {"rollouts": 0}}}},
            "config key experiments.x.fisher.rollouts: 0 is less than the minimum of 1",
        ),
        (
            {"world": {"old_tasks": ["sub"]}, "experiments": {"x": {"fisher": {"rollouts": 5000}}}},
            "config key experiments.x.fisher.rollouts: asks 5000 sub prompts; only 4950 lie outside its benchmark",
        ),
        (
            {"experiments": {"x": {"fisher": {"temperature": 0}}}},
            "config key experiments.x.fisher.temperature: 0 is less than or equal to",
        ),
        (
            {"experiments": {"x": {"data": "teacher"}}},
            "config key experiments.x.teacher.model: None must name the teacher",
        ),
        (
            {"experiments": {"x": {"data": "teacher", "teacher": {"model": "gpt"}}}},
            "config key experiments.x.teacher.model: 'gpt' must name",
        ),
        (
            {"experiments": {"x": {"donors": ["qwen"]}}},
            "config key experiments.x.donors: qwen is no checkpoint of world (step~100, step~200, step~300, step~400)",
        ),
        # Post-training's checkpoints: on its ladder, before its last step, by their one spelling.
        (
            {"world": {"posttrain": {"ladder": [450]}}, "experiments": {"x": {"donors": ["post~900"]}}},
            "config key experiments.x.donors: post~900 is no checkpoint of world (step~100, step~200, step~300, "
            "step~400, post~450)",
        ),
        (
            {"world": {"posttrain": {"ladder": [450]}}, "experiments": {"x": {"donors": ["post~0450"]}}},
            "config key experiments.x.donors: post~0450 is no checkpoint of world",
        ),
        (
            {"world": {"posttrain": {"ladder": [1350]}}},
            "config key world.posttrain.ladder: must increase and stay below post-training's 1350 steps",
        ),
        (
            {"world": {"posttrain": {"ladder": [900, 450]}}},
            "config key world.posttrain.ladder: must increase",
        ),
        (
            {"experiments": {"x": {"data": "teacher", "teacher": {"model": "post~450"}}}},
            "config key experiments.x.teacher.model: 'post~450' must name the teacher of data: teacher: `post`, a "
            "checkpoint of world (step~100, step~200, step~300, step~400)",
        ),
        (
            {"experiments": {"x": {"post": "qwen"}}},
            "config key experiments.x.post: 'qwen' is neither `post` nor a name in models",
        ),
        ({"models": {"post": {"source": "/m"}}}, "config key models: 'post' should not be valid"),
        ({"models": {"q": {"revision": "main"}}}, "config key models.q: 'source' is a required property"),
        (
            {"experiments": {"x": {"problems": {"source": "p.jsonl", "colums": {}}}}},
            "config key experiments.x.problems: Additional properties are not allowed ('colums' was unexpected)",
        ),
        (
            {"experiments": {"x": {"benchmarks": {"aime": {"source": "a.jsonl"}}}}},
            "config key experiments.x.fisher.prompts: is required",
        ),
        (
            {
                "experiments": {
                    "x": {
                        "data": "knowledge",
                        "benchmarks": {"a": {"source": "a.jsonl"}},
                        "fisher": {"prompts": {"source": "r.jsonl"}},
                    }
                }
            },
            "config key experiments.x.knowledge.replay: replays the tiny world's old tasks",
        ),
        (
            {"experiments": {"x": {"data": "knowledge", "knowledge": {"entities": 5, "facts": 50}}}},
            "config key experiments.x.knowledge: facts=50 must lie between entities=5",
        ),
        (
            {"experiments": {"x": {"data": "knowledge", "problems": {"source": "p.jsonl"}}}},
            "config key experiments.x.problems: data: knowledge writes its own questions",
        ),
        ({"experiments": {"x": {"data": "grpo"}}}, "config key experiments.x.data: 'grpo' is not one of"),
        (
            {"experiments": {"x": {}}, "study": {"experiments": ["x", "y"]}},
            "config key study.experiments: ['y'] are not in `experiments`",
        ),
        (
            {"experiments": {"x": {"world": "w9"}}},
            "config key experiments.x.world: 'w9' is neither `world` nor a name in worlds []",
        ),
        (
            {"worlds": {"w1": {"modle": {}}}},
            "config key worlds.w1: Additional properties are not allowed ('modle' was unexpected)",
        ),
        (
            {"worlds": {"w1": {"model": {"depth": 4}}}},
            "config key worlds.w1.model: Additional properties are not allowed ('depth'",
        ),
        (
            {"worlds": {"w1": {"model": {"layers": 0}}}},
            "config key worlds.w1.model.layers: 0 is less than the minimum of 1",
        ),
        (
            {"worlds": {"world": {}}},
            "config key worlds: 'world' is invalid: A world's name: letters, digits, `_` and `-`; `world` is reserved",
        ),
        ({"worlds": {"w 1": {}}}, "config key worlds: 'w 1' is invalid: A world's name"),
        ({"worlds": {"w1": {"seed": 0.5}}}, "config key worlds.w1.seed: 0.5 is not of type 'integer', 'null'"),
        (
            {"worlds": {"w1": {"model": {"kv_heads": 3}}}},
            "config key worlds.w1.model.kv_heads: must divide worlds.w1.model.heads = 4",
        ),
        (
            {
                "worlds": {"short": {"pretrain": {"steps": 50, "ladder": [50]}}},
                "experiments": {"x": {"world": "short"}},
            },
            "config key experiments.x.donors: step~100 is no checkpoint of worlds.short (step~50)",
        ),
        (
            {"worlds": {"few": {"candidates": 100}}, "experiments": {"x": {"world": "few"}}},
            "config key experiments.x.mining.heldout: leaves no training problems of worlds.few.candidates = 100",
        ),
        (
            {"experiments": {"x": {"data": "pedagogical", "pedagogical": {"template": "{problem} {answer}"}}}},
            "config key experiments.x.pedagogical.template: lacks the placeholder(s) ['{solution}']",
        ),
    ],
)
def test_bad_config_names_the_key(config, message):
    with pytest.raises(ConfigError) as err:
        resolve(config)
    assert str(err.value).startswith(message)


def test_a_named_world_is_the_main_world_with_its_own_keys_laid_over_it():
    config = resolve(
        {
            "seed": 7,
            "world": {"model": {"layers": 3}, "pretrain": {"steps": 300, "ladder": [100, 300]}},
            "worlds": {
                "narrow": {"model": {"hidden_size": 32}},
                "short": {"pretrain": {"steps": 100, "ladder": [50, 100]}, "seed": 1},
            },
            "experiments": {
                "a": {"world": "narrow", "donors": ["step~100"]},
                "b": {"world": "short", "donors": ["step~50"], "seed": 3},
            },
        }
    )
    narrow, short = config["worlds"]["narrow"], config["worlds"]["short"]
    assert narrow["model"] == config["world"]["model"] | {"hidden_size": 32}  # layers 3 kept, defaults filled
    assert {k: v for k, v in narrow.items() if k not in ("model", "seed")} == {
        k: v for k, v in config["world"].items() if k != "model"
    }
    assert short["pretrain"]["ladder"] == [50, 100] and short["pretrain"]["lr"] == config["world"]["pretrain"]["lr"]
    assert (narrow["seed"], short["seed"]) == (7, 1)  # a world without a seed takes the top-level one
    assert [x["seed"] for x in config["experiments"].values()] == [7, 3]
    assert [x["group"] for x in config["experiments"].values()] == ["a", "b"]  # its own name unless grouped
    assert resolve({})["experiments"]["expert"]["world"] == "world" and resolve({})["worlds"] == {}


def test_resolving_a_resolved_config_changes_nothing():
    import copy

    config = resolve({"worlds": {"w": {"model": {"hidden_size": 64}, "seed": 2}}, "experiments": {"x": {"world": "w"}}})
    assert resolve(copy.deepcopy(config)) == config


def test_masks_and_fisher_defaults():
    x = resolve({})["experiments"]["expert"]
    # No masked runs unless asked for; when asked, the paper's setting: global F * delta^2 ranking.
    assert x["graft"]["masks"] == {
        "kinds": [],
        "rho": ["0.01"],
        "scope": "global",
        "score": "fisher_delta",
        "lam": None,
        "epochs": None,
    }
    assert x["merge"]["masks"]["kinds"] == []
    assert x["fisher"] == {
        "rollouts": 256,
        "temperature": 1.0,
        "max_new_tokens": 48,
        "batch_size": 16,
        "ekfac": False,
        "kfac_positions": "completion",
        "prompts": None,
    }


def test_schema_mask_kinds_are_the_fisher_kinds():
    from graftlab.fisher import KINDS

    kinds = load_schema()["$defs"]["masks"]["properties"]["kinds"]["items"]["enum"]
    assert tuple(kinds) == KINDS


def test_config_reference_page_is_generated_from_the_schema():
    page = (REPO / REFERENCE_PAGE).read_text()
    assert page == render_page(load_schema()), f"{REFERENCE_PAGE} is stale: run `{REGENERATE}`"


KEYWORDS = {
    "$schema",
    "$ref",
    "$defs",
    "description",
    "type",
    "default",
    "properties",
    "additionalProperties",
    "items",
    "enum",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "minItems",
    "uniqueItems",
    "minProperties",
    "propertyNames",
    "pattern",
    "required",
    "minLength",
    "oneOf",
    "not",
}


def _schemas(node):
    """Every sub-schema of a schema document."""
    yield node
    for key in ("properties", "$defs"):
        for sub in node.get(key, {}).values():
            yield from _schemas(sub)
    for key in ("items", "additionalProperties", "propertyNames", "not"):
        if isinstance(node.get(key), dict):
            yield from _schemas(node[key])
    for sub in node.get("oneOf", []):
        yield from _schemas(sub)


def test_schema_uses_only_known_keywords():
    # A YAML slip (an unquoted comma in a flow mapping) turns text into a stray keyword that
    # jsonschema ignores silently; docs/config.md would then be cut short without a failure.
    for node in _schemas(load_schema()):
        assert set(node) <= KEYWORDS, set(node) - KEYWORDS


@pytest.mark.parametrize(
    "path", ["config.yaml", *sorted(str(p.relative_to(REPO)) for p in (REPO / "configs").glob("*.yaml"))]
)
def test_every_shipped_config_validates(path):
    config = resolve(yaml.safe_load((REPO / path).read_text()))
    assert config["experiments"], path


def test_library_config_classes_take_their_defaults_from_the_schema():
    """Defaults live only in the schema: a class field named like a schema key has the schema's default."""
    import dataclasses

    from graftlab.fisher.rollouts import RolloutConfig
    from graftlab.synth.pedagogical import RewardConfig, TeacherConfig
    from graftlab.synth.star import StarConfig
    from graftlab.train.opsd import OpsdConfig
    from graftlab.train.sft import TrainConfig
    from graftlab.world.knowledge import KnowledgeConfig

    schema = load_schema()
    # A section kept in $defs (knowledge, which stages share) is named by its $ref.
    experiment = {
        name: schema["$defs"][sub["$ref"].rsplit("/", 1)[1]] if "$ref" in sub else sub
        for name, sub in schema["$defs"]["experiment"]["properties"].items()
    }
    top = schema["properties"]
    # TrainConfig also pretrains the tiny world: its epochs/steps choose a mode, they are no sft defaults.
    classes = {
        StarConfig: "star",
        TeacherConfig: "pedagogical",
        RewardConfig: "pedagogical",
        RolloutConfig: "fisher",
        OpsdConfig: "opsd",
        TrainConfig: None,
        KnowledgeConfig: "knowledge",
    }
    checked = 0
    for cls, section in classes.items():
        keys = experiment[section]["properties"] if section else {}
        for f in dataclasses.fields(cls):
            if f.default is dataclasses.MISSING:
                continue
            if f.name in keys and "default" in keys[f.name]:
                assert f.default == keys[f.name]["default"], (cls.__name__, f.name)
                checked += 1
            elif f.name == "precision":  # the one top-level key a class field stands for
                assert f.default == top[f.name]["default"], (cls.__name__, f.name)
                checked += 1
    assert checked >= 25


@pytest.mark.parametrize(
    "second, refused",
    [
        ({"source": "org/M-1B", "revision": "main", "params": 2e9}, True),  # the params hint is no difference
        ({"source": "org/M-1B", "revision": "main"}, True),
        ({"source": "org/M-1B", "revision": "stage1-step1000"}, False),
        ({"source": "org/M-1B", "revision": "main", "rope_from": "a"}, False),  # other weights' rope
        ({"source": "org/M-2B", "revision": "main"}, False),
    ],
)
def test_one_checkpoint_under_two_names_is_refused_by_the_second_name(second, refused):
    """Each job of the second would repeat the first's (the OLMo preset's stage-1 and base donors were one)."""
    config = {"models": {"a": {"source": "org/M-1B", "revision": "main", "params": 1e9}, "b": second}}
    if not refused:
        resolve(config)
        return
    with pytest.raises(ConfigError, match=r"^config key models\.b: is models\.a again \(source 'org/M-1B'"):
        resolve(config)
