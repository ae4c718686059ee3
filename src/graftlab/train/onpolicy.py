"""The on-policy run of the post model (OPSD, GRPO, SDPO): what every method shares around its step.

`OnPolicyRun` is our own loops' skeleton (OPSD, SDPO): load the student and its teacher, let the method
sample each batch and make its optimizer steps, keep the checkpoints, save and restore the resume state,
write the step log, publish. A method is a `StepFunction` on it. GRPO runs TRL's trainer and shares the
publishing and the checkpoint writer.

A run writes `out_dir/step~N/` for each kept step, `out_dir/steps.jsonl` (a JSON line per optimizer step)
and `out_dir/training.png`, all at once when training ends: a failed run leaves nothing that looks done.
Kept checkpoints wait in the resume directory, which survives a kill, or without one in a scratch
directory; they are hard-linked into the output, so publishing costs no disk.

Over several processes (`processes`, one per GPU: `graftlab.train.shard`) the student and teacher are
sharded, each process samples and trains on its share of every batch, and the first process alone writes;
the job's own process launches them and publishes as it would its own loop's. Its resume state is whole
(gathered on the first process, by parameter name): the first process decides when to save, and a rerun
with as many processes sends each its shards.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol


def publish_run(
    out_dir,
    checkpoints: tuple[int, ...],
    resume,
    fingerprint: dict,
    train: Callable[[Path], list[dict]],
    extras: tuple[str, ...] = (),
) -> list[dict]:
    """Run `train(work)` (which saves the kept checkpoints `work/step~N`, and any `extras` such as `teacher`,
    and returns the step log), unless a killed job already ended training, then write the run to `out_dir`.
    With `resume` (a `graftlab.train.resume.Resume`) its directory is opened under `fingerprint` and removed
    at the end."""
    from graftlab.io.atomic import atomic_dir
    from graftlab.train import resume as rs
    from graftlab.train.curves import write_step_log

    out_dir = Path(out_dir)
    if resume is not None:
        resume.open(fingerprint)
    work = resume.dir if resume is not None else out_dir.parent / f".{out_dir.name}.work-{os.getpid()}"
    try:
        done = rs.trained(resume)
        log = done["log"] if done is not None else train(work)
        with atomic_dir(out_dir) as tmp:
            for name in [f"step~{step}" for step in checkpoints] + list(extras):
                rs.link_tree(work / name, tmp / name)
            write_step_log(log, tmp / "steps.jsonl")
    finally:
        if resume is None:
            shutil.rmtree(work, ignore_errors=True)
    if resume is not None:
        resume.finish()
    return log


def save_checkpoint(model, tokenizer, path: Path, dtype: str, inputs: dict, cfg, extra: dict) -> None:
    """A kept checkpoint: the model in the saved dtype, its tokenizer and its provenance. A sharded model is
    gathered (every process calls this) and written by the first process."""
    from graftlab.io.provenance import write_provenance
    from graftlab.train import shard
    from graftlab.train.precision import cast_saved
    from graftlab.train.settings import recorded

    state = shard.full_state(model) if shard.sharded() else None
    if shard.world()[0]:
        return
    model.save_pretrained(path, state_dict=state)
    tokenizer.save_pretrained(path)
    cast_saved(path, dtype)
    write_provenance(path, inputs, recorded(cfg), extra=extra | {"save_dtype": dtype})


def save_loop_state(resume, name: str, step: int, log: list[dict], optimizer, **modules) -> None:
    """A loop's state after `step`: its modules (`model`, the student, and e.g. a moving `teacher`), the
    optimizer, the RNGs and the step log, renamed into place by `graftlab.train.resume.save_state`. Sharded,
    every process gathers its shards (every one calls this) and the first writes the whole state."""
    from graftlab.train import resume as rs
    from graftlab.train import shard

    if shard.sharded():
        state = {key: shard.full_state(m, tied_once=False) for key, m in modules.items()}
        state["optimizer"] = shard.full_optimizer_state(modules["model"], optimizer)
        if shard.world()[0]:
            return
    else:
        state = {key: m.state_dict() for key, m in modules.items()} | {"optimizer": optimizer.state_dict()}
    rs.save_state(resume, state | {"step": step, "rng": rs.rng_state(), "log": log})
    print(f"resume: saved {name} step {step} to {resume.dir}", flush=True)


def load_loop_state(resume, name: str, optimizer, **modules) -> tuple[list[dict], int]:
    """The step log so far and the last step done, the modules, optimizer and RNGs restored from the
    saved state; ([], 0) when there is none. Sharded, the first process reads it and sends each its shards."""
    from graftlab.train import resume as rs
    from graftlab.train import shard

    first = shard.world()[0] == 0
    state = rs.load_state(resume) if resume is not None and first else None
    if shard.from_first(state is None):
        return [], 0
    if shard.sharded():
        for key, module in modules.items():
            shard.restore(module, state and state[key])
        shard.restore_optimizer(modules["model"], optimizer, state and state["optimizer"])
    else:
        for key, module in modules.items():
            module.load_state_dict(state[key])
        optimizer.load_state_dict(state["optimizer"])
    log, step = shard.from_first(state and (state["log"], state["step"]))
    if first:
        rs.set_rng_state(state["rng"])
        print(f"resume: {name} continues after step {step} from {resume.dir}", flush=True)
    return log, step


def load_pair(post_dir, cfg, teacher_dir=None, frozen_teacher: bool = True):
    """The tokenizer, the student and its teacher (a second copy of the post model, or the model at
    `teacher_dir`: a continual stage's carried-over teacher) on the device, and the precision the loop runs
    in: the start of our own loops (OPSD, SDPO), with torch's threads and seed set from `cfg`. The student
    in fp32 master weights; a `frozen_teacher` in bf16 when the loop computes in bf16 (it is only ever read,
    and autocast reads it in bf16 anyway), else fp32 (a moving teacher blends in the student's updates).
    Over several processes both are sharded and the job's threads shared among them."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from graftlab.train import shard
    from graftlab.train.precision import WEIGHTS_DTYPE, announce, checkpointing, enable_recompute

    device = shard.join()
    processes = shard.world()[1]
    torch.set_num_threads(max(1, cfg.threads // processes))
    torch.manual_seed(cfg.seed)
    precision = announce(cfg.precision)
    tok = AutoTokenizer.from_pretrained(post_dir)
    student = AutoModelForCausalLM.from_pretrained(post_dir, dtype=WEIGHTS_DTYPE)
    teacher_dtype = torch.bfloat16 if frozen_teacher and precision.bf16 else WEIGHTS_DTYPE
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir or post_dir, dtype=teacher_dtype)
    if checkpointing(cfg.gradient_checkpointing):
        enable_recompute(student)
    if processes > 1:
        # Sharded where they were loaded, in host memory: FSDP moves each process's shards to its device, so
        # no GPU ever holds a whole model.
        print(f"processes: {processes}, student and teacher sharded (FSDP)", flush=True)
        return tok, shard.shard(student), shard.shard(teacher), precision
    return tok, student.to(device), teacher.to(device), precision


class PairStep:
    """What our own loops' step functions share: the student being trained, its teacher (only ever scored:
    no gradient reaches it), the tokenizer, the optimizer, the update's micro-batch, the precision and the
    student's sampler. `batch` is the method's batch (its spec's), which `micro` divides."""

    name = "the on-policy loop"  # the method, in its errors

    def __init__(self, student, teacher, tokenizer, cfg, batch: int, precision=None, micro: int | None = None):
        import torch

        from graftlab.train import shard
        from graftlab.train.precision import Precision

        self.student, self.teacher, self.tok, self.cfg = student, teacher.eval().requires_grad_(False), tokenizer, cfg
        self.precision = precision or Precision("fp32", "none chosen")
        # Examples per forward and backward pass of the update; the step function's `start` sizes it (auto).
        self.micro = micro or (cfg.micro_batch_size if cfg.micro_batch_size != "auto" else batch)
        self.optimizer = torch.optim.AdamW(student.parameters(), lr=cfg.lr)
        self.k = min(cfg.top_k, student.config.vocab_size)
        # Over several processes FSDP averages their gradients: a loss scaled by their count sums them.
        self.scale = shard.world()[1]
        self.step = 0  # the optimizer step being made, which the method's `steps` sets: named if it diverges

    @functools.cached_property
    def sampler(self):
        from graftlab.sampling import Engine, policy_sampler

        return policy_sampler(self.student, self.tok, Engine.of(self.cfg.backend, seed=self.cfg.seed))

    def autocast(self):
        return self.precision.autocast(self.student.device.type)

    def serving(self, batches: Iterator[list[dict]]) -> Iterator[tuple[list[dict], range]]:
        """Each sampled batch of `batches` with the optimizer steps it serves: `updates_per_batch` a pass, each
        on its own share (`share_of`), `epochs_per_batch` passes; fewer at the run's end."""
        cfg = self.cfg
        per = cfg.updates_per_batch * cfg.epochs_per_batch
        for first, batch in zip(range(1, cfg.steps + 1, per), batches):
            yield batch, range(first, min(first + per - 1, cfg.steps) + 1)

    def share_of(self, items: list, steps: range, step: int, what: str) -> tuple[list, list]:
        """The share of a sampled batch's `items` (every process's, in order) that optimizer step `step` of
        the batch's `steps` trains on, and this process's part of it: the (step - first) mod U-th of U
        equal slices, as verl deals a batch into mini-batches."""
        from graftlab.train import shard

        u = self.cfg.updates_per_batch
        n, i = len(items) // u, (step - steps[0]) % u
        share = items[i * n : (i + 1) * n]
        return share, shard.part(share, what)

    def optimizer_step(self, loss: float) -> float:
        """Clip the accumulated gradient to `max_grad_norm` (0: no clipping) and step; the global norm before
        clipping, over every process's shards. torch's clip_grad_norm_, as HF's Trainer uses for SFT and GRPO:
        over FSDP2's sharded parameters it reduces the norm across processes itself (a DTensor). Refused
        before the step when the norm or the update's `loss` (the whole batch's) is not finite."""
        import torch

        from graftlab.train.diverge import refuse_diverged

        limit = self.cfg.max_grad_norm or float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.student.parameters(), limit)
        norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        refuse_diverged(self.name, self.step, loss, norm)  # every process sees the same and stops
        self.optimizer.step()
        return norm


class StepFunction(Protocol):
    """A method on the on-policy run: its modules and optimizer, the batches it samples, and the optimizer
    steps it makes on each."""

    student: Any
    optimizer: Any

    def rounds(self, data: list[dict]) -> Iterator[tuple[list[dict], range]]:
        """Each sampled batch with the optimizer steps (1-based, at most the run's steps) it serves, in the
        seeded order a rerun replays."""

    def steps(self, batch: list[dict], steps: range) -> Iterator[dict]:
        """Sample `batch` and make `steps`, yielding each step's log record as soon as that step is done."""

    def state(self) -> dict[str, Any]:
        """The modules a resume state holds: `model` (the student), and e.g. a moving `teacher`."""

    def finals(self) -> dict[str, tuple[Any, dict]]:
        """Models written beside the checkpoints at the end, by name, with their provenance's extras."""


class OnPolicyRun:
    """One run of our own on-policy loop: `start(tok, student, teacher, precision)` makes the method's step
    function once the pair is loaded (picklable: a launch over several processes sends the run). `name` names
    it in logs; `unit` what its data are (`examples`, `problems`), counted in each checkpoint's provenance."""

    def __init__(
        self, name: str, unit: str, post_dir, cfg, start: Callable[..., StepFunction], frozen_teacher: bool = True
    ) -> None:
        self.name, self.unit, self.post_dir, self.cfg, self.start = name, unit, post_dir, cfg, start
        self.frozen_teacher = frozen_teacher  # `load_pair` keeps a frozen teacher in bf16 under bf16 compute

    def train(
        self,
        data: list[dict],
        out_dir,
        inputs: dict | None,
        resume,
        fingerprint: dict,
        teacher_dir=None,
        extras=(),
        processes: int = 1,
    ) -> list[dict]:
        """Train on `data` over `processes` (one per GPU) and publish the run to `out_dir` (`publish_run`),
        `extras` (e.g. `teacher`) beside the checkpoints. Returns the step log."""
        loop = functools.partial(self._loop, data, inputs, resume, teacher_dir)
        if processes > 1:
            loop = functools.partial(launch_run, processes, loop)
        # A state saved by sharded processes is by parameter name and whole: another count does not resume it.
        fingerprint = fingerprint | ({"processes": processes} if processes > 1 else {})
        return publish_run(out_dir, self.cfg.checkpoints(), resume, fingerprint, loop, extras=extras)

    def _loop(self, data: list[dict], inputs: dict | None, resume, teacher_dir, work: Path) -> list[dict]:
        """The loop: kept checkpoints into `work`; with `resume`, the state saved after a batch when due and
        the end of training marked. Returns the step log."""
        from graftlab.train import live, shard
        from graftlab.train import resume as rs
        from graftlab.train.precision import save_dtype

        cfg = self.cfg
        tok, student, teacher, precision = load_pair(self.post_dir, cfg, teacher_dir, self.frozen_teacher)
        first = shard.world()[0] == 0  # the process that logs and reports
        dtype = save_dtype(cfg.save_dtype, self.post_dir)
        method = self.start(tok, student, teacher, precision)
        inputs = inputs or {"post": str(self.post_dir)}
        keep = set(cfg.checkpoints())
        log, done = load_loop_state(resume, self.name, method.optimizer, **method.state())
        last = done
        with live.writer(cfg.live if first else None) as watched:
            for batch, steps in method.rounds(data):
                if steps[-1] <= done:
                    continue  # the data position: the seeded order replayed up to the saved step
                for record in method.steps(batch, steps):
                    log.append(record)
                    if first:
                        print(json.dumps(record), flush=True)
                        watched(record)
                    if record["step"] in keep:
                        extra = {"step": record["step"], self.unit: len(data)}
                        path = work / f"step~{record['step']}"
                        save_checkpoint(method.student, tok, path, dtype, inputs, cfg, extra)
                last = steps[-1]
                # When to save is the first process's call: every process must gather its shards then.
                if resume is not None and last < cfg.steps and shard.from_first(resume.due()):
                    save_loop_state(resume, self.name, last, log, method.optimizer, **method.state())
        for name, (module, extra) in method.finals().items():
            save_checkpoint(module, tok, work / name, dtype, inputs, cfg, {"step": last} | extra)
        if resume is not None and first:
            rs.mark_trained(resume, {"log": log})
        return log


LAUNCHED_LOG = "launched-log.json"


def launch_run(
    processes: int, loop: Callable[[Path], list[dict]], work: Path, accelerate: Path | None = None
) -> list[dict]:
    """`loop(work)`, a run's training (picklable), over `processes` processes (`graftlab.train.shard.launch`;
    under accelerate with its config `accelerate`): the step log the first process returns."""
    from graftlab.train import shard

    shard.launch(processes, _first_keeps_log, loop, work, accelerate=accelerate)
    return json.loads((work / LAUNCHED_LOG).read_text())


def _first_keeps_log(loop: Callable[[Path], list[dict]], work: Path) -> None:
    """One process of a launched run: the loop, its step log left in `work` by the first process for the
    job's process to publish."""
    from graftlab.train import shard

    log = loop(work)
    if shard.world()[0] == 0:
        work.mkdir(parents=True, exist_ok=True)
        (work / LAUNCHED_LOG).write_text(json.dumps(log))
