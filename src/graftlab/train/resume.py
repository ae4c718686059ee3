"""Resume after preemption: trainers save their full state every `resume_minutes` into a resume directory,
`resume/<the job's output path>`, and a rerun continues from it.

The directory lies outside the declared outputs because Snakemake deletes those before it reruns a job. It
is removed when the job succeeds, and discarded on start when it was written for another configuration
(a changed epoch count or data set would otherwise resume into the wrong schedule).

Transformers trainers (SFT, the Pedagogical RL teacher) use the Trainer's own checkpoints, asked for by a
time-based callback; OPSD's own loop saves one `state.pt` with `save_state`.

When training ends, a trainer records it (`mark_trained`) before it publishes its checkpoints, and
publishes them as hard links (`link_tree`), so the resume directory stays whole until the job's output
is: a kill while the output is written reruns only the writing, never the training.
"""

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from graftlab.io.atomic import remove_tree

ROOT = Path("resume")
STATE = "state.pt"
TRAINED = "trained.json"
# A Trainer checkpoint written for resuming only, not one the job outputs.
RESUME_ONLY = ".resume-only"
# Files a Trainer checkpoint holds that are training state, not part of a model.
TRAINER_STATE = ("trainer_state.json", "training_args.bin", "optimizer.pt", "scheduler.pt", "rng_state.pth")


def resume_dir(output: str | Path) -> Path:
    """`resume/` + the output path. An absolute path is taken relative to the working directory when
    it lies inside it, else from its root down: `ROOT / "/abs/out"` would be `/abs/out` itself, and the
    finished job's cleanup would delete its own output."""
    output = Path(output)
    if output.is_absolute():
        try:
            output = output.relative_to(Path.cwd())
        except ValueError:
            output = output.relative_to(output.anchor)
    return ROOT / output


@dataclass
class Resume:
    """A job's resume directory and how often to save into it (0 minutes: after every step)."""

    dir: Path
    minutes: float
    last: float = field(default_factory=time.monotonic)

    def due(self) -> bool:
        now = time.monotonic()
        if now - self.last < self.minutes * 60:
            return False
        self.last = now
        return True

    def open(self, fingerprint: dict) -> None:
        """Create the directory, first emptying it if it holds the state of another configuration."""
        self.dir = Path(self.dir)
        mark = self.dir / "fingerprint.json"
        text = json.dumps(fingerprint, sort_keys=True, default=str)
        if self.dir.exists() and (not mark.exists() or mark.read_text() != text):
            print(f"resume: discarding {self.dir}, written for another configuration", flush=True)
            shutil.rmtree(self.dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        mark.write_text(text)

    def finish(self) -> None:
        remove_tree(self.dir)


def fingerprint(cfg, **more) -> dict:
    """What a saved state depends on: the config without how it runs (a retry may get other threads,
    another sampling engine or other live metrics, and its state is still good)."""
    from dataclasses import asdict

    return {k: v for k, v in asdict(cfg).items() if k not in ("threads", "backend", "live")} | more


def mark_trained(resume: Resume, record: dict) -> None:
    """Record that training ended, with what publishing its output needs (e.g. the step log)."""
    tmp = resume.dir / f".{TRAINED}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, resume.dir / TRAINED)


def trained(resume: Resume | None) -> dict | None:
    """The record of a training that ended but whose output was not written yet, else None."""
    path = resume.dir / TRAINED if resume is not None else None
    if path is None or not path.exists():
        return None
    print(f"resume: training had ended; writing the output from {resume.dir}", flush=True)
    return json.loads(path.read_text())


def link_tree(src: Path, dst: Path, skip: tuple[str, ...] = ()) -> None:
    """A copy of directory `src` at `dst` whose files are hard links (a copy where the file system
    refuses one), so publishing a checkpoint costs no disk and leaves `src` whole; names in `skip` are
    left out."""
    dst.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        if item.name in skip:
            continue
        if item.is_dir():
            link_tree(item, dst / item.name, skip)
            continue
        try:
            os.link(item, dst / item.name)
        except OSError:
            shutil.copy2(item, dst / item.name)


def rng_state() -> dict:
    import random

    import numpy as np
    import torch

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    import random

    import numpy as np
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_state(resume: Resume, state: dict) -> None:
    """`state` to the resume directory, renamed into place so a kill mid-write leaves the previous one."""
    import torch

    tmp = resume.dir / f".{STATE}.tmp-{os.getpid()}"
    torch.save(state, tmp)
    os.replace(tmp, resume.dir / STATE)


def load_state(resume: Resume) -> dict | None:
    import torch

    path = resume.dir / STATE
    # Our own file, holding numpy RNG state that the weights-only unpickler refuses.
    return torch.load(path, weights_only=False) if path.exists() else None


def _whole(checkpoint: Path) -> bool:
    """Whether the Trainer finished writing `checkpoint`: it writes the model, then optimizer, scheduler
    and RNG state, and `trainer_state.json` last, none of them atomically; a kill mid-save leaves a
    directory with a truncated optimizer or no trainer state, which resuming from would crash on."""
    try:
        json.loads((checkpoint / "trainer_state.json").read_text())
    except (OSError, ValueError):
        return False
    return (checkpoint / "optimizer.pt").exists()


def last_checkpoint(resume: Resume) -> str | None:
    """The Trainer checkpoint to resume from: the newest whole one that still holds the optimizer."""
    found = [p for p in resume.dir.glob("checkpoint-*") if _whole(p)]
    if not found:
        return None
    newest = max(found, key=lambda p: int(p.name.split("-")[1]))
    print(f"resume: continuing from {newest}", flush=True)
    return str(newest)


def trainer_callback(resume: Resume):
    """A TrainerCallback asking the Trainer for a checkpoint every `resume.minutes`; those it asks for
    alone are marked resume-only. After each save only the newest checkpoint keeps its training state,
    so the resume directory holds one optimizer, not one per checkpoint."""
    from transformers import TrainerCallback

    class SaveEvery(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            # The Trainer's own schedule has run before this callback: a save it asked for is an output.
            if resume.due() and not control.should_save:
                control.should_save = True
                self.resume_only = state.global_step

        def on_save(self, args, state, control, **kwargs):
            newest = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            # At an epoch's last step a time save comes first and the epoch's save rewrites the same
            # directory after it: that second save makes it an output again.
            if getattr(self, "resume_only", None) == state.global_step:
                (newest / RESUME_ONLY).touch()
            else:
                (newest / RESUME_ONLY).unlink(missing_ok=True)
            self.resume_only = None
            for ckpt in Path(args.output_dir).glob("checkpoint-*"):
                if ckpt == newest:
                    continue
                if (ckpt / RESUME_ONLY).exists():
                    shutil.rmtree(ckpt)
                else:
                    for name in TRAINER_STATE:
                        (ckpt / name).unlink(missing_ok=True)
            print(f"resume: saved step {state.global_step} to {newest}", flush=True)

    return SaveEvery()
