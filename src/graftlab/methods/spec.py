"""What a method's spec is: the torch-free description of its config section that the workflow's
planning and the method's trainer share.

`check(section)` returns the section's problems as `field: message` strings, and an empty list when it
has none. `section` is either a config section (sweep axes as lists of strings, `checkpoints`) or one
run's settings as a trainer holds them (one value per sweep axis, `save_steps`): the config resolution
(`graftlab.planning.config`) prefixes each problem with the experiment's key, and a trainer's config
refuses to exist with any (`refuse`). Standard library only: the workflow reads specs on every parse.
"""

from __future__ import annotations

import math
import re

from graftlab.errors import GraftlabError


def listed(value) -> list:
    """A sweep axis as a list: a config section's list, or a run's one value."""
    return list(value) if isinstance(value, list | tuple) else [value]


def refuse(name: str, problems: list[str]) -> None:
    """A trainer's config check: a GraftlabError naming every problem, or nothing."""
    if problems:
        raise GraftlabError(f"{name} config: " + "; ".join(problems))


def holes(template: str, needed: tuple[str, ...]) -> list[str]:
    return [h for h in needed if h not in template]


def fill(template: str, **values: str) -> str:
    """`template` with each placeholder `{name}` of `values` replaced by its value, all in one pass: a value
    holding a placeholder of its own (a LaTeX problem's `{solution}`) stays as it is, where one replace
    after another would fill it too. Not str.format: templates and values may hold braces."""
    if not values:
        return template
    pattern = "|".join(re.escape("{" + name + "}") for name in values)
    return re.sub(pattern, lambda m: values[m.group()[1:-1]], template)


class Spec:
    """A method's config section: its name, the sweep axes written as strings, and its checks."""

    section: str = ""
    # Fields (dotted within the section) whose list of strings names runs: the config checks each is
    # finite and spelled once, and an `lr` axis positive.
    sweeps: tuple[str, ...] = ()

    def check(self, section: dict) -> list[str]:
        return []


class TrainerSpec(Spec):
    """A method that trains a model: its updates are made of whole micro-batches."""

    sweeps = ("lr",)

    def batch(self, section: dict) -> int:
        """The examples one optimizer step averages over: what `micro_batch_size` must divide."""
        return section["batch_size"]

    def check(self, section: dict) -> list[str]:
        # The batch is only whole once the method's own fields are sound (SDPO's updates share its rollouts).
        clip = section["max_grad_norm"]
        if not (isinstance(clip, int | float) and not isinstance(clip, bool) and clip >= 0):
            return [f"max_grad_norm: must be a number >= 0 (0: no clipping), got {clip!r}"]
        if problems := self.own(section):
            return problems
        micro, batch = section["micro_batch_size"], self.batch(section)
        if micro != "auto" and (not isinstance(micro, int) or isinstance(micro, bool) or micro < 1):
            return [f"micro_batch_size: must be auto or an integer >= 1, got {micro!r}"]
        divides = micro == "auto" or batch % micro == 0
        return [] if divides else [f"micro_batch_size: {micro} does not divide the batch of {batch}"]

    def own(self, section: dict) -> list[str]:
        """The method's own checks beyond its batch."""
        return []


