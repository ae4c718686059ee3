"""What the on-policy trainers of the post model (OPSD, SDPO) share around their loops: publishing a run's
kept checkpoints, step log and training curves at once, resumably, and writing one checkpoint.

A run writes `out_dir/step~N/` for each kept step, `out_dir/steps.jsonl` (a JSON line per optimizer step)
and `out_dir/training.png`, all at once when training ends: a failed run leaves nothing that looks done.
Kept checkpoints wait in the resume directory, which survives a kill, or without one in a scratch
directory; they are hard-linked into the output, so publishing costs no disk.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path


def publish_run(
    out_dir, checkpoints: tuple[int, ...], resume, fingerprint: dict, train: Callable[[Path], list[dict]]
) -> list[dict]:
    """Run `train(work)` (which saves the kept checkpoints `work/step~N` and returns the step log), unless a
    killed job already ended training, then write the run to `out_dir`. With `resume` (a
    `graftlab.train.resume.Resume`) its directory is opened under `fingerprint` and removed at the end."""
    from graftlab.atomic import atomic_dir
    from graftlab.train import resume as rs
    from graftlab.train.curves import plot_training

    out_dir = Path(out_dir)
    if resume is not None:
        resume.open(fingerprint)
    work = resume.dir if resume is not None else out_dir.parent / f".{out_dir.name}.work-{os.getpid()}"
    try:
        done = rs.trained(resume)
        log = done["log"] if done is not None else train(work)
        with atomic_dir(out_dir) as tmp:
            for step in checkpoints:
                rs.link_tree(work / f"step~{step}", tmp / f"step~{step}")
            (tmp / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log))
            plot_training(log, tmp / "training.png")
    finally:
        if resume is None:
            shutil.rmtree(work, ignore_errors=True)
    if resume is not None:
        resume.finish()
    return log


def save_checkpoint(model, tokenizer, path: Path, dtype: str, inputs: dict, cfg, extra: dict) -> None:
    """A kept checkpoint: the model in the saved dtype, its tokenizer and its provenance."""
    from graftlab.provenance import write_provenance
    from graftlab.train.precision import cast_saved

    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    cast_saved(path, dtype)
    write_provenance(path, inputs, asdict(cfg), extra=extra | {"save_dtype": dtype})
