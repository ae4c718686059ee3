"""Model references: whether a source is local or a hub id (one rule for models and data sets), fetching
a model into `resources/models/`, and copying the non-weight files of a model directory.

Standard library only at import time (the workflow parse imports `looks_local`); huggingface_hub and
the safetensors reader are imported where used.
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
from pathlib import Path

from graftlab.errors import GraftlabError
from graftlab.io.atomic import atomic_dir
from graftlab.io.provenance import PROVENANCE_NAME, write_provenance

# Data files a source may name; a source with such a suffix is a local file even before it exists (a
# file another rule writes), never a hub id.
DATA_SUFFIXES = (".parquet", ".jsonl", ".ndjson", ".json")


def looks_local(source: str) -> bool:
    """Whether `source` names a local path rather than a hub id: it exists, starts like a path (/ . ~) or
    names a data file type. Such a path must exist here: it is never sent to the hub. (The workflow asks
    too, to make a local file an input that another rule may build.)"""
    return Path(source).exists() or source.startswith(("/", ".", "~")) or Path(source).suffix in DATA_SUFFIXES


# Files of a model directory that are weights, graftlab's own record, or trainer state: a derived
# model must never inherit them from its source.
_NOT_COPIED_SUFFIXES = (
    ".safetensors",
    ".safetensors.index.json",
    ".bin",
    ".bin.index.json",
    ".pt",
    ".pth",
    ".ckpt",
)
_NOT_COPIED_NAMES = {PROVENANCE_NAME, "trainer_state.json"}


def copy_model_files(src_dir: str | Path, dst_dir: str | Path) -> list[str]:
    """Copy the non-weight files of a model directory (config, generation config, tokenizer, chat
    template, ...). Subdirectories are skipped: in HF model directories they hold trainer checkpoints
    and logs, never files a model needs to load. Returns the names copied."""
    src_dir, dst_dir = Path(src_dir), Path(dst_dir)
    copied = []
    for path in sorted(src_dir.iterdir()):
        if not path.is_file() or path.name in _NOT_COPIED_NAMES or path.name.endswith(_NOT_COPIED_SUFFIXES):
            continue
        if path.name.startswith(("optimizer", "scheduler", "rng_state", "scaler", "training_args")):
            continue
        shutil.copy2(path, dst_dir / path.name)
        copied.append(path.name)
    return copied


# What a fetched model needs to load, and nothing else: weights as safetensors only (pickled .bin
# weights run code when loaded, and every model graftlab targets ships safetensors), the configs, and
# every tokenizer and chat-template format transformers reads.
MODEL_FILE_PATTERNS = (
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "*.tiktoken",
    "chat_template.jinja",
    "chat_template.json",
)


def fetch_model(
    source: str, out_dir: str | Path, revision: str | None = None, rope_from: str | Path | None = None
) -> Path:
    """Write the model `source` to `out_dir`: its top-level model files (`MODEL_FILE_PATTERNS`) and a
    provenance file, atomically, so a failed fetch leaves nothing at `out_dir`.

    `source` is a local model directory (copied; `revision` must be None, it pins hub ids only) or a
    hub id, downloaded at `revision` (default: the main branch) and recorded with its resolved commit.
    A source that starts like a path (/ . ~) is local whether or not it exists: never sent to the hub.
    `rope_from`, a model directory, lends its rope scaling (`copy_rope`), recorded in provenance."""
    local = Path(source).expanduser()
    is_local = looks_local(source)
    if is_local:
        _check_local_source(source, local, revision)
    with atomic_dir(out_dir) as tmp:
        if is_local:
            _copy_matching(local, tmp)
            commit = None
        else:
            commit = _download(source, revision, tmp)
        _check_fetched(source, tmp)
        rope = copy_rope(tmp, rope_from) if rope_from is not None else None
        write_provenance(tmp, {"source": source, "revision": revision, "commit": commit}, {"rope_from": rope})
    return Path(out_dir)


# What long-context rope scaling consists of in an HF config: the scaling and the context it reaches.
ROPE_KEYS = ("rope_scaling", "max_position_embeddings")


def copy_rope(model_dir: str | Path, from_dir: str | Path) -> dict:
    """Give `model_dir`'s config.json the rope scaling of `from_dir`'s (YaRN long context, say), as the
    grafting paper's Appendix E does for earlier-stage donors, so a donor's update is learnt and grafted
    at the post model's context length. Returns the change, {model, key: [before, after]}, for provenance."""
    path = Path(model_dir) / "config.json"
    config = json.loads(path.read_text())
    source = json.loads((Path(from_dir) / "config.json").read_text())
    change = {"model": str(from_dir)}
    for key in ROPE_KEYS:
        if config.get(key) != source.get(key):
            change[key] = [config.get(key), source.get(key)]
            config[key] = source.get(key)
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return change


