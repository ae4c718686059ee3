"""Training precision, chosen per job from the config and the hardware, never inherited.

TRL's configs leave `bf16` unset and then turn on bf16 autocast wherever torch says the CPU supports
bf16, which includes AVX2-only CPUs that emulate it: there one SFT step of the tiny world's
post-training took 1.24 s against 0.24 s in fp32. So the choice is explicit:

- a CUDA GPU with bf16: bf16 autocast (fp32 master weights) unless the config asks for fp32;
- a CPU: fp32, unless the config asks for bf16 *and* the CPU computes it natively (AMX or
  AVX512-BF16 in /proc/cpuinfo); `auto` stays fp32 there, since on models as small as the tiny world's
  even native bf16 is slower (1.7x per step on an AVX512-BF16 Xeon: benchmarks/README.md).

Every trainer prints its choice as one line of its job log (`announce`).

The other choices a trainer makes from the hardware live here too, each `auto` by default and each
leaving a CPU run exactly as it was: the micro-batch and its gradient accumulation (`micro_batch`), gradient
checkpointing (`checkpointing`) and the dtype its checkpoints are written in (`save_dtype`, `cast_saved`).
"""

import json
import os
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

from graftlab import memory
from graftlab.errors import GraftlabError
from graftlab.memory import Shape

SETTINGS = ("auto", "fp32", "bf16")
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")
CPUINFO = Path("/proc/cpuinfo")
# What trainers load weights as, whatever a checkpoint stores (transformers 5 would keep a checkpoint's
# bf16): AdamW steps smaller than 2^-8 of a bf16 weight round away, so bf16 is autocast's alone.
WEIGHTS_DTYPE = "float32"


@dataclass(frozen=True)
class Precision:
    name: str  # "fp32" or "bf16"
    reason: str

    @property
    def bf16(self) -> bool:
        return self.name == "bf16"

    def trainer_kwargs(self) -> dict:
        """For transformers/TRL training arguments: both flags set, so no library default decides. Also
        sets accelerate's variable for the process: TrainingArguments start from it when neither flag is
        on, so under `accelerate launch` with a config of `mixed_precision: bf16` (commands/fsdp.yaml) an
        fp32 choice would otherwise train in bf16 (seen on transformers 5.20)."""
        os.environ["ACCELERATE_MIXED_PRECISION"] = "bf16" if self.bf16 else "no"
        return {"bf16": self.bf16, "fp16": False}

    def autocast(self, device_type: str):
        """The context of a hand-written loop's forward passes: bf16 autocast or nothing."""
        if not self.bf16:
            return nullcontext()
        import torch

        return torch.autocast(device_type=device_type, dtype=torch.bfloat16)

    def log_line(self) -> str:
        return f"precision: {self.name} ({self.reason})"


def native_bf16_flags(cpuinfo: Path | None = None) -> list[str] | None:
    """The CPU's native bf16 flags found in `cpuinfo` (default /proc/cpuinfo); None when it cannot be
    read or lists no flags (not Linux, or not x86: ARM lists `Features`)."""
    try:
        text = Path(cpuinfo or CPUINFO).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.partition(":")[2].split())
            return [f for f in NATIVE_BF16_FLAGS if f in flags]
    return None


def choose(
    setting: str = "auto", *, cuda: bool | None = None, cuda_bf16: bool | None = None, cpuinfo: Path | None = None
) -> Precision:
    """The precision of a trainer under config `setting` (auto, fp32 or bf16). `cuda` and `cuda_bf16`
    default to what torch reports."""
    if setting not in SETTINGS:
        raise ValueError(f"precision must be one of {SETTINGS}, got {setting!r}")
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
        if cuda_bf16 is None and cuda:
            # Emulated bf16 (before Ampere) is slow on a GPU as on a CPU.
            cuda_bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
    if setting == "fp32":
        return Precision("fp32", "asked for fp32")
    if cuda:
        if cuda_bf16:
            return Precision("bf16", f"cuda with bf16, {setting}: autocast over fp32 weights")
        return Precision("fp32", "cuda without bf16")
    return _cpu(setting, native_bf16_flags(cpuinfo))


def _cpu(setting: str, native: list[str] | None) -> Precision:
    if native is None:
        return Precision("fp32", "cpu flags unreadable")
    if not native:
        return Precision("fp32", "cpu without native bf16")
    if setting == "bf16":
        return Precision("bf16", f"cpu with native bf16 ({', '.join(native)}), asked for bf16")
    return Precision("fp32", f"cpu, auto means fp32 even with native bf16 ({', '.join(native)})")


def announce(setting: str = "auto") -> Precision:
    """`choose`, with the choice printed as one line of the job's log (jobs log their stdout)."""
    precision = choose(setting)
    print(precision.log_line(), flush=True)
    return precision


SAVE_DTYPES = ("auto", "float32", "bfloat16")
# The share of free GPU memory the estimate may fill: allocator fragmentation and CUDA's own workspace.
MEMORY_SHARE = 0.7


def checkpointing(setting, cuda: bool | None = None) -> bool:
    """Gradient checkpointing under config `setting` (auto, true, false): `auto` on CUDA only, where memory
    is the limit; on a CPU recomputing every layer only costs time."""
    if setting not in ("auto", True, False):
        raise GraftlabError(f"gradient_checkpointing must be auto, true or false, got {setting!r}")
    if setting == "auto":
        if cuda is None:
            import torch

            cuda = torch.cuda.is_available()
        return cuda
    return setting


