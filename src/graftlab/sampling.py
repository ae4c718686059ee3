"""One `generate()` for every stage that samples: evaluation, mining, trace synthesis, rollouts.

Two backends behind the same call: vLLM on a GPU (imported lazily: it pins its own CUDA torch and lives
in its own environment) and transformers `generate` everywhere else. `Engine` is the config's choice
(`sampling_backend` and the `vllm` section); each job logs what it resolved to.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm import tqdm

from graftlab.sample_chunks import Part

if TYPE_CHECKING:
    import torch

# One sample as the exact token ids: the prompt as the model read it (no padding) and the completion as
# generated, ending with the end-of-turn token when the model produced one. The Fisher scores these ids.
Sample = tuple[list[int], list[int]]


@dataclass(frozen=True)
class SamplingConfig:
    n: int
    temperature: float  # 0 means greedy
    top_p: float
    max_new_tokens: int
    seed: int = 0
    batch_size: int = 256  # prompts per transformers batch (each expanded n times); memory, not results

    @classmethod
    def from_config(cls, section: dict, seed: int) -> SamplingConfig:
        """From a workflow config section with `samples`, `temperature`, `top_p`, `max_new_tokens`."""
        return cls(
            section["samples"], section["temperature"], section.get("top_p", 1.0), section["max_new_tokens"], seed
        )


def vllm_available() -> bool:
    if importlib.util.find_spec("vllm") is None:
        return False
    import torch

    return torch.cuda.is_available()


# The engine's settings that change where and how samples are kept and spread, never a sample.
SAMPLES_ALIKE = ("resume", "data_parallel", "part", "fingerprint")
# What a vLLM engine reads from a model directory besides its weights: the architecture and dtype, the
# generation defaults it samples with, the tokenizer. Two models alike in every one of these differ in their
# weights alone, so one running engine samples both (`VllmSampler.swap`); any other model needs an engine.
ENGINE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
)


@dataclass(frozen=True)
class Engine:
    """The sampling backend a job asked for and the vLLM engine's options (transformers ignores them)."""

    backend: str = "auto"  # auto | vllm | transformers
    max_model_len: int | None = None  # None: the model's own context length
    gpu_memory_utilization: float = 0.9
    colocate_gpu_memory_utilization: float = 0.3  # beside a model being trained (on-policy stages)
    tensor_parallel_size: int = 1
    dtype: str = "auto"
    enforce_eager: bool = False
    seed: int = 0
    # A directory keeping each finished chunk of samples, so that a killed job's rerun resamples only the
    # rest (`graftlab.sample_chunks`); None: sampled whole, nothing kept.
    resume: str | None = None
    # Engines sampling a call's chunks at once, a process each on its own GPUs (`sample_chunks.DataParallel`;
    # with `resume` only). It changes no sample.
    data_parallel: int = 1
    # With `resume`: the part of every call this job samples into the store, and what the store is kept
    # under where the model directory is rebuilt each attempt (`sample_chunks.Part`, `inputs_fingerprint`).
    part: Part = Part()
    fingerprint: str | None = None

    @classmethod
    def of(cls, spec, seed: int | None = None, resume=None) -> Engine:
        """From a backend name, an `Engine`, or the rules' `backend` param (the backend with the `vllm`
        config section's options, flattened); `seed` and `resume` replace its own when given."""
        engine = spec if isinstance(spec, Engine) else cls(spec) if isinstance(spec, str) else cls(**spec)
        engine = engine if seed is None else replace(engine, seed=seed)
        return engine if resume is None else replace(engine, resume=str(resume))

    def resolve(self) -> tuple[str, str]:
        """(backend, why). `auto` never falls back silently: on a GPU, `generate` at thousands of samples
        of 8k+ tokens takes days, so a GPU without vLLM is an error to fix, not a slower run."""
        if self.backend not in ("auto", "vllm", "transformers"):
            raise ValueError(f"unknown sampling backend {self.backend!r}; use auto, transformers or vllm")
        if self.backend != "auto":
            return self.backend, "configured"
        import torch

        if not torch.cuda.is_available():
            return "transformers", "auto: no CUDA device"
        if importlib.util.find_spec("vllm") is None:
            raise RuntimeError(
                "sampling_backend auto: a CUDA device is present but vLLM is not installed; install "
                "the GPU stack of envs/gpu.lock.txt (envs/gpu.yaml) or set sampling_backend: transformers"
            )
        return "vllm", "auto: CUDA device and vLLM present"

    def bare(self) -> Engine:
        """The engine alone: these options, without where and how its samples are kept (`SAMPLES_ALIKE`)."""
        return replace(self, **{k: getattr(Engine(), k) for k in SAMPLES_ALIKE})

    def samples_by(self, backend: str) -> dict:
        """What samples depend on besides the model and the call: the backend that ran, and a vLLM engine's
        options. A chunk store is kept under it (`open_store`)."""
        options = {k: v for k, v in vars(self).items() if k not in ("backend", *SAMPLES_ALIKE)}
        return {"backend": backend} | ({"vllm": options} if backend == "vllm" else {})

    def record(self, backend: str, why: str) -> dict:
        """What provenance and stats keep of the sampling: the backend, why, and the engine's options."""
        return {"backend": backend, "why": why} | self.samples_by(backend)