def _check_local_source(source: str, path: Path, revision: str | None) -> None:
    if not path.exists():
        raise GraftlabError(
            f"model source {source}: no such directory (a path-like source is never looked up on the hub)"
        )
    if not path.is_dir():
        raise GraftlabError(f"model source {source}: not a directory")
    if revision is not None:
        raise GraftlabError(f"model source {source}: revision {revision!r} pins hub ids only; {source} is local")


def _copy_matching(src_dir: Path, dst_dir: Path) -> None:
    for path in sorted(src_dir.iterdir()):
        if path.is_file() and any(fnmatch.fnmatchcase(path.name, p) for p in MODEL_FILE_PATTERNS):
            shutil.copy2(path, dst_dir / path.name)


def _download(repo_id: str, revision: str | None, out: Path) -> str:
    """Download the model files of hub repo `repo_id` at `revision` into `out`; returns the commit."""
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import HTTPError  # the transport's base error (httpx's), raised unwrapped

    try:
        # Resolve a branch or tag once and download that commit, so the commit recorded is the one
        # fetched even if the branch moves meanwhile; snapshot_download skips its own lookup for a hash.
        commit = HfApi().repo_info(repo_id, revision=revision).sha
        snapshot_download(
            repo_id=repo_id,
            revision=commit,
            local_dir=out,
            allow_patterns=list(MODEL_FILE_PATTERNS),
            ignore_patterns=["*/*"],  # subfolders hold other formats (e.g. original/ weights), never needed
        )
    except (OSError, ValueError, HTTPError) as e:
        cause = " ".join(f"{type(e).__name__}: {e}".split())  # hub messages span lines; ours is one line
        where = f"model {repo_id!r} at revision {revision or 'main'}"
        raise GraftlabError(f"{where}: cannot fetch from the hub: {cause}") from e
    # snapshot_download's bookkeeping for resuming into local_dir; not part of the model.
    shutil.rmtree(out / ".cache", ignore_errors=True)
    return commit


def _check_fetched(source: str, model_dir: Path) -> None:
    """A fetched model holds config.json and a complete set of safetensors weights, all finite."""
    names = sorted(p.name for p in model_dir.iterdir())
    if "config.json" not in names or not any(n.endswith(".safetensors") for n in names):
        raise GraftlabError(
            f"model {source}: needs config.json and safetensors weights (pickled .bin weights are not "
            f"fetched); found {names or 'no model files'}"
        )
    from graftlab.io.safetensors_io import refuse_nonfinite  # torch: kept out of the workflow parse

    try:
        # Every shard whole and every weight finite, once, where a model enters the workflow: a NaN weight
        # would make every later job's numbers NaN (jobs downstream read only what graftlab wrote, whose
        # trainers stop on divergence and whose grafts refuse a non-finite result).
        refuse_nonfinite(model_dir, "weights")
    except GraftlabError as e:
        raise GraftlabError(f"model {source}: {e}") from None


# Set by the workflow for every process it starts (rules/common.smk): compute jobs, often on nodes
# without internet, read only what the local fetch rules wrote.
OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")


def hub_offline(environ: dict | None = None) -> None:
    """Switch the hub off for this process and the jobs it starts."""
    environ = os.environ if environ is None else environ
    for var in OFFLINE_VARS:
        environ[var] = "1"


def hub_online(environ: dict | None = None) -> None:
    """Switch the hub back on: the fetch rules only, run where Snakemake runs (a login node with
    internet). Call before huggingface_hub or datasets is imported: both read these at import."""
    environ = os.environ if environ is None else environ
    for var in OFFLINE_VARS:
        environ.pop(var, None)
