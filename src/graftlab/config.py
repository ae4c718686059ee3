"""The workflow configuration: validation against `schemas/config.schema.yaml` and its defaults.

The schema is the only place defaults live. jsonschema validates but does not fill defaults, so the
`properties` keyword is extended to insert them before descending (the recipe from jsonschema's FAQ).
"""

import copy
from pathlib import Path

import yaml
from jsonschema import Draft202012Validator, validators

SCHEMA = Path(__file__).resolve().parents[2] / "schemas" / "config.schema.yaml"


class ConfigError(ValueError):
    """A configuration problem, named by its key path."""


def _with_defaults(base):
    check_properties = base.VALIDATORS["properties"]

    def properties(validator, props, instance, schema):
        if isinstance(instance, dict):
            for key, sub in props.items():
                if "default" in sub and key not in instance:
                    instance[key] = copy.deepcopy(sub["default"])
        yield from check_properties(validator, props, instance, schema)

    return validators.extend(base, {"properties": properties})


def load_schema(path: Path = SCHEMA) -> dict:
    return yaml.safe_load(Path(path).read_text())


def resolve(config: dict, schema: dict | None = None) -> dict:
    """Validate `config` in place, fill in every default, and return it.

    Raises ConfigError with one line naming the offending key.
    """
    schema = schema or load_schema()
    validator = _with_defaults(Draft202012Validator)(schema)
    # Fill defaults first (a full pass), then report the most relevant error, if any.
    errors = sorted(validator.iter_errors(config), key=lambda e: (len(e.path), list(map(str, e.path))))
    if errors:
        err = errors[0]
        where = ".".join(map(str, err.absolute_path)) or "(top level)"
        raise ConfigError(f"config key {where}: {err.message}")
    _check_semantics(config)
    return config


def _check_semantics(config: dict) -> None:
    """What a schema cannot say: cross-references between keys."""
    ladder = config["world"]["pretrain"]["ladder"]
    steps = config["world"]["pretrain"]["steps"]
    if max(ladder) != steps:
        raise ConfigError(f"config key world.pretrain.ladder: its last checkpoint must be step {steps} (the base model)")
    for name, exp in config["experiments"].items():
        for donor in exp["donors"]:
            if int(donor.split("~")[1]) not in ladder:
                raise ConfigError(f"config key experiments.{name}.donors: {donor} is not on world.pretrain.ladder {ladder}")