def _announce(engine: Engine) -> tuple[str, str]:
    backend, why = engine.resolve()
    print(f"sampling backend: {backend} ({why})", flush=True)
    return backend, why


def generate(model_dir, prompts: list[str], cfg: SamplingConfig, backend="auto") -> list[list[str]]:
    """`cfg.n` completions per prompt (already chat-formatted), decoded up to the end-of-turn token."""
    return load_sampler(model_dir, backend)(prompts, cfg)


def generate_ids(model_dir, prompts: list[str], cfg: SamplingConfig, backend="auto") -> list[list[Sample]]:
    """`cfg.n` samples per prompt as token ids `(prompt_ids, completion_ids)`, for stages that score them."""
    return load_sampler(model_dir, backend).sample_ids(prompts, cfg)


def load_sampler(model_dir, backend="auto", after=None):
    """A callable `(prompts, cfg) -> completions` holding the model, for stages that sample repeatedly;
    its `sample_ids(prompts, cfg)` gives the same samples as token ids. `backend`: anything `Engine.of`
    reads; with its `resume`, the sampler keeps each finished chunk there (`graftlab.sample_chunks`). The
    choice goes to the job's log and to the sampler's `record` for the stage's stats. `after`: the sampler
    of the model this job scored before; its vLLM engine samples this model too where it can (`kept_engine`)."""
    engine = Engine.of(backend)
    name, why = _announce(engine)
    if engine.resume is not None and engine.data_parallel > 1:
        from graftlab.sample_chunks import ChunkedSampler, DataParallel, open_store

        # Each process starts its own engine: an engine kept between models is for one process's jobs.
        engines = DataParallel(str(model_dir), engine.bare(), engine.data_parallel)
        store = open_store(engine.resume, model_dir, engine.fingerprint, engine.samples_by(name))
        sampler = ChunkedSampler(None, store, engines=engines, part=engine.part)
        sampler.record = engine.record(name, why)
        return sampler
    sampler = kept_engine(after, model_dir, engine) if name == "vllm" else None
    if sampler is None:
        sampler = VllmSampler(model_dir, engine) if name == "vllm" else HfSampler(model_dir)
        sampler.record = engine.record(name, why)
    if engine.resume is None:
        return sampler
    from graftlab.sample_chunks import ChunkedSampler, open_store

    store = open_store(engine.resume, model_dir, engine.fingerprint, engine.samples_by(name))
    return ChunkedSampler(sampler, store, part=engine.part)


def kept_engine(after, model_dir, engine: Engine) -> VllmSampler | None:
    """`after`'s vLLM engine, now sampling `model_dir` (its weights written in place), where the two models
    differ in their weights alone (`ENGINE_FILES`) and the engines' options agree; else None. Starting an
    engine takes minutes on a GPU (weights loaded, CUDA graphs captured, the KV cache profiled): a job scoring
    a training run's checkpoints or a sweep's grafts pays it once. Every sample is the same: each request
    carries its own seed, and the prefix cache is emptied with the old weights."""
    kept = getattr(after, "__dict__", {}).get("inner", after)  # a ChunkedSampler's engine is its own
    if not isinstance(kept, VllmSampler) or kept.policy is not None or kept.engine.bare() != engine.bare():
        return None
    if kept.files != engine_files(model_dir):
        return None
    kept.swap(model_dir)
    return kept


def engine_files(model_dir) -> tuple[str | None, ...]:
    """A digest of each of `ENGINE_FILES` in `model_dir` (None where absent), taken when an engine loads the
    model: a sweep's job deletes each graft's directory before it makes the next."""
    import hashlib

    paths = [Path(model_dir) / name for name in ENGINE_FILES]
    return tuple(hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None for p in paths)


def policy_sampler(model, tokenizer, backend="auto"):
    """A sampler of a model being trained on its own samples (OPSD). With vLLM the engine runs in this
    process, started from the checkpoint the model was loaded from; call its `load_weights` before each
    round of sampling so it samples the current policy."""
    engine = Engine.of(backend)
    name, why = _announce(engine)
    if name == "vllm":
        colocated = replace(engine, gpu_memory_utilization=engine.colocate_gpu_memory_utilization)
        sampler = VllmSampler(model.name_or_path, colocated, policy=model)
    else:
        sampler = HfSampler.from_model(model, tokenizer)
    sampler.record = engine.record(name, why)
    return sampler


def sampling_record(sampler) -> dict | None:
    """The backend record of a sampler made here; None for one a caller built itself."""
    return getattr(sampler, "record", None)


def grpo_vllm_kwargs(backend="auto", context: Callable[[], int] | None = None, model_limit: int | None = None) -> dict:
    """TRL GRPOConfig options for the backend: vLLM in TRL's colocate mode (the engine shares the
    trainer's process and GPU, and TRL moves the weights into it after each step), or `generate`.
    `context()`: the longest prompt plus completion the run samples (`context_bound` over its dataset),
    which sizes the engine where `vllm.max_model_len` is unset (`engine_length`)."""
    engine = Engine.of(backend)
    if _announce(engine)[0] != "vllm":
        return {"use_vllm": False}
    length = engine.max_model_len
    if length is None and context is not None:
        length = engine_length(context(), model_limit)
    return {
        "use_vllm": True,
        "vllm_mode": "colocate",
        "vllm_gpu_memory_utilization": engine.colocate_gpu_memory_utilization,
        "vllm_tensor_parallel_size": engine.tensor_parallel_size,
        "vllm_max_model_length": length,
    }


# What a sampled sequence's length is, in a refusal: its prompt and the whole generation budget.
_BUDGET = "sampling (prompt tokens + max_new_tokens {})"


def context_bound(tokenizer, prompts, max_new_tokens: int) -> int:
    """Tokens the longest of `prompts` (chat-formatted text) and a whole completion take together: the
    least context that samples them all."""
    return max(len(tokenizer(p)["input_ids"]) for p in set(prompts)) + max_new_tokens


def engine_length(need: int, model_limit: int | None = None) -> int:
    """The vLLM context (`max_model_len`) an unset `vllm.max_model_len` takes: `need` rounded up to a power
    of two, so a later call with somewhat longer prompts fits the running engine, at most the model's own
    context. The model's own (262,144 tokens for Qwen3-4B-2507) would reserve more KV cache than a GPU holds
    beside the weights, and vLLM refuses to start."""
    length = 1 << max(need - 1, 1).bit_length()
    return min(length, model_limit) if model_limit and need <= model_limit else length


def model_context(model_dir) -> int | None:
    """The model's own context length (`max_position_embeddings`), None where its config names none."""
    from transformers import AutoConfig

    return getattr(AutoConfig.from_pretrained(model_dir), "max_position_embeddings", None)


class VllmSampler:
    """vLLM's engine over `model_dir`. With `vllm.max_model_len` set it starts at once with that context;
    unset, it starts at the first call, sized for that call's prompts (`engine_length`), and starts again,
    larger, should a later call need more: a stage need not know all its prompts before it samples.
    `policy`: a model being trained whose weights the engine samples (OPSD, SDPO): the engine runs in this
    process (TRL's colocate mode) and takes the policy's current weights whenever it (re)starts."""

    backend = "vllm"

    def __init__(self, model_dir, engine: Engine | None = None, policy=None):
        if importlib.util.find_spec("vllm") is None:
            raise RuntimeError(
                "sampling backend 'vllm' needs vLLM: install the GPU stack of envs/gpu.lock.txt (docs/cluster.md) "
                "or use sampling_backend: transformers"
            )
        self.model_dir, self.engine, self.policy = str(model_dir), engine or Engine("vllm"), policy
        self.files = engine_files(model_dir)  # what the engine read besides the weights (`kept_engine`)
        # `pending`: weights were asked for before the engine started, which it takes as it starts.
        self.llm, self.max_model_len, self.pending = None, None, False
        if self.engine.max_model_len is not None:
            self._start(self.engine.max_model_len)

    def _start(self, max_model_len: int) -> None:
        from vllm import LLM

        restart = self.llm is not None
        if restart:
            print(f"vLLM engine: restarting with max_model_len {max_model_len}", flush=True)
            self.llm = None  # the old engine's memory goes before the new one asks for its own
            import gc

            gc.collect()
        extra = {}
        if self.policy is not None:
            # As TRL's colocate mode: the engine in this process, so its model's weights can be written.
            extra["distributed_executor_backend"] = "external_launcher"
            single_process_rendezvous()
        else:
            in_process_on_cpu()
        with _spawn_safe_main():
            self.llm = LLM(
                model=self.model_dir,
                max_model_len=max_model_len,
                gpu_memory_utilization=self.engine.gpu_memory_utilization,
                tensor_parallel_size=self.engine.tensor_parallel_size,
                dtype=self.engine.dtype,
                enforce_eager=self.engine.enforce_eager,
                seed=self.engine.seed,
                # `swap`'s call into each of the engine's workers, wherever they run.
                worker_extension_cls=f"{__name__}.{WorkerSwap.__name__}",
                **extra,
            )
        self.max_model_len = max_model_len
        if record := getattr(self, "record", None):  # the stage's stats name the context it ran with
            record["vllm"]["max_model_len"] = max_model_len
        if self.policy is not None and (restart or self.pending):
            self.pending = False
            self.load_weights(self.policy.named_parameters())

    def _fit(self, prompts: list[str], cfg: SamplingConfig) -> None:
        """Start the engine, or start it again larger, where this call's prompts need it."""
        if self.engine.max_model_len is not None:
            return  # the configured context: vLLM refuses a longer prompt itself, naming it
        from graftlab.io.tables import within_context

        need, limit = context_bound(self.tokenizer, prompts, cfg.max_new_tokens), model_context(self.model_dir)
        within_context([need], limit, _BUDGET.format(cfg.max_new_tokens) + ", the longest")
        if self.max_model_len is None or need > self.max_model_len:
            print(f"vLLM engine: longest prompt + max_new_tokens = {need} tokens", flush=True)
            self._start(engine_length(need, limit))

    @functools.cached_property
    def tokenizer(self):
        """The model's tokenizer, which counts the prompts' tokens before the engine (and its own) exists."""
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.model_dir)

    def swap(self, model_dir) -> None:
        """Sample `model_dir` from now on, a model differing from the present one in its weights alone
        (`kept_engine`): a running engine reads them in place, once per worker; one not yet started, or
        restarted larger, starts from it. `files` stand: `kept_engine` has found them the same."""
        self.model_dir = str(model_dir)
        if self.llm is not None:
            print(f"vLLM engine: kept, the weights of {model_dir} written into it", flush=True)
            self.llm.collective_rpc("graftlab_swap", args=(self.model_dir,))
            self.llm.reset_prefix_cache()  # its keys and values came from the old weights

    def load_weights(self, named_params) -> None:
        """Write a trained model's `(name, tensor)` pairs into the engine (one with a `policy`), then drop
        the prefix cache: its keys and values came from the old weights. Before the engine has started,
        nothing yet: it takes the policy's weights as it starts."""
        if self.llm is None:
            self.pending = True
            return
        write_weights(self.llm, named_params)

    def _generate(self, prompts: list[str], cfg: SamplingConfig):
        from vllm import SamplingParams

        self._fit(prompts, cfg)
        params = SamplingParams(
            n=cfg.n,
            temperature=cfg.temperature,
            top_p=cfg.top_p if cfg.temperature > 0 else 1.0,
            max_tokens=cfg.max_new_tokens,
            seed=cfg.seed,
            skip_special_tokens=False,
        )
        return self.llm.generate(prompts, params)

    def __call__(self, prompts: list[str], cfg: SamplingConfig) -> list[list[str]]:
        # The ids decoded as HfSampler decodes them: vLLM's own `text` leaves the end of turn out, so the two
        # backends' completions (and the token counts taken from them) would differ by it.
        samples = self.sample_ids(prompts, cfg)  # the engine starts at its first call
        decode = self.llm.get_tokenizer().decode
        return [[decode(c, skip_special_tokens=False) for _, c in cs] for cs in samples]

    def sample_ids(self, prompts: list[str], cfg: SamplingConfig) -> list[list[Sample]]:
        outputs = self._generate(prompts, cfg)
        eos = self.llm.get_tokenizer().eos_token_id
        return [[(list(o.prompt_token_ids), _vllm_completion_ids(c, eos)) for c in o.outputs] for o in outputs]


