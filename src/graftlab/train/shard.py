"""Our own on-policy loops (OPSD, SDPO: `graftlab.train.onpolicy`) and the diagonal Fisher
(`graftlab.fisher.diag`) over several processes, one per GPU, with their models sharded (FSDP), for a model
whose state does not fit one GPU.

torch's FSDP2 (`fully_shard`) directly, not through accelerate as SFT is: accelerate turns an FSDP config into
plain data parallelism where there is no CUDA, so the sharded path could never run on a CPU, where
`fully_shard` over gloo shards exactly as over NCCL (tests/test_shard.py trains two CPU processes against
one). Each decoder layer is one unit, gathered for its forward and backward and freed after; the whole model
the root unit (embeddings, final norm, head). Each process holds 1/N of the weights, gradients and AdamW's
state, takes 1/N of every batch, and FSDP averages the gradients, so a loss scaled by N (`PairStep.scale`)
gives the one-process gradient.

`launch` starts the processes (torch's own launcher, on a free port; or accelerate's, for TRL's GRPO
trainer, which accelerate shards with FSDP_CONFIG as it does SFT) and runs a pickled call in each;
the first process alone writes files. What the processes must agree on (when to save, the batch that fits)
is the first one's (`from_first`) or their least (`least`); whole states are gathered on the first
(`full_state`, `full_optimizer_state`) and sent back out in shards (`restore`).
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

# accelerate's launch config for a trainer sharded over the GPUs of one node (SFT, GRPO): FSDP, one unit per
# decoder layer, fp32 master weights, bf16 compute.
FSDP_CONFIG = Path(__file__).resolve().parents[1] / "commands" / "fsdp.yaml"


def world() -> tuple[int, int]:
    """(this process's rank, the number of processes): (0, 1) outside a launch."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def join():
    """This process's device, its process group joined when it is one of several (NCCL over GPUs, gloo over
    CPU processes)."""
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world()[1] > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    return device


def job_processes(gpus: int) -> tuple[int, str]:
    """How many training processes a job given `gpus` GPUs starts, and why: one per GPU torch can use, at
    most `gpus`. On a node without CUDA whose scheduler still gave the job GPUs (`SLURM_GPUS_ON_NODE`; the
    test cluster's fake GPUs, tests/slurm/local-slurm.sh), one CPU process per GPU given, over gloo, so the
    multi-process path runs where no GPU is (SFT's accelerate launch as data parallel, our loops sharded)."""
    import torch

    if torch.cuda.is_available():
        seen = torch.cuda.device_count()
        return min(gpus, seen), f"{gpus} GPUs asked for, {seen} visible"
    given = int(os.environ.get("SLURM_GPUS_ON_NODE") or 0)
    return min(gpus, given), f"no CUDA; {given} GPUs given by SLURM, each a CPU process (gloo)"


def job_gpus_processes(resources) -> int:
    """The processes a workflow job trains or samples in, given its `snakemake.resources` (their `gpu`, none
    on a CPU rule), at least one; said in its log when more. More than one GPU is asked for only when the
    model does not fit one or one engine would run past the time limit (graftlab.planning.resources)."""
    processes, why = job_processes(int(getattr(resources, "gpu", 0) or 0))
    if processes > 1:
        print(f"processes: {processes} ({why})", flush=True)
    return max(1, processes)


def sharded() -> bool:
    import torch.distributed as dist

    return dist.is_initialized() and dist.get_world_size() > 1


def decoder_layers(model) -> list[str]:
    """The names of the model's decoder layers: the classes it names in `_no_split_modules` (what accelerate's
    transformer wrap takes). The units of sharding here and of recomputation in `graftlab.fisher.backward`."""
    units = set(getattr(model, "_no_split_modules", None) or ())
    return [name for name, m in model.named_modules() if type(m).__name__ in units]


def shard(model):
    """`model` sharded over the processes in place: one FSDP unit per decoder layer, the model the root unit."""
    from torch.distributed.fsdp import fully_shard

    from graftlab.errors import GraftlabError

    layers = decoder_layers(model)
    if not layers:
        raise GraftlabError(f"{type(model).__name__} names no decoder layer class (_no_split_modules) to shard by")
    for layer in layers:
        fully_shard(model.get_submodule(layer))
    fully_shard(model)
    return model


def _full(**options):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **options)