class OnPolicySpec(TrainerSpec):
    """An on-policy trainer of the post model: it samples as it trains, runs `steps` optimizer steps and
    keeps `checkpoints` of them (`graftlab.planning.layout.kept_steps`), each one evaluated."""

    # Model copies on the GPU while it trains: 2 where a frozen or moving teacher sits beside the student.
    models: int = 1
    # The run key's fields after `post`, in path order (the kept step follows them).
    keys: tuple[str, ...] = ("lr",)

    def runs(self, section: dict) -> list[dict[str, str]]:
        """The keys of every run the section sweeps, in the order tables list them."""
        return [{"lr": lr} for lr in section["lr"]]

    # Whether its trainer shards the student and its scorers over several GPUs (our own loops:
    # graftlab.train.shard; TRL's GRPO under accelerate with FSDP), and whether, sharded, it still saves a
    # resume state (our loops gather a whole one; TRL's trainers over several processes save none).
    shards: bool = False
    resumes_sharded: bool = False

    def scorers(self, section: dict) -> int:
        """Models beside the student that only score (a teacher, a reference)."""
        return self.models - 1

    def scorer_bytes(self, section: dict) -> int:
        """Bytes a parameter of a scoring model takes on a GPU: fp32 unless the trainer keeps it in bf16."""
        return 4

    def sampled(self, section: dict) -> int:
        """Samples in a sampled batch: its problems (one sample each) unless the method samples a group."""
        return section["batch_size"]

    def batch(self, section: dict) -> int:
        # Each optimizer step trains on its own 1/U of a sampled batch (`updates_per_batch`).
        return self.sampled(section) // section["updates_per_batch"]

    def split(self, section: dict) -> int:
        """What a sharded run's processes each take an equal part of: a sampled batch's problems (each
        samples its part) and an optimizer step's samples (each trains on its part)."""
        return math.gcd(section["batch_size"], self.batch(section))

    def counts(self, section: dict) -> tuple[int, int]:
        """(samples drawn, samples trained on, counting each pass) over a run: a sampled batch serves
        `updates_per_batch` x `epochs_per_batch` optimizer steps, each on 1/U of it."""
        reuse = section["updates_per_batch"] * section["epochs_per_batch"]
        return -(-section["steps"] // reuse) * self.sampled(section), section["steps"] * self.batch(section)

    def reuse_problems(self, section: dict) -> list[str]:
        """The reuse keys at least 1, and U dividing a sampled batch."""
        problems = at_least(section, updates_per_batch=1, epochs_per_batch=1)
        if not problems and self.sampled(section) % section["updates_per_batch"]:
            return [
                f"updates_per_batch: {section['updates_per_batch']} does not divide the "
                f"{self.sampled(section)} samples of a sampled batch"
            ]
        return problems

    def keeps_teacher(self, keys: dict[str, str]) -> bool:
        """Whether a continual stage of this run writes a teacher the next stage carries on with."""
        return False

    def flops(self, section: dict, params: float, prompt: int, demonstration: int) -> tuple[float, float]:
        """(decoding FLOPs, whole-sequence FLOPs) of one run of `params` parameters, prompts of `prompt`
        tokens and the setting's demonstrations (an SFT answer) of `demonstration` tokens."""
        raise NotImplementedError

    def check(self, section: dict) -> list[str]:
        # The batch is only whole once U divides a sampled batch.
        return self._kept(section) + (self.reuse_problems(section) or super().check(section))

    def _kept(self, section: dict) -> list[str]:
        """A section's `checkpoints` within its `steps`, or a run's `save_steps` within 1..steps."""
        steps = section["steps"]
        if "save_steps" in section:
            late = [s for s in section["save_steps"] if not 1 <= s <= steps]
            return [f"save_steps: {late} outside 1..steps = {steps}"] if late else []
        fits = section["checkpoints"] <= steps
        return [] if fits else [f"checkpoints: exceeds {self.section}.steps = {steps}"]


def positive(section: dict, *fields: str) -> list[str]:
    """Fields that must be > 0 (every value of a sweep axis)."""
    bad = [f for f in fields if not all(_number(v) > 0 for v in listed(section[f]))]
    return [f"{f}: must be > 0, got {section[f]}" for f in bad]


def at_least(section: dict, **least: int) -> list[str]:
    return [f"{f}: must be >= {n}, got {section[f]}" for f, n in least.items() if not section[f] >= n]


def within_unit(section: dict, field: str) -> list[str]:
    """A field (or each value of a sweep axis) in [0, 1]."""
    wide = [v for v in listed(section[field]) if not 0 <= _number(v) <= 1]
    return [f"{field}: {wide} outside [0, 1]"] if wide else []


def _number(value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan
