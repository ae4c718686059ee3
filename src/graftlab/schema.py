"""The configuration schema (`src/graftlab/config.schema.yaml`, shipped inside the package), the one place
defaults live.

Library config classes take the defaults of their fields from here (`schema_default`), so a default
changed in the schema changes the workflow and the library alike. Standard library and PyYAML only.
"""

import copy
from functools import cache
from importlib.resources import files
from importlib.resources.abc import Traversable
from pathlib import Path

import yaml

# Read through importlib.resources: the same in a checkout, an installed wheel or a zipped package.
SCHEMA = files("graftlab") / "config.schema.yaml"


# libyaml's loader where PyYAML was built with it: the schema is 50 KB, which the pure-Python loader
# takes 0.5 s to read, at every snakemake start and every job a cluster runs.
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load_schema(path: Path | Traversable = SCHEMA) -> dict:
    return yaml.load(path.read_text(), Loader=_LOADER)


@cache
def shipped_schema() -> dict:
    """The shipped schema, read once a process and shared: read it, never change it (`load_schema` gives a
    copy of one's own)."""
    return load_schema()


def schema_default(section: str, key: str):
    """The schema's default of `key` in an experiment's `section` (e.g. `star`, `fisher`), or of the
    top-level `key` when `section` is empty. A key without a default is an error: the caller's field
    would have none either."""
    schema = shipped_schema()
    if section:
        sub = schema["$defs"]["experiment"]["properties"][section]
        # A section kept in $defs (`knowledge`, which stages share) is named by its $ref.
        props = (schema["$defs"][sub["$ref"].rsplit("/", 1)[1]] if "$ref" in sub else sub)["properties"]
    else:
        props = schema["properties"]
    if key not in props or "default" not in props[key]:
        where = f"experiments.<name>.{section}.{key}" if section else key
        raise KeyError(f"the schema has no default for {where}")
    return copy.deepcopy(props[key]["default"])
