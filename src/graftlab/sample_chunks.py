"""Sampling that resumes: a sampler (`graftlab.sampling.load_sampler`) whose calls sample `CHUNK_PROMPTS`
prompts at a time and keep each finished chunk in a store, so a job killed mid-way (a preemption, a time
limit) resamples only the chunks it had not finished.

A chunk is named by what determines its samples: the call's kind (texts or token ids), all its prompts, the
sampling config and its index, hashed. A rerun that makes the same calls finds them; a stage whose later
calls depend on earlier results (STaR's attempts on the still unsolved) finds those too, since the earlier
results it reads back are the same. The store is opened under the model's fingerprint (its directory and
its weight files' sizes and times) and emptied when that changed: samples of another model are not reused.

The first chunk of a call samples at the call's seed, so a call of one chunk (every tiny-world call) samples
exactly what an unchunked call does; chunk i > 0 at a seed drawn from the call's and i. A resumed run is
therefore identical to an uninterrupted one (tests/test_sample_chunks.py), greedy or not.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
from collections.abc import Iterator
from dataclasses import asdict, replace
from pathlib import Path

from graftlab.io.atomic import atomic_file
from graftlab.streams import stream_seed

# Prompts a chunk: at 16 samples of 8k tokens a prompt, about 33M tokens, minutes on a GPU.
CHUNK_PROMPTS = 128
FINGERPRINT = "fingerprint.json"


def model_fingerprint(model_dir) -> dict:
    """What identifies a model directory's weights without reading them."""
    root = Path(model_dir)
    files = sorted(root.glob("*.safetensors")) + sorted(root.glob("*.bin"))
    return {"model": str(root.resolve()), "files": [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]}


def open_store(store, model_dir) -> Path:
    """The chunk store `store` for samples of the model at `model_dir`, emptied first when it holds another
    model's."""
    store = Path(store)
    mark, text = store / FINGERPRINT, json.dumps(model_fingerprint(model_dir), sort_keys=True)
    if store.exists() and (not mark.exists() or mark.read_text() != text):
        print(f"sampling: discarding {store}, written for another model", flush=True)
        shutil.rmtree(store)
    store.mkdir(parents=True, exist_ok=True)
    mark.write_text(text)
    return store


def close_store(store) -> None:
    """Remove a finished job's store and the empty folders above it (a sweep's would pile up)."""
    store = Path(store)
    shutil.rmtree(store, ignore_errors=True)
    for parent in store.parents:
        if parent == Path(".") or not parent.is_dir() or any(parent.iterdir()):
            break
        parent.rmdir()


class ChunkedSampler:
    """`sampler` sampling `chunk` prompts at a time, each finished chunk kept in `store` and read back by a
    later call that asks for it. Everything else (its backend, record, tokenizer) is the sampler's."""

    def __init__(self, sampler, store, chunk: int = CHUNK_PROMPTS) -> None:
        if chunk < 1:
            raise ValueError(f"chunk must be at least 1 prompt, got {chunk}")
        self.inner, self.store, self.chunk = sampler, Path(store), chunk

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def __call__(self, prompts: list[str], cfg) -> list[list[str]]:
        return self._chunks("texts", prompts, cfg, self.inner)

    def sample_ids(self, prompts: list[str], cfg) -> list:
        samples = self._chunks("ids", prompts, cfg, self.inner.sample_ids)
        return [[(list(p), list(c)) for p, c in group] for group in samples]

    def _chunks(self, kind: str, prompts: list[str], cfg, sample) -> list:
        call = json.dumps([kind, list(prompts), asdict(cfg)], sort_keys=True)
        key = hashlib.sha256(call.encode()).hexdigest()[:20]
        out: list = []
        starts = range(0, len(prompts), self.chunk)
        for i, start in enumerate(starts):
            path = self.store / f"{key}-{i}.json"
            if not path.exists():
                seed = cfg.seed if i == 0 else stream_seed("sampling-chunk", cfg.seed, i)
                got = sample(prompts[start : start + self.chunk], replace(cfg, seed=seed))
                with atomic_file(path) as tmp:
                    tmp.write_text(json.dumps(got))
            elif len(starts) > 1:
                print(f"sampling: chunk {i + 1} of {len(starts)} read back from {self.store}", flush=True)
            out += json.loads(path.read_text())
        return out


@contextlib.contextmanager
def chunks_kept(engine, store) -> Iterator:
    """A workflow job's sampling engine (`graftlab.sampling.Engine`) keeping its finished chunks in `store`,
    which is removed once the job's work is done; a failure or a kill leaves it for the rerun."""
    yield replace(engine, resume=str(store))
    close_store(store)
