"""Sampling that resumes (graftlab.sample_chunks): a job killed between chunks reruns to exactly the samples of
an uninterrupted run and samples only the chunks it had not finished."""

import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graftlab.sample_chunks import ChunkedSampler, Part, chunks_kept, close_store, inputs_fingerprint, open_store
from graftlab.sampling import Engine, SamplingConfig, load_sampler
from graftlab.tasks import arith, chat_prompt


class Killed(Exception):
    """The job's end, between two chunks (a chunk is written whole or not at all: `atomic_file`)."""


class Counting:
    """A sampler's calls counted, and the job killed after `kill_after` of them."""

    def __init__(self, sampler, kill_after: int | None = None) -> None:
        self.inner, self.kill_after, self.prompts = sampler, kill_after, []
        self.backend = sampler.backend

    def _count(self, prompts):
        if self.kill_after is not None and len(self.prompts) == self.kill_after:
            raise Killed
        self.prompts.append(list(prompts))

    def __call__(self, prompts, cfg):
        self._count(prompts)
        return self.inner(prompts, cfg)

    def sample_ids(self, prompts, cfg):
        self._count(prompts)
        return self.inner.sample_ids(prompts, cfg)


@pytest.fixture(scope="module")
def sampler(world_pico):
    return load_sampler(world_pico, "transformers")


@pytest.fixture(scope="module")
def prompts(sampler):
    return [chat_prompt(sampler.tok, p["prompt"]) for p in arith.sample_problems("add", 7, "test", 0)]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("kind", ["texts", "ids"])
def test_a_killed_run_reruns_to_the_uninterrupted_samples_and_redoes_no_finished_chunk(
    sampler, prompts, world_pico, tmp_path, temperature, kind
):
    cfg = SamplingConfig(n=2, temperature=temperature, top_p=1.0, max_new_tokens=6, seed=3)
    call = (lambda s: s(prompts, cfg)) if kind == "texts" else (lambda s: s.sample_ids(prompts, cfg))
    whole = call(ChunkedSampler(sampler, open_store(tmp_path / "whole", world_pico), chunk=3))

    store = open_store(tmp_path / "killed", world_pico)
    with pytest.raises(Killed):
        call(ChunkedSampler(Counting(sampler, kill_after=2), store, chunk=3))
    rerun = Counting(sampler)
    assert call(ChunkedSampler(rerun, open_store(store, world_pico), chunk=3)) == whole
    assert rerun.prompts == [prompts[6:]]  # chunks 1 and 2 read back, only the third sampled
    if temperature > 0:  # each chunk at a seed of its own: chunks of equal prompts differ
        again = ChunkedSampler(sampler, open_store(tmp_path / "twice", world_pico), chunk=3)
        twice = again([prompts[0]] * 6, cfg) if kind == "texts" else again.sample_ids([prompts[0]] * 6, cfg)
        assert twice[:3] != twice[3:]


def test_a_call_of_one_chunk_samples_what_an_unchunked_call_does(sampler, prompts, world_pico, tmp_path):
    cfg = SamplingConfig(n=3, temperature=1.0, top_p=0.9, max_new_tokens=5, seed=11)
    chunked = ChunkedSampler(sampler, open_store(tmp_path / "s", world_pico), chunk=len(prompts))
    assert chunked.sample_ids(prompts, cfg) == sampler.sample_ids(prompts, cfg)
    assert chunked(prompts, cfg) == sampler(prompts, cfg)
    assert chunked.backend == "transformers" and chunked.record == sampler.record  # the sampler's own


def test_another_calls_chunks_and_another_models_are_never_read(sampler, prompts, world_pico, pico_model, tmp_path):
    cfg = SamplingConfig(n=1, temperature=0.0, top_p=1.0, max_new_tokens=4, seed=0)
    store = open_store(tmp_path / "s", world_pico)
    ChunkedSampler(sampler, store, chunk=4)(prompts, cfg)
    counted = Counting(sampler)
    ChunkedSampler(counted, store, chunk=4)(prompts, SamplingConfig(1, 0.0, 1.0, 5, 0))
    assert len(counted.prompts) == 2  # a longer max_new_tokens: every chunk sampled anew
    assert len(list(store.glob("*.json"))) == 1 + 4
    other = pico_model("other")
    open_store(store, other)  # another model's samples are discarded
    assert [p.name for p in store.iterdir()] == ["fingerprint.json"]


