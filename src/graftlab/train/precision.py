"""Training precision, chosen per job from the config and the hardware, never inherited.

TRL's configs leave `bf16` unset and then turn on bf16 autocast wherever torch says the CPU supports
bf16, which includes AVX2-only CPUs that emulate it: there one SFT step of the tiny world's
post-training took 1.24 s against 0.24 s in fp32. So the choice is explicit:

- a CUDA GPU with bf16: bf16 autocast (fp32 master weights) unless the config asks for fp32;
- a CPU: fp32, unless the config asks for bf16 *and* the CPU computes it natively (AMX or
  AVX512-BF16 in /proc/cpuinfo); `auto` stays fp32 there, since on models as small as the tiny world's
  even native bf16 is slower (1.7x per step on an AVX512-BF16 Xeon: benchmarks/README.md).

Every trainer prints its choice as one line of its job log (`announce`).
"""

from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

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
        """For transformers/TRL training arguments: both flags set, so no library default decides."""
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
