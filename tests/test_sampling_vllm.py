"""Every sampling stage through its vLLM path, on a fake `vllm` (tests/fake_vllm) that records its calls:
the engine gets the configured options, the job logs the backend, the stats keep it, and OPSD moves
its current weights into the engine before each round of sampling."""

import json
import os
import re
import sys
from pathlib import Path

import polars as pl
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from graftlab.sampling import Engine, SamplingConfig, engine_length, grpo_vllm_kwargs, load_sampler
from graftlab.tasks import arith, chat_completion
from graftlab.world import build
from graftlab.world.tokenizer import build_tokenizer

FAKE = Path(__file__).parent / "fake_vllm"
ARCH = dict(hidden_size=16, intermediate_size=32, layers=1, heads=2, kv_heads=1, max_positions=128)
OLD_TASKS = ["add", "sub", "compare"]
ENGINE = Engine(
    "vllm",
    max_model_len=512,
    gpu_memory_utilization=0.55,
    colocate_gpu_memory_utilization=0.2,
    tensor_parallel_size=1,
    dtype="float32",
    enforce_eager=True,
    seed=7,
)
OPTIONS = dict(
    max_model_len=512,
    gpu_memory_utilization=0.55,
    tensor_parallel_size=1,
    dtype="float32",
    enforce_eager=True,
    seed=7,
    worker_extension_cls="graftlab.sampling.WorkerSwap",
)
LOGGED = "sampling backend: vllm (configured)"


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("vllm-world")
    tok = build_tokenizer()
    build.init_model(tok, ARCH, seed=0).save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    build.make_benchmarks(OLD_TASKS, 6, 0, root / "benchmarks")
    pl.DataFrame(arith.sample_problems("mul", 6, "candidates", 0)).write_parquet(root / "problems.parquet")
    return root


@pytest.fixture
def vllm(monkeypatch):
    monkeypatch.syspath_prepend(str(FAKE))
    sys.modules.pop("vllm", None)
    import vllm

    vllm.CALLS.clear()
    monkeypatch.setattr(vllm, "RESPOND", vllm._default_response)
    yield vllm
    # Gone again, so that the other tests see a machine without vLLM.
    sys.modules.pop("vllm", None)


def calls(vllm, name: str) -> list:
    return [details for called, details in vllm.CALLS if called == name]