@pytest.mark.parametrize("library", ["transformers", "torch"])
def test_a_store_written_by_other_sampling_code_is_discarded(world_pico, tmp_path, monkeypatch, library):
    """A store outlives its job (a graft sweep's): the samples of another transformers or torch version, or
    of another graftlab sampler, are drawn anew, not read back."""
    from importlib import metadata

    from graftlab import sample_chunks

    store = open_store(tmp_path / "s", world_pico, engine={"backend": "transformers"})
    (store / "key-0.json").write_text("[]")
    open_store(store, world_pico, engine={"backend": "transformers"})  # the same code: kept
    assert sorted(p.name for p in store.iterdir()) == ["fingerprint.json", "key-0.json"]
    installed = metadata.version
    monkeypatch.setattr(metadata, "version", lambda name: "0.0.1" if name == library else installed(name))
    sample_chunks.sampling_code.cache_clear()
    try:
        open_store(store, world_pico, engine={"backend": "transformers"})
    finally:
        sample_chunks.sampling_code.cache_clear()
    assert [p.name for p in store.iterdir()] == ["fingerprint.json"]
    code = json.loads((store / "fingerprint.json").read_text())["code"]
    assert code[library] == "0.0.1" and len(code["graftlab"]) == 16


def test_the_workflow_keeps_chunks_until_its_job_is_done(world_pico, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    store = tmp_path / "resume" / "results" / "x" / "mined.parquet"
    with chunks_kept(Engine.of("transformers", seed=2), store) as engine:
        assert engine == Engine("transformers", seed=2, resume=str(store))
        chunked = load_sampler(world_pico, engine)
        chunked(["a"], SamplingConfig(1, 0.0, 1.0, 2, 2))
        assert isinstance(chunked, ChunkedSampler) and len(list(store.glob("*.json"))) == 2
        assert "resume" not in json.dumps(chunked.record)
    assert not (tmp_path / "resume").exists()  # the store and its empty parents removed
    with pytest.raises(Killed), chunks_kept(Engine.of("transformers"), store):
        os.makedirs(store)
        raise Killed
    assert store.is_dir()  # a failed job leaves its chunks for the rerun
    close_store(store)
    # A job of 4 processes (one a GPU) runs two engines of 2 GPUs, four of one; the count is no option of
    # the samples, so the record leaves it out.
    tp2 = Engine("vllm", tensor_parallel_size=2)
    with chunks_kept(tp2, store, 4) as two, chunks_kept(Engine("vllm"), store, 4) as four:
        assert (two.data_parallel, four.data_parallel) == (2, 4)
        assert "data_parallel" not in json.dumps(two.record("vllm", "test"))


def test_a_kept_store_outlives_its_job_with_the_chunks_it_used_and_serves_the_next(
    sampler, prompts, world_pico, tmp_path, monkeypatch
):
    """A graft sweep's store (`keep`): the next job sampling the same model reads its calls back instead of
    sampling them, and a store holds only the chunks of the last job's calls, whether read or written.
    From another working directory the run's copy (file times kept) keeps its store too."""
    import shutil

    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    shutil.copytree(world_pico, run / "model")  # copy2: its files' times kept
    store = run / "resume" / "eval" / "metrics.json"
    greedy, longer = SamplingConfig(1, 0.0, 1.0, 4, 0), SamplingConfig(1, 0.0, 1.0, 5, 0)

    def job(*cfgs, where=run) -> Counting:
        counted = Counting(sampler)
        with chunks_kept(Engine("transformers"), where / "resume" / "eval" / "metrics.json", keep=True) as engine:
            chunked = load_sampler(where / "model", engine)
            chunked.inner, chunked.chunk = counted, 4
            for cfg in cfgs:
                chunked(prompts, cfg)
        return counted

    def an_hour_ago() -> None:
        """The store's chunks as an earlier job left them: a file system stamps times by a clock tick of
        some milliseconds, within which two jobs of this test may both run."""
        for chunk in store.glob("*-*.json"):
            os.utime(chunk, ns=(chunk.stat().st_atime_ns, chunk.stat().st_mtime_ns - 3600 * 10**9))

    monkeypatch.chdir(run)
    assert len(job(greedy, longer).prompts) == 4  # 2 calls of 2 chunks, sampled and kept
    assert len(list(store.glob("*-*.json"))) == 4
    an_hour_ago()
    assert job(greedy).prompts == []  # read back, and the other call's chunks gone
    assert len(list(store.glob("*-*.json"))) == 2
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    monkeypatch.chdir(copy)
    assert job(greedy, where=copy).prompts == []
    (copy / "model" / "model.safetensors").touch()  # the weights rewritten: sampled anew
    assert len(job(greedy, where=copy).prompts) == 2


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("kind", ["texts", "ids"])
def test_engines_sampling_at_once_sample_what_one_engine_does(
    world_pico, prompts, tmp_path, monkeypatch, temperature, kind
):
    """Two engine processes (CPU processes here; on a GPU node each on its own GPUs) are dealt the 3 chunks
    of a call, 0 and 2 to the first: the job reads back exactly one engine's samples, and holds no engine."""
    import torch

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each engine process: the same sums, the same draws
    try:
        cfg = SamplingConfig(n=2, temperature=temperature, top_p=1.0, max_new_tokens=6, seed=3)
        call = (lambda s: s(prompts, cfg)) if kind == "texts" else (lambda s: s.sample_ids(prompts, cfg))
        one = load_sampler(world_pico, Engine("transformers", resume=str(tmp_path / "one")))
        one.chunk = 3
        two = load_sampler(world_pico, Engine("transformers", resume=str(tmp_path / "two"), data_parallel=2))
        two.chunk = 3
        assert two.inner is None and call(two) == call(one)
    finally:
        torch.set_num_threads(threads)
    assert len(list((tmp_path / "two").glob("*-*.json"))) == 3


def test_engines_that_fail_are_one_line_and_write_no_chunk(prompts, tmp_path):
    from graftlab.errors import GraftlabError
    from graftlab.sample_chunks import DataParallel

    cfg = SamplingConfig(n=1, temperature=0.0, top_p=1.0, max_new_tokens=4, seed=0)
    engines = DataParallel(str(tmp_path / "no-model"), Engine("transformers"), 2)
    chunks = {i: (prompts[i : i + 1], tmp_path / f"c-{i}.json") for i in range(2)}
    with pytest.raises(GraftlabError, match=r"^sampling: engine 1 of 2 failed \(exit status 1\); see the log above$"):
        engines.sample("texts", cfg, chunks)
    assert not list(tmp_path.glob("c-*.json"))


class Drawn:
    """A sampler whose every answer is a function of its prompt, its index and the seed it was drawn at, as a
    real sampler's are at a fixed seed; it counts the prompts it samples."""

    backend = "test"

    def __init__(self) -> None:
        self.prompts: list[str] = []

    def __call__(self, prompts, cfg):
        self.prompts += prompts
        return [[f"{p}|{cfg.seed}|{j}" for j in range(cfg.n)] for p in prompts]

    def sample_ids(self, prompts, cfg):
        return [
            [([len(p)], [cfg.seed, j]) for j, _ in enumerate(group)] for p, group in zip(prompts, self(prompts, cfg))
        ]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    count=st.integers(0, 30),
    chunk=st.integers(1, 7),
    parts=st.integers(1, 5),
    order=st.randoms(use_true_random=False),
    kind=st.sampled_from(["texts", "ids"]),
)
def test_parts_of_a_call_fill_the_store_with_exactly_the_uninterrupted_samples(
    tmp_path_factory, count, chunk, parts, order, kind
):
    """Whatever the prompts, chunk size and count of parts, and in whatever order the parts run: each part
    samples only its chunks (every `parts`-th) and returns nothing, the parts together sample every prompt
    once, and the job that reads them back samples nothing and returns what one uninterrupted sampler does."""
    tmp = tmp_path_factory.mktemp("parts")
    prompts = [f"p{i}" for i in range(count)]
    cfg = SamplingConfig(n=2, temperature=1.0, top_p=1.0, max_new_tokens=4, seed=5)

    def call(sampler):
        return sampler(prompts, cfg) if kind == "texts" else sampler.sample_ids(prompts, cfg)

    whole = call(ChunkedSampler(Drawn(), tmp / "whole", chunk=chunk))
    store, drawn = tmp / "parts", []
    for index in order.sample(range(parts), parts):
        inner = Drawn()
        got = call(ChunkedSampler(inner, store, chunk=chunk, part=Part(index, parts)))
        assert got is None if parts > 1 else got == whole
        mine = [
            p for i in range(0, count, chunk) if Part(index, parts).takes(i // chunk) for p in prompts[i : i + chunk]
        ]
        assert inner.prompts == mine
        drawn += inner.prompts
    assert sorted(drawn) == sorted(prompts)
    reader = Drawn()
    assert call(ChunkedSampler(reader, store, chunk=chunk)) == whole
    assert reader.prompts == []


@pytest.mark.parametrize(("index", "count"), [(2, 2), (-1, 2), (0, 0)])
def test_a_part_outside_its_count_is_refused(index, count):
    with pytest.raises(ValueError, match="a part is from 0 to count - 1"):
        Part(index, count)


def test_parts_of_a_real_models_sampling_read_back_as_one_run(sampler, prompts, world_pico, tmp_path):
    """The pico model sampled at temperature 1 in 2 parts of chunks of 3 prompts: the job reading them back
    gets the samples of one uninterrupted run, and its engine samples nothing."""
    cfg = SamplingConfig(n=2, temperature=1.0, top_p=1.0, max_new_tokens=6, seed=3)
    whole = ChunkedSampler(sampler, open_store(tmp_path / "whole", world_pico), chunk=3)(prompts, cfg)
    store = tmp_path / "parts"
    for index in (1, 0):
        part = Counting(sampler)
        assert ChunkedSampler(part, open_store(store, world_pico), chunk=3, part=Part(index, 2))(prompts, cfg) is None
        assert part.prompts == ([prompts[3:6]] if index else [prompts[:3], prompts[6:]])
    reader = Counting(sampler)
    assert ChunkedSampler(reader, open_store(store, world_pico), chunk=3)(prompts, cfg) == whole
    assert reader.prompts == []


def test_a_rebuilt_models_store_is_kept_under_its_inputs(world_pico, pico_model, tmp_path):
    """A store opened under an inputs fingerprint survives a new model directory of the same inputs (a
    graft made anew each attempt) and is emptied when an input file changes."""
    other = pico_model("other")
    mark = inputs_fingerprint([world_pico, other], {"scale": 0.5})
    store = open_store(tmp_path / "s", tmp_path / "scratch-1", mark)
    (store / "chunk-0.json").write_text("[]")
    assert open_store(store, tmp_path / "scratch-2", inputs_fingerprint([world_pico, other], {"scale": 0.5}))
    assert (store / "chunk-0.json").exists()
    assert inputs_fingerprint([world_pico, other], {"scale": 1.0}) != mark
    weights = other / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 1))
    open_store(store, tmp_path / "scratch-3", inputs_fingerprint([world_pico, other], {"scale": 0.5}))
    assert not (store / "chunk-0.json").exists()


def test_a_store_opened_by_two_parts_at_once_keeps_the_first_ones_chunks(world_pico, tmp_path, monkeypatch):
    """Parts of one job start together: the second part's store appears whole or not at all, so the first
    part's store, made a moment before (its chunk already in it), is neither taken for stale nor replaced."""
    from pathlib import Path

    store, rename, others = tmp_path / "s", Path.rename, []

    def other_part_first(self, target):
        if Path(target) == store and not others:
            others.append("the other part")  # opening its store a moment before this one's rename
            open_store(store, world_pico)
            (store / "chunk-0.json").write_text("[]")
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", other_part_first)
    assert open_store(store, world_pico) == store
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]  # no half-made store left beside it
    assert (store / "chunk-0.json").exists() and (store / "fingerprint.json").exists()
