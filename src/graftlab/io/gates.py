"""The gates a command's input passes before any work, one per kind of input: numbers, outputs and model
directories here; tables in `graftlab.io.tables`; the workflow config in `graftlab.planning.config`.

A gate refuses in one line naming the flag, file, key, row or tensor, before anything is written. A refusal
about the command line itself (a flag's value, two flags that contradict, an output that is an input) is a
`UsageError` (exit status 2); one about what the files hold a `GraftlabError` (exit status 1).

Importable without torch: `graftlab --help` and the workflow's parse load it.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from graftlab.errors import GraftlabError, UsageError


def number(
    value: Any,
    name: str,
    low: float | None = None,
    high: float | None = None,
    above: float | None = None,
    integer: bool = False,
) -> float | int:
    """`value` as a number, refused (`UsageError` naming `name`) unless it is one, is finite and lies in
    [low, high], above `above` (strictly), and, with `integer`, whole. NaN compares false with every bound,
    so finiteness is asked first, never left to a comparison."""
    try:
        parsed = float(value)
    except (TypeError, ValueError):
        raise UsageError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(parsed):
        raise UsageError(f"{name} must be finite, got {value!r}")
    if integer:
        if isinstance(value, float) or (isinstance(value, str) and not value.strip().lstrip("+-").isdigit()):
            raise UsageError(f"{name} must be a whole number, got {value!r}")
        parsed = int(value)
    bounds = [(low is not None and parsed < low, f">= {low}"), (high is not None and parsed > high, f"<= {high}")]
    bounds.append((above is not None and parsed <= above, f"> {above}"))
    for broken, rule in bounds:
        if broken:
            raise UsageError(f"{name} must be {rule}, got {value!r}")
    return parsed


def flag(
    low: float | None = None, high: float | None = None, above: float | None = None, integer: bool = False
) -> Callable[[str], float | int]:
    """An argparse `type=` that passes a flag's text through `number`: argparse names the flag and exits
    with status 2 on a refusal."""

    def parse(text: str) -> float | int:
        try:
            return number(text, "the value", low, high, above, integer)
        except UsageError as err:
            raise argparse.ArgumentTypeError(str(err).removeprefix("the value ")) from None

    parse.__name__ = "integer" if integer else "number"  # what argparse's message calls a bad value
    return parse


# The largest learning rate taken: AdamW moves every weight by about the learning rate a step, so one above 1
# outweighs any weight, and past about 3e37 the optimizer's own arithmetic overflows float32 (a traceback,
# found by tests/test_bad_input_properties).
MAX_LR = 1.0


def threads() -> Callable[[str], int]:
    """The gate of a `--threads` flag: at least 1, at most this machine's cores. More OpenMP threads than cores
    only slow torch down, and some hundred thousand crash the process (found by tests/test_bad_input_properties)."""
    return flag(low=1, high=os.cpu_count() or 1, integer=True)


def output(out: str | Path, inputs: Mapping[str, str | Path | None], flag_name: str = "--out") -> None:
    """Refuse an output that would destroy what the command reads or what graftlab did not write: one of
    `inputs` (by flag), a directory holding one of them or lying inside one; a file; a non-empty directory
    without graftlab.json. The command writes `out` atomically, replacing it whole."""
    from graftlab.io.provenance import refuse_foreign_dir

    target = Path(out).resolve()
    for name, path in inputs.items():
        if path is None:
            continue
        given = Path(path).resolve()
        if target == given or target in given.parents or given in target.parents:
            relation = "is" if target == given else "holds" if target in given.parents else "lies inside"
            raise UsageError(f"{flag_name} {out} {relation} {name} {path}: writing it would replace that input")
    refuse_foreign_dir(out, flag_name)


def model_dir(path: str | Path, role: str, finite: bool = False) -> dict:
    """The config of the Hugging Face model directory at `path` (its `role` names it in a refusal): a
    directory with a readable config.json and, with `finite`, every floating weight finite (a NaN weight
    makes every loss, Fisher and SVD of the model NaN, hours later)."""
    from graftlab.io.safetensors_io import read_config

    where = Path(path)
    if not where.is_dir():
        raise GraftlabError(f"{role} {path}: model directory not found")
    config = read_config(where)
    if config is None:
        raise GraftlabError(f"{role} {path}: not a Hugging Face model directory (no config.json)")
    if finite:
        from graftlab.io.safetensors_io import refuse_nonfinite

        refuse_nonfinite(where, role)
    return config


def context_length(config: dict) -> int | None:
    """The tokens a model attends over, from its config (a multimodal one's text config), or None."""
    text = config.get("text_config") or {}
    return config.get("max_position_embeddings") or text.get("max_position_embeddings")


def chat_tokenizer(path: str | Path, role: str, template_from: str | Path | None = None):
    """The tokenizer of the model at `path`, with a chat template: its own, or with `template_from` the
    template of that model's tokenizer (a donor from pre-training has none, and learns the post model's
    format: docs/methods.md). Refused in one line when the directory has no tokenizer or no template."""
    tokenizer = _tokenizer(path, role)
    if template_from is not None:
        tokenizer.chat_template = _tokenizer(template_from, "--chat-template-from").chat_template
        if not tokenizer.chat_template:
            raise GraftlabError(f"--chat-template-from {template_from}: its tokenizer has no chat template")
    if not tokenizer.chat_template:
        raise GraftlabError(
            f"{role} {path}: its tokenizer has no chat template, which every prompt and example is formatted with; "
            "give --chat-template-from the post-trained model's directory"
        )
    return tokenizer


# Files one of which every saved tokenizer has; without any, transformers may still build one from elsewhere.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def _tokenizer(path: str | Path, role: str):
    from transformers import AutoTokenizer

    if Path(path).is_dir() and not any((Path(path) / name).is_file() for name in TOKENIZER_FILES):
        raise GraftlabError(f"{role} {path}: no usable tokenizer (none of {', '.join(TOKENIZER_FILES)})")
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError, KeyError, TypeError) as err:  # transformers' words for "no tokenizer here"
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise GraftlabError(f"{role} {path}: no usable tokenizer ({first})") from None