def right(prompt: str, _index: int) -> str:
    """The solved completion of the arithmetic problem in a chat prompt's user turn."""
    user = re.search(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", prompt, re.S).group(1)
    thinking, answer = arith.solve("mul", user.split("\n")[0])
    return chat_completion(thinking, answer)


def check_engine(vllm, model_dir: Path, capsys, stats: dict | None = None) -> None:
    (init,) = calls(vllm, "init")
    assert init == {"model": str(model_dir), **OPTIONS}
    assert LOGGED in capsys.readouterr().out
    if stats is not None:
        assert stats["sampling"] == {"backend": "vllm", "why": "configured", "vllm": ENGINE.record("vllm", "")["vllm"]}
        assert stats["sampling"]["vllm"]["max_model_len"] == 512


def test_mining(world, vllm, tmp_path, capsys):
    from graftlab.synth.mining import MiningConfig, mine

    cfg = MiningConfig(samples=3, max_pass_rate=0.5, heldout=2, temperature=0.8, max_new_tokens=16, seed=1)
    mine(
        world / "model", world / "problems.parquet", cfg, tmp_path / "train.parquet", tmp_path / "held.parquet", ENGINE
    )
    check_engine(vllm, world / "model", capsys)
    (gen,) = calls(vllm, "generate")
    assert len(gen["prompts"]) == 6
    assert {k: gen["params"].kwargs[k] for k in ("n", "temperature", "max_tokens")} == {
        "n": 3,
        "temperature": 0.8,
        "max_tokens": 16,
    }
    # The fake's fixed completion is wrong everywhere: every problem is hard.
    assert pl.read_parquet(tmp_path / "train.parquet").height == 4


@pytest.mark.parametrize("stage", ["star", "teacher_traces", "pedagogical_traces"])
def test_trace_stages(world, vllm, tmp_path, capsys, monkeypatch, stage):
    from graftlab.synth.pedagogical import write_teacher_traces
    from graftlab.synth.star import StarConfig, write_star

    monkeypatch.setattr(vllm, "RESPOND", right)
    write = write_teacher_traces if stage == "pedagogical_traces" else write_star
    args = (world / "model", world / "problems.parquet", StarConfig(attempts=2), tmp_path / "sft.parquet")
    stats = write(*args, tmp_path / "sft.json", ENGINE)
    check_engine(vllm, world / "model", capsys, json.loads((tmp_path / "sft.json").read_text()))
    assert stats["traces"] == 6 and pl.read_parquet(tmp_path / "sft.parquet").height == 6


def test_retention_rollouts(world, vllm, tmp_path, capsys):
    from graftlab.fisher.rollouts import RolloutConfig, write_rollouts

    benchmarks = sorted((world / "benchmarks").glob("*.parquet"))
    out, stats = tmp_path / "rollouts.parquet", tmp_path / "rollouts.json"
    cfg = RolloutConfig(rollouts=5, temperature=1.0, max_new_tokens=16)
    write_rollouts(world / "model", benchmarks, OLD_TASKS, cfg, out, ENGINE, stats_out=stats)
    check_engine(vllm, world / "model", capsys, json.loads(stats.read_text()))
    frame = pl.read_parquet(out)
    eos = build_tokenizer().eos_token_id
    assert frame.height == 5 and all(ids[-1] == eos for ids in frame["completion_ids"])


def test_evaluation(world, vllm, tmp_path, capsys):
    from graftlab.evaluate.run import Benchmark, evaluate

    bench = Benchmark("add", world / "benchmarks" / "add.parquet", "old")
    metrics = evaluate(world / "model", [bench], SamplingConfig(2, 1.0, 0.9, 16), tmp_path / "eval", "post", ENGINE)
    check_engine(vllm, world / "model", capsys, json.loads((tmp_path / "eval" / "metrics.json").read_text()))
    assert metrics["sampling"]["backend"] == "vllm"
    assert calls(vllm, "generate")[0]["params"].kwargs["top_p"] == 0.9


def test_opsd_moves_its_current_weights_into_the_engine_each_step(world, vllm, capsys, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from graftlab.train.opsd import Opsd, OpsdConfig

    # The engine's rendezvous variables must not outlive this test: a later trainer would read them.
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(key, "x")
        monkeypatch.delenv(key)

    tok = AutoTokenizer.from_pretrained(world / "model")
    student, teacher = (AutoModelForCausalLM.from_pretrained(world / "model") for _ in range(2))
    cfg = OpsdConfig(alpha=0.5, lr=1e-2, steps=2, batch_size=2, max_new_tokens=8, seed=7, backend=ENGINE)
    run = Opsd(student, teacher, tok, cfg)
    batch = [{"prompt": p, "demonstration": "1+1=2"} for p in ("3*4", "5*6")]
    sums = []
    for step in (1, 2):
        before = {n: float(p.detach().double().sum()) for n, p in student.named_parameters()}
        list(run.steps(batch, range(step, step + 1)))
        sums.append(before)
    (init,) = calls(vllm, "init")
    # Colocated: the engine lives in this process (its weights writable) and leaves the GPU to training.
    assert init == {
        "model": str(world / "model"),
        **OPTIONS,
        "gpu_memory_utilization": 0.2,
        "distributed_executor_backend": "external_launcher",
    }
    assert LOGGED in capsys.readouterr().out
    assert os.environ["WORLD_SIZE"] == "1" and int(os.environ["MASTER_PORT"]) > 0
    names = [name for name, _ in vllm.CALLS]
    assert names == ["init"] + ["reload_weights", "reset_prefix_cache", "generate"] * 2
    loaded = calls(vllm, "reload_weights")
    # Each step the engine got every parameter as it stood before that step's sampling: step 2's are trained.
    assert loaded == sums
    assert loaded[0] != loaded[1]


def test_grpo_samples_through_trls_colocated_vllm(vllm, capsys):
    kwargs = grpo_vllm_kwargs({"backend": "vllm", "colocate_gpu_memory_utilization": 0.25, "max_model_len": 256})
    assert kwargs == {
        "use_vllm": True,
        "vllm_mode": "colocate",
        "vllm_gpu_memory_utilization": 0.25,
        "vllm_tensor_parallel_size": 1,
        "vllm_max_model_length": 256,
    }
    assert LOGGED in capsys.readouterr().out
    assert grpo_vllm_kwargs("transformers") == {"use_vllm": False}


def test_auto_is_vllm_on_cuda_and_never_falls_back_silently(world, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert Engine().resolve() == ("transformers", "auto: no CUDA device")
    sampler = load_sampler(world / "model", {"backend": "auto", "max_model_len": 64})
    assert "sampling backend: transformers (auto: no CUDA device)" in capsys.readouterr().out
    assert sampler.record == {"backend": "transformers", "why": "auto: no CUDA device"}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="vLLM is not installed.*or set sampling_backend: transformers"):
        Engine().resolve()
    monkeypatch.syspath_prepend(str(FAKE))
    assert Engine().resolve() == ("vllm", "auto: CUDA device and vLLM present")


def test_asking_for_vllm_where_it_is_absent_is_an_error(world):
    with pytest.raises(RuntimeError, match="needs vLLM"):
        load_sampler(world / "model", "vllm")
    with pytest.raises(ValueError, match="unknown sampling backend"):
        load_sampler(world / "model", "generate")


def test_an_unsized_engine_starts_at_its_first_call_sized_for_it_and_grows_when_a_call_needs_more(world, vllm):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(world / "model")
    sampler = load_sampler(world / "model", {"backend": "vllm"})
    assert calls(vllm, "init") == [] and sampler.record["vllm"]["max_model_len"] is None
    short, long = ["1+2"], ["1+2" * 20]
    sampler(short, SamplingConfig(1, 1.0, 1.0, 16))
    sampler(short, SamplingConfig(1, 1.0, 1.0, 16))  # fits the running engine
    need = len(tok(short[0])["input_ids"]) + 16
    sampler(long, SamplingConfig(1, 1.0, 1.0, 16))  # longer than the engine holds: a larger one
    grown = len(tok(long[0])["input_ids"]) + 16
    assert [i["max_model_len"] for i in calls(vllm, "init")] == [engine_length(need), engine_length(grown)]
    assert len(calls(vllm, "generate")) == 3 and sampler.record["vllm"]["max_model_len"] == engine_length(grown)


def test_a_policys_unsized_engine_takes_its_current_weights_as_it_starts(world, vllm, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from graftlab.sampling import policy_sampler

    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(key, "x")
        monkeypatch.delenv(key)
    tok = AutoTokenizer.from_pretrained(world / "model")
    policy = AutoModelForCausalLM.from_pretrained(world / "model")
    with torch.no_grad():
        next(policy.parameters()).add_(1.0)  # trained (or resumed) past the checkpoint the engine starts from
    sampler = policy_sampler(policy, tok, {"backend": "vllm"})
    sampler.load_weights(policy.named_parameters())  # before the start: taken as it starts
    sampler.sample_ids(["1+2"], SamplingConfig(1, 1.0, 1.0, 8))
    assert [name for name, _ in vllm.CALLS] == ["init", "reload_weights", "reset_prefix_cache", "generate"]
    assert calls(vllm, "reload_weights") == [
        {n: float(p.detach().double().sum()) for n, p in policy.named_parameters()}
    ]


@given(st.integers(1, 1 << 20), st.one_of(st.none(), st.integers(1, 1 << 20)))
def test_an_unset_context_covers_the_need_within_twice_it_and_the_models_own(need, limit):
    length = engine_length(need, limit)
    assert length >= need
    if limit is not None and need <= limit:
        assert length <= limit and (length == limit or length < 2 * need or need == 1)
    else:
        assert length & (length - 1) == 0 and length < 2 * need + 2


def test_grpo_sizes_trls_engine_from_its_prompts_when_unset(vllm, capsys):
    sized = grpo_vllm_kwargs({"backend": "vllm"}, lambda: 300, 32768)
    assert sized["vllm_max_model_length"] == 512
    # A configured context wins; without one and without the prompts, TRL reads the model's.
    assert grpo_vllm_kwargs({"backend": "vllm", "max_model_len": 256}, lambda: 300)["vllm_max_model_length"] == 256
    assert grpo_vllm_kwargs({"backend": "vllm"})["vllm_max_model_length"] is None


def test_an_in_process_engine_takes_a_port_of_its_own_not_an_inherited_one(monkeypatch):
    """Every job on a node inherits the same MASTER_PORT: an engine that kept it collided with another's."""
    import socket

    from graftlab.sampling import single_process_rendezvous

    for key in ("RANK", "LOCAL_RANK", "MASTER_ADDR"):  # restored after the test, as monkeypatch keeps them
        monkeypatch.delenv(key, raising=False)
    with socket.socket() as held:  # the inherited port, already taken by another job's engine
        held.bind(("localhost", 0))
        held.listen()
        taken = str(held.getsockname()[1])
        monkeypatch.setenv("MASTER_PORT", taken)
        monkeypatch.setenv("WORLD_SIZE", "1")
        single_process_rendezvous()
        port = os.environ["MASTER_PORT"]
        assert port != taken and (os.environ["RANK"], os.environ["WORLD_SIZE"]) == ("0", "1")
        with socket.socket() as ours:
            ours.bind(("localhost", int(port)))  # free
    # Inside a launcher's group of several processes, its rendezvous stands.
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_PORT", taken)
    single_process_rendezvous()
    assert os.environ["MASTER_PORT"] == taken


def test_a_job_scoring_several_models_keeps_one_engine_for_every_model_alike_but_for_its_weights(
    world, vllm, tmp_path, capsys
):
    """The models a job scores one after another (a training run's checkpoints, a sweep's grafts) share its
    engine, each next one's weights read into it in place; a model the engine would read otherwise
    (another architecture, tokenizer or generation defaults: `ENGINE_FILES`) gets an engine of its own, as
    does an engine with other options. Here it starts sized, at once."""
    import shutil

    from graftlab.sampling import ENGINE_FILES

    models = {name: tmp_path / name for name in ("a", "b", "c", "d")}
    for path in models.values():
        shutil.copytree(world / "model", path)
    (models["c"] / "generation_config.json").write_text('{"top_k": 5}')  # another generation default
    ours = load_sampler(models["a"], ENGINE)
    shutil.rmtree(models["a"])  # a sweep's job deletes each graft before it makes the next
    kept = load_sampler(models["b"], ENGINE, after=ours)
    assert kept is ours and calls(vllm, "collective_rpc") == [
        {"method": "graftlab_swap", "args": (str(models["b"]),), "kwargs": {}}
    ]
    assert [name for name, _ in vllm.CALLS][-2:] == ["collective_rpc", "reset_prefix_cache"]
    assert "vLLM engine: kept" in capsys.readouterr().out
    other = load_sampler(models["c"], ENGINE, after=kept)
    assert other is not kept and [i["model"] for i in calls(vllm, "init")] == [str(models["a"]), str(models["c"])]
    # Another option of the engine: its own too. Behind a chunk store, the engine inside it is the one kept.
    from dataclasses import replace

    fresh = load_sampler(models["d"], replace(ENGINE, seed=8), after=other)
    chunked = load_sampler(models["b"], replace(ENGINE, seed=8, resume=str(tmp_path / "store")), after=fresh)
    assert fresh is not other and chunked.inner is fresh and len(calls(vllm, "init")) == 3
    assert set(ENGINE_FILES) >= {"config.json", "generation_config.json", "tokenizer.json"}


def test_a_policy_engine_is_never_handed_another_model(world, vllm, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from graftlab.sampling import policy_sampler

    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(key, "x")
        monkeypatch.delenv(key)
    policy = AutoModelForCausalLM.from_pretrained(world / "model")
    sampler = policy_sampler(policy, AutoTokenizer.from_pretrained(world / "model"), ENGINE)
    assert load_sampler(world / "model", ENGINE, after=sampler) is not sampler


@pytest.mark.parametrize(
    "other", [{"backend": "transformers"}, {"dtype": "bfloat16"}, {"seed": 8}, {"enforce_eager": False}]
)
def test_a_chunk_store_is_read_back_by_the_engine_that_wrote_it_alone(world, vllm, tmp_path, capsys, other):
    """A killed job's rerun reads its finished chunks (graftlab.sample_chunks) only where the same engine
    samples: on another backend, or with an option of the engine that can change a sample, it samples anew
    rather than take the other engine's samples for its own."""
    from dataclasses import replace

    model, store = world / "model", tmp_path / "store"
    sampler = load_sampler(model, replace(ENGINE, resume=str(store)))
    prompts = [p["prompt"] for p in arith.sample_problems("add", 3, "test", 0)]
    sampler(prompts, SamplingConfig(n=1, temperature=0.0, top_p=1.0, max_new_tokens=4, seed=0))
    chunks = sorted(store.glob("*.json"))
    assert len(chunks) == 2 and "discarding" not in capsys.readouterr().out  # the mark and one chunk
    load_sampler(model, replace(ENGINE, resume=str(store)))  # the same engine: kept
    assert sorted(store.glob("*.json")) == chunks
    load_sampler(model, replace(ENGINE, resume=str(store), **other))
    assert f"sampling: discarding {store}" in capsys.readouterr().out
    assert [p.name for p in store.iterdir()] == ["fingerprint.json"]