def full_state(model, tied_once: bool = True) -> dict | None:
    """The whole model's state on the CPU of the first process (None on the others): every process must call
    it, as it gathers each shard. `tied_once`: a tied weight under one name, as a checkpoint writes it."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state = get_model_state_dict(model, options=_full(cpu_offload=True))
    if world()[0]:
        return None
    if not tied_once:
        return state
    # A tied weight (an output head that is the input embedding) once, under the name `named_parameters`
    # keeps, as `save_pretrained` writes an unsharded model: the gathered state has each name as a copy.
    own = {name for name, _ in model.named_parameters()} | {name for name, _ in model.named_buffers()}
    return {name: t for name, t in state.items() if name in own}


def full_optimizer_state(model, optimizer) -> dict | None:
    """The optimizer's whole state (by parameter name) on the CPU of the first process, None on the others."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state = get_optimizer_state_dict(model, optimizer, options=_full(cpu_offload=True))
    return None if world()[0] else state


def restore(model, state: dict | None) -> None:
    """A sharded model set from the whole state the first process read (`full_state`; the others pass None):
    each process takes its shards as they are sent."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(model, state or {}, options=_full(broadcast_from_rank0=True))


def restore_optimizer(model, optimizer, state: dict | None) -> None:
    """`restore` for the optimizer of `model` (`full_optimizer_state`)."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, state or {}, options=_full(broadcast_from_rank0=True))


def from_first(value: Any) -> Any:
    """The first process's `value` on every process (`value` outside a launch): what they must agree on."""
    if not sharded():
        return value
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def full_parameters(model):
    """`(name, tensor)` of every parameter, whole on every process (each gathered in turn, in the same order
    on all): what a sampling engine of the whole model loads."""
    for name, p in model.named_parameters():
        yield name, p.full_tensor() if hasattr(p, "full_tensor") else p


def total(value: float) -> float:
    """`value` summed over the processes (itself outside a launch)."""
    return _reduced(value, "SUM")


def least(value: float) -> float:
    """The smallest of every process's `value` (itself outside a launch)."""
    return _reduced(value, "MIN")


def _reduced(value: float, op: str) -> float:
    if not sharded():
        return value
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(value)], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
    return float(t.item())


def everyone(items: list) -> list:
    """Every process's `items`, in rank order, on every process (`items` outside a launch): small records
    such as a step's rollouts, for a log that counts them all."""
    if not sharded():
        return items
    import torch.distributed as dist

    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, items)
    return [item for share in gathered for item in share]


def part(items: list, what: str) -> list:
    """This process's equal, contiguous share of `items` (the whole list outside a launch); refused when they do
    not split evenly: every process must make the same number of forward passes, FSDP's gathers meet."""
    from graftlab.errors import GraftlabError

    rank, size = world()
    if len(items) % size:
        raise GraftlabError(f"{what}: {len(items)} do not split over {size} processes")
    n = len(items) // size
    return items[rank * n : (rank + 1) * n]


def launch(processes: int, call: Callable[..., Any], *args: Any, accelerate: Path | None = None) -> None:
    """Run `call(*args)` in `processes` processes of this node, on a port free now (two jobs on one node must
    not meet on a launcher's default one); refused in one line when any of them fails. The processes are
    torch's launcher's, or with `accelerate` (a config such as `FSDP_CONFIG`) accelerate's, for TRL's
    trainers, which prepare their models through it."""
    from graftlab.errors import GraftlabError
    from graftlab.sampling import free_port

    with tempfile.TemporaryDirectory(prefix="graftlab-launch-") as tmp:
        spec = Path(tmp) / "call.pkl"
        spec.write_bytes(pickle.dumps((call, args)))
        if accelerate is None:
            command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes)]
            command += ["--master_addr", "localhost", "--master_port", str(free_port())]
        else:
            command = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(processes)]
            command += ["--config_file", str(accelerate), "--main_process_port", str(free_port())]
        command += ["-m", __name__, str(spec)]
        print("launch: " + " ".join(command), flush=True)
        done = subprocess.run(command, check=False)
        refusals = sorted(Path(tmp).glob("refused-*"))
        if done.returncode and refusals:  # a process's own refusal (a divergence, bad data) is the launch's
            raise GraftlabError(refusals[0].read_text())
    if done.returncode:
        raise GraftlabError(f"{processes} processes failed (exit status {done.returncode}); see the log above")


def main(spec: str) -> None:
    import torch.distributed as dist

    from graftlab.errors import GraftlabError

    call, args = pickle.loads(Path(spec).read_bytes())
    join()
    try:
        call(*args)  # a failure ends this process with its traceback; the launcher ends the others
    except GraftlabError as err:
        # Handed to `launch`, which raises it as its own: the job's one line, not "N processes failed".
        Path(spec).with_name(f"refused-{world()[0]}").write_text(str(err))
        raise
    if dist.is_initialized():
        dist.barrier()  # every process's work is written before any tears its group down
        dist.destroy_process_group()
    # Out without the interpreter's finalization: objects freed there (DTensors, gloo work still holding
    # tensors) can abort the process after its work is done ("terminate called without an active
    # exception", rare, seen in one CI run; pytorch/pytorch#190489, #179291), failing a finished job.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
