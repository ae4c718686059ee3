"""What the on-policy trainers of the post model (OPSD, GRPO, SDPO) share around their loops: publishing a
run's kept checkpoints, step log and training curves at once, resumably, writing one checkpoint, and
(for our own loops, OPSD and SDPO) saving and restoring a loop's state.

A run writes `out_dir/step~N/` for each kept step, `out_dir/steps.jsonl` (a JSON line per optimizer step)
and `out_dir/training.png`, all at once when training ends: a failed run leaves nothing that looks done.
Kept checkpoints wait in the resume directory, which survives a kill, or without one in a scratch
directory; they are hard-linked into the output, so publishing costs no disk.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path


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
    """A kept checkpoint: the model in the saved dtype, its tokenizer and its provenance."""
    from graftlab.io.provenance import write_provenance
    from graftlab.train.precision import cast_saved

    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    cast_saved(path, dtype)
    write_provenance(path, inputs, asdict(cfg), extra=extra | {"save_dtype": dtype})


def save_loop_state(resume, name: str, step: int, log: list[dict], optimizer, **modules) -> None:
    """A loop's state after `step`: its modules (`model`, the student, and e.g. a moving `teacher`), the
    optimizer, the RNGs and the step log, renamed into place by `graftlab.train.resume.save_state`."""
    from graftlab.train import resume as rs

    state = {"step": step, "optimizer": optimizer.state_dict(), "rng": rs.rng_state(), "log": log}
    rs.save_state(resume, state | {key: m.state_dict() for key, m in modules.items()})
    print(f"resume: saved {name} step {step} to {resume.dir}", flush=True)


def load_loop_state(resume, name: str, optimizer, **modules) -> tuple[list[dict], int]:
    """The step log so far and the last step done, the modules, optimizer and RNGs restored from the
    saved state; ([], 0) when there is none."""
    from graftlab.train import resume as rs

    state = rs.load_state(resume) if resume is not None else None
    if state is None:
        return [], 0
    for key, module in modules.items():
        module.load_state_dict(state[key])
    optimizer.load_state_dict(state["optimizer"])
    rs.set_rng_state(state["rng"])
    print(f"resume: {name} continues after step {state['step']} from {resume.dir}", flush=True)
    return state["log"], state["step"]


def load_pair(post_dir, cfg, teacher_dir=None):
    """The tokenizer, the student and its teacher (a second copy of the post model, or the model at
    `teacher_dir`: a continual stage's carried-over teacher), both in fp32 master weights on the device, and
    the precision the loop runs in: the start of our own loops (OPSD, SDPO), with torch's threads and seed
    set from `cfg`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from graftlab.train.precision import WEIGHTS_DTYPE, announce, checkpointing

    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    precision = announce(cfg.precision)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tok = AutoTokenizer.from_pretrained(post_dir)
    student, teacher = (
        AutoModelForCausalLM.from_pretrained(d, dtype=WEIGHTS_DTYPE).to(device)
        for d in (post_dir, teacher_dir or post_dir)
    )
    if checkpointing(cfg.gradient_checkpointing):
        student.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return tok, student, teacher, precision