def recompute_args(kind, on: bool) -> dict:
    """The arguments of a TrainingArguments class `kind` (TRL's SFTConfig, GRPOConfig) that set activation
    recomputation, under the name the installed transformers reads: `activation_checkpointing` in newer
    releases (5.24 keeps `gradient_checkpointing` as an alias that warns), `gradient_checkpointing` alone in
    the GPU stack's 5.20 (envs/gpu.lock.txt). Set always: TRL defaults it to on, which recomputed every layer
    even on a CPU."""
    import dataclasses

    names = {f.name for f in dataclasses.fields(kind)}
    name = "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"
    return {name: on, f"{name}_kwargs": {"use_reentrant": False} if on else None}


def enable_recompute(model) -> None:
    """Turn activation recomputation on in a transformers model, by the method the installed release has
    (`activation_checkpointing_enable`, or `gradient_checkpointing_enable` before it was renamed)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def accumulation(batch: int, micro: int) -> int:
    """Gradient accumulation steps of an effective `batch` in micro-batches of `micro`."""
    if micro < 1 or batch % micro:
        raise GraftlabError(f"micro_batch_size {micro} does not divide batch_size {batch}")
    return batch // micro


def micro_batch(
    setting, batch: int, seq_len: int | Callable[[], int], model, *, frozen_params: int = 0, free: int | None = None
) -> int:
    """The micro-batch of an effective `batch` under config `setting` (an integer dividing `batch`, or
    `auto`), every trainer's one sizer. `auto` is the whole batch on a CPU; on CUDA, the largest divisor of
    `batch` whose activations (`seq_len` tokens a sequence, or a function giving it, called only when
    sizing: measuring the longest sequence tokenizes the data; `model`'s layers, width and vocabulary) fit
    beside the trained model's
    weights, gradients and AdamW state and `frozen_params` fp32 weights of models that only score and are
    not on the GPU yet, in `MEMORY_SHARE` of the GPU's `free` bytes (default: what CUDA reports free now)."""
    if setting != "auto":
        if not isinstance(setting, int) or isinstance(setting, bool):
            raise GraftlabError(f"micro_batch_size must be auto or an integer, got {setting!r}")
        accumulation(batch, setting)
        return setting
    if free is None:
        import torch

        if not torch.cuda.is_available():
            return batch
        free = torch.cuda.mem_get_info()[0]
    seq_len = seq_len() if callable(seq_len) else seq_len
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    # bf16 activations without recomputation: the most a micro-batch can hold (graftlab.memory).
    per_seq = memory.activations(Shape.of_config(cfg.to_dict() if hasattr(cfg, "to_dict") else vars(cfg)), seq_len)
    params = sum(p.numel() for p in model.parameters())
    # Weights already on the GPU are no longer free; gradients and AdamW state are still to come.
    resident = params * memory.FP32 if next(model.parameters()).is_cuda else 0
    budget = MEMORY_SHARE * free - (params * memory.TRAINED_BYTES - resident) - frozen_params * memory.FP32
    return memory.largest_divisor(batch, budget / per_seq)


def stored_dtype(model_dir) -> str | None:
    """The dtype of the first floating-point tensor of the safetensors in `model_dir` (its header only is
    read), else the `dtype` / `torch_dtype` of its config.json; None when neither says."""
    model_dir = Path(model_dir)
    for path in sorted(model_dir.glob("*.safetensors")):
        for found in _float_dtypes(path):
            return found
    config = model_dir / "config.json"
    if config.exists():
        record = json.loads(config.read_text())
        found = record.get("dtype") or record.get("torch_dtype")
        return str(found) if found else None
    return None


def _float_dtypes(path: Path) -> list[str]:
    """The dtypes of the floating-point tensors of one safetensors file, in its header's order."""
    names = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}
    with path.open("rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    return [names[v["dtype"]] for k, v in header.items() if k != "__metadata__" and v["dtype"] in names]


def save_dtype(setting: str, model_dir=None, model=None) -> str:
    """The dtype checkpoints are written in under config `setting`: `auto` is the dtype the starting model
    is stored in (`model_dir`'s weights) or, for a model built in memory, its parameters' dtype."""
    if setting not in SAVE_DTYPES:
        raise GraftlabError(f"save_dtype must be one of {SAVE_DTYPES}, got {setting!r}")
    if setting != "auto":
        return setting
    found = stored_dtype(model_dir) if model_dir is not None and model is None else None
    if found is None and model is not None:
        found = str(next(model.parameters()).dtype).removeprefix("torch.")
    if found not in ("float32", "bfloat16"):
        # float16 checkpoints and unreadable ones are kept in fp32, which loses nothing of the training.
        return "float32"
    return found


def cast_saved(model_dir, dtype: str) -> None:
    """Rewrite the floating-point tensors of the safetensors in the Hugging Face directory `model_dir` as
    `dtype` (fp32 training weights rounded once, to nearest) and its config.json's dtype with them. Each file
    is replaced by a rename, so a hard link to the old one (a resume directory's checkpoint) stays intact."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    model_dir, target = Path(model_dir), getattr(torch, dtype)
    for path in sorted(model_dir.glob("*.safetensors")):
        # The header alone tells whether a file needs casting: a checkpoint saved as it trained is not read.
        if all(found == dtype for found in _float_dtypes(path)):
            continue
        with safe_open(path, "pt") as f:
            metadata = f.metadata()
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        cast = {k: t.to(target) if t.is_floating_point() else t for k, t in tensors.items()}
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        save_file(cast, tmp, metadata=metadata)
        os.replace(tmp, path)
    config = model_dir / "config.json"
    record = json.loads(config.read_text()) if config.exists() else None
    if record is not None and (record.get("dtype") or record.get("torch_dtype")) != dtype:
        record["dtype"] = dtype
        record.pop("torch_dtype", None)
        tmp = config.with_name(f".config.json.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, config)