class HfSampler:
    backend = "transformers"

    def __init__(self, model_dir):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.model = AutoModelForCausalLM.from_pretrained(model_dir).eval().to(self.device)

    @classmethod
    def from_model(cls, model, tokenizer) -> HfSampler:
        """A sampler over a model in memory (a student being trained on its own samples): no copy; the
        caller switches the model to eval mode around sampling. The tokenizer pads on the left here."""
        import copy

        sampler = cls.__new__(cls)
        sampler.tok = copy.copy(tokenizer)  # a shallow copy: padding the caller's tokenizer stays as it was
        sampler.tok.padding_side = "left"
        sampler.model, sampler.device = model, next(model.parameters()).device
        return sampler

    def __call__(self, prompts: list[str], cfg: SamplingConfig) -> list[list[str]]:
        decode = self.tok.decode
        return [[decode(c, skip_special_tokens=False) for _, c in cs] for cs in self.sample_ids(prompts, cfg)]

    def sample_ids(self, prompts: list[str], cfg: SamplingConfig) -> list[list[Sample]]:
        import torch

        torch.manual_seed(cfg.seed)
        out: list[list[Sample]] = []
        batches = range(0, len(prompts), cfg.batch_size)
        for start in tqdm(batches, desc="sampling", unit="batch", disable=len(batches) < 2):
            out.extend(self._batch(prompts[start : start + cfg.batch_size], cfg))
        return out

    def _batch(self, prompts: list[str], cfg: SamplingConfig) -> list[list[Sample]]:
        import torch

        tok, greedy = self.tok, cfg.temperature == 0
        # Greedy decoding gives one answer per prompt: decode it once and repeat it n times, as vLLM does.
        n = 1 if greedy else cfg.n
        batch = tok(prompts, return_tensors="pt", padding=True).to(self.device)
        from graftlab.io.tables import within_context

        # Past its context a model reads positions it never learned (RoPE does not refuse them): refused.
        lengths = (batch["attention_mask"].sum(1) + cfg.max_new_tokens).tolist()
        within_context(lengths, self.model.config.max_position_embeddings, _BUDGET.format(cfg.max_new_tokens))
        # A model sharded over processes (`graftlab.train.shard`) gathers its weights in every forward: each
        # process decodes until all are done (`synced_gpus`), and outside inference mode, whose tensors
        # FSDP's reused gather buffers could not be written into afterwards.
        synced = torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
        with torch.no_grad() if synced else torch.inference_mode():
            ids = self.model.generate(
                **batch,
                synced_gpus=synced,
                do_sample=not greedy,
                temperature=None if greedy else cfg.temperature,
                top_p=None if greedy else cfg.top_p,
                top_k=None,
                num_return_sequences=n,
                max_new_tokens=cfg.max_new_tokens,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
            )
        # Left padding: a prompt's own ids are where the attention mask is set.
        prompt_ids = [row[mask.bool()].tolist() for row, mask in zip(batch["input_ids"], batch["attention_mask"])]
        completions = [_until_eos(row, tok.eos_token_id) for row in ids[:, batch["input_ids"].shape[1] :].tolist()]
        samples = [(prompt_ids[i // n], c) for i, c in enumerate(completions)]
        return [samples[i : i + n] * (cfg.n // n) for i in range(0, len(samples), n)]


def free_port() -> int:
    """A TCP port free on this node now, for a job's rendezvous: two jobs on one node that both took a
    fixed port (torch's and accelerate's 29500) would collide."""
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def write_weights(llm, named_params) -> None:
    """Write a trained model's `(name, tensor)` pairs into `llm`, an engine running in this process, then
    drop its prefix cache: its keys and values came from the old weights. graftlab's samplers and TRL's
    colocated GRPO (`trl_grpo_trainer`) both sync through here."""
    runner = llm.llm_engine.model_executor.driver_worker.model_runner
    # vLLM's in-place reload, not the model's own load_weights: the reload runs each layer's post-load
    # step again, where vLLM's CPU backend packs its linear weights and drops the originals, which a
    # plain load_weights then finds empty (tests/vllm_cpu/). A generator copies one tensor at a time.
    runner.reload_weights(weights_iterator=((name, param.detach()) for name, param in named_params))
    _retie_head(runner)
    llm.reset_prefix_cache()


def _retie_head(runner) -> None:
    """vLLM 0.32's CPU backend gets one layer of an in-place reload wrong: an output head tied to the
    embedding is sent no weights of its own, so the reload never runs its post-load step, and the packed copy
    of the head keeps the old embedding (measured: the wrong tokens, tests/vllm_cpu/). Run that step again
    there (only there: a quantized head on a GPU must not be processed twice)."""
    from vllm.platforms import current_platform

    head = getattr(runner.get_model(), "lm_head", None)
    if current_platform.is_cpu() and head is not None and hasattr(head, "quant_method"):
        head.quant_method.process_weights_after_loading(head)


class WorkerSwap:
    """Mixed into each of a vLLM engine's workers (`LLM(worker_extension_cls=...)`, vLLM's way of adding a
    worker call), in whatever process it runs: `collective_rpc("graftlab_swap", args=(model_dir,))` reads a
    checkpoint's weights into the worker's model in place, vLLM's own reload from a directory."""

    def graftlab_swap(self, model_dir: str) -> None:
        self.reload_weights(weights_path=model_dir)
        _retie_head(self.model_runner)


def trl_grpo_trainer(cls, args, **kwargs):
    """TRL's GRPO trainer `cls(args=args, **kwargs)` (GRPO's, the Pedagogical RL teacher's). Where it
    colocates a vLLM engine, the engine joins a rendezvous of its own (`single_process_rendezvous`: TRL
    keeps an inherited MASTER_PORT), and its weights are synced through `write_weights`: TRL 1.16 calls each
    vLLM layer's own `load_weights`, which vLLM's CPU build cannot take (AttributeError: 'Parameter' object
    has no attribute 'weight_loader', tests/vllm_cpu/), while the in-place reload works on both, so GRPO's
    sync is the one the CPU tests check. TRL's parameter walk (FSDP gathering, vLLM's names) is kept."""
    colocated = args.use_vllm and args.vllm_mode == "colocate"
    if colocated:
        single_process_rendezvous()
    trainer = cls(args=args, **kwargs)
    if colocated:
        generation = trainer.vllm_generation
        generation.sync_weights = lambda: write_weights(generation.llm, generation._iter_named_params())
    return trainer


@contextlib.contextmanager
def _spawn_safe_main():
    """vLLM starts its engine core (and tensor-parallel workers) as spawned processes, and a spawned process
    first runs the parent's main script again, as `__mp_main__`. A workflow job's main script is the
    job itself, which there finds no `snakemake` object and fails (seen with the real vLLM on a CPU:
    "Engine core initialization failed"). With `__file__` hidden while the engine starts, the children
    start from an empty main module, as they need nothing of it."""
    main = sys.modules["__main__"]
    hidden = main.__dict__.pop("__file__", None) if getattr(main, "__spec__", None) is None else None
    try:
        yield
    finally:
        if hidden is not None:
            main.__file__ = hidden


def in_process_on_cpu() -> None:
    """On vLLM's CPU build, the engine core and its worker run in this process unless the environment says
    otherwise (VLLM_ENABLE_V1_MULTIPROCESSING, vLLM's own switch). By default that build spawns both as
    processes of their own, each importing torch and vLLM again: measured 3.2x the wall time and 3.4x the CPU
    seconds of an engine start in this process (benchmarks/engine_bench.py), for the same samples
    (tests/vllm_cpu/).
    On a GPU vLLM's default stands: its engine core overlaps scheduling with the model's steps."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def single_process_rendezvous() -> None:
    """The rendezvous an in-process engine joins (ours, or TRL's colocated one): this process alone, on a
    port free now. An inherited MASTER_PORT is not kept: every job on a node inherits the same one, and two
    engines started at once collided on it (tests/vllm_cpu/). Inside a launcher's group of several
    processes (WORLD_SIZE > 1) the launcher's variables stand."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return
    port = str(free_port())
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="localhost", MASTER_PORT=port)


def _until_eos(ids: list[int], eos: int) -> list[int]:
    # A finished row is padded up to the longest one: cut after the end of turn ourselves (decoding with
    # skip_special_tokens would also drop the <think> tags that grading needs).
    return ids[: ids.index(eos) + 1] if eos in ids else ids


def _vllm_completion_ids(completion, eos: int) -> list[int]:
    """vLLM keeps a stop token in `token_ids`; should a version leave the end of turn out, put it back
    (finish_reason "stop" with no stop_reason means the EOS ended the sample), so both backends agree."""
    ids = list(completion.token_ids)
    ended_by_eos = completion.finish_reason == "stop" and completion.stop_reason is None
    return ids + [eos] if ended_by_eos and ids[-1:] != [eos] else ids


def response_logits(model, prompts: list[list[int]], responses: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits `model` gives each token of given responses (teacher forcing), what the on-policy losses
    and the KL probe score: [batch, longest response, vocab], and the response mask.

    Right padding: a causal model's logits at real positions never see the padding after them."""
    import torch

    seqs = [p + r for p, r in zip(prompts, responses)]
    device = next(model.parameters()).device
    ids = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long, device=device)
    attn = torch.zeros_like(ids)
    for row, seq in enumerate(seqs):
        ids[row, : len(seq)] = torch.tensor(seq, device=device)
        attn[row, : len(seq)] = 1
    logits = model(input_ids=ids, attention_mask=attn).logits
    width = max(map(len, responses))
    out = logits.new_zeros(len(seqs), width, logits.shape[-1])
    mask = torch.zeros(len(seqs), width, device=device)
    for row, (p, r) in enumerate(zip(prompts, responses)):
        # The logits at position i predict token i + 1: the response is read from one position earlier.
        out[row, : len(r)] = logits[row, len(p) - 1 : len(p) + len(r) - 1]
        mask[row, : len(r)] = 1
    return out, mask


def one_engine(spec: str) -> None:
    """One engine process of a data-parallel sampling job (`graftlab.sample_chunks.DataParallel`): its engine
    loaded, then its share of a call's chunks (the pickled `Share` at `spec`) sampled into the store."""
    import pickle

    with open(spec, "rb") as f:
        share = pickle.load(f)
    share.sample(load_sampler(share.model_dir, share.engine))


if __name__ == "__main__":
    # Through the module as imported, not this __main__ copy: the pickled engine is graftlab.sampling's Engine.
    from graftlab.sampling import one_engine as main

    main(sys.argv[1])
