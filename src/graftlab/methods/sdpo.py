"""SDPO's spec (docs/methods.md#sdpo): self-distilled policy optimisation under a teacher schedule, the
second paper's subject, and the one parser of its schedules. Its trainer is `graftlab.train.sdpo`.

A schedule says how the teacher, a second copy of the student's network, follows the student
(`graftlab.train.teacher` applies it):

- `frozen`: the teacher stays the starting model.
- `ema:R`: after every optimizer step, theta_T <- (1 - R) theta_T + R theta_S (the official SDPO's
  `teacher_update_rate`; the second paper sweeps R in 0.005, 0.01, 0.02, 0.05).
- `refresh:G`: StableSDPO's refresh-and-freeze. The teacher starts as the starting model and is set to the
  current student after every step that is a multiple of max(1, round(G x total_steps)) and below
  total_steps, frozen in between. G = 1 never refreshes inside a run: the paper's hard restart, where each
  stage of a continual chain starts with the teacher reset to the current student.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from graftlab.errors import GraftlabError
from graftlab.methods.spec import OnPolicySpec, at_least, holes, positive, within_unit

KINDS = ("frozen", "ema", "refresh")
# SDPO's density, two orthogonal switches of a run: which response tokens carry the loss, and whether a
# sibling's thinking stays in the demonstration. `sdpo` and `sdpo_cot` are named settings of them, read
# from the section's keys below.
TOKENS, THINKING = ("answer", "all"), ("strip", "keep")
DENSITY_KEYS = {False: ("tokens", "thinking"), True: ("cot_tokens", "cot_thinking")}


def run_density(section: dict, cot: bool) -> dict:
    """The `sdpo` section as one run of `sdpo` (or, `cot`, `sdpo_cot`) takes it: its own `tokens` and
    `thinking`, the other method's switches dropped."""
    tokens, thinking = DENSITY_KEYS[cot]
    rest = {k: v for k, v in section.items() if k not in (*DENSITY_KEYS[False], *DENSITY_KEYS[True])}
    return rest | {"tokens": section[tokens], "thinking": section[thinking]}


TEMPLATE_HOLES = {
    "template": ("{prompt}", "{solution}", "{feedback}"),
    "solution_template": ("{solution}",),
    "feedback_template": ("{feedback}",),
}


class Schedule(NamedTuple):
    kind: str
    rate: float | None = None  # R of ema, G of refresh
    gamma: float = 1.0  # a refresh's blend: teacher <- gamma student + (1 - gamma) teacher; 1 copies


def parse_schedule(schedule: str) -> Schedule:
    """`frozen`, `ema:R`, `refresh:G` or `refresh:G:gamma` with R, G and gamma in (0, 1]; anything else is
    an error naming it."""
    kind, sep, value = str(schedule).partition(":")
    if kind == "frozen" and not sep:
        return Schedule("frozen")
    values = value.split(":")
    if kind not in ("ema", "refresh") or not sep or len(values) > (2 if kind == "refresh" else 1):
        raise GraftlabError(f"teacher schedule {schedule!r}: expected frozen, ema:R, refresh:G or refresh:G:gamma")
    numbers = []
    for name, text in zip(("R" if kind == "ema" else "G", "gamma"), values):
        try:
            number = float(text)
        except ValueError:
            raise GraftlabError(f"teacher schedule {schedule!r}: {text!r} is not a number") from None
        if not (0 < number <= 1) or math.isnan(number):
            raise GraftlabError(f"teacher schedule {schedule!r}: {name} must lie in (0, 1]")
        numbers.append(number)
    return Schedule(kind, *numbers)


class SdpoSpec(OnPolicySpec):
    """`sdpo` and `sdpo_cot`, two named densities (`run_density`): one section, `sdpo`, whose `teachers` and
    `cot_teachers` list each one's schedules."""

    section = "sdpo"
    models = 2  # the scheduled teacher beside the student
    keys = ("teacher", "lr")
    shards = resumes_sharded = True

    def __init__(self, teachers: str, cot: bool) -> None:
        self.teachers = teachers  # the section's field listing this method's schedules
        self.cot = cot  # sdpo_cot: its switches are the section's cot_tokens and cot_thinking

    def runs(self, section: dict) -> list[dict[str, str]]:
        return [{"teacher": t, "lr": lr} for t in section[self.teachers] for lr in section["lr"]]

    def keeps_teacher(self, keys: dict[str, str]) -> bool:
        return parse_schedule(keys["teacher"]).kind == "ema"

    def sampled(self, section: dict) -> int:
        return section["batch_size"] * section["generations"]  # rollouts, each step's 1/U of them

    def scorer_bytes(self, section: dict) -> int:
        # A frozen teacher in bf16 on a GPU; a moving one in fp32, as it blends in the student's updates
        # (graftlab.train.onpolicy.load_pair). A section's schedules are sized by its most demanding.
        fields = [f for f in (self.teachers, "teacher") if f in section]
        schedules = [s for f in fields for s in ([section[f]] if isinstance(section[f], str) else section[f])]
        return 2 if all(parse_schedule(s).kind == "frozen" for s in schedules) else 4

    def own(self, section: dict) -> list[str]:
        problems = at_least(section, steps=1, batch_size=1, generations=2, top_k=1)
        # A config section lists each method's schedules; one run's settings hold its own `teacher`.
        schedules = [("teacher", section["teacher"])] if "teacher" in section else []
        schedules += [(f, s) for f in ("teachers", "cot_teachers") if f in section for s in section[f]]
        for field, schedule in schedules:
            problems += _schedule(field, schedule)
        for fields, allowed in ((("tokens", "cot_tokens"), TOKENS), (("thinking", "cot_thinking"), THINKING)):
            problems += [
                f"{f}: must be one of {list(allowed)}, got {section[f]!r}"
                for f in fields
                if f in section and section[f] not in allowed
            ]
        for field, needed in TEMPLATE_HOLES.items():
            if absent := holes(section[field], needed):
                problems.append(f"{field}: lacks the placeholder(s) {absent}")
        return problems + within_unit(section, "alpha") + positive(section, "is_clip", "temperature")

    def flops(self, section: dict, params: float, prompt: int, demonstration: int) -> tuple[float, float]:
        P, o = params, section
        sampled = prompt + o["max_new_tokens"]
        drawn, trained = self.counts(o)
        # Per rollout drawn the student generates it (2P) and, when its batch serves more than one step,
        # scores its sampled log-probs (2P, once); per pass the teacher scores it after a sibling's answer in
        # its prompt (2P) and the student trains on it (6P). An EMA teacher's update is a pass over the
        # weights, negligible beside them.
        old = 2 * P * drawn * sampled if o["updates_per_batch"] * o["epochs_per_batch"] > 1 else 0
        compute = old + trained * (2 * P * (sampled + o["max_new_tokens"]) + 6 * P * sampled)
        return 2 * P * drawn * sampled, compute


def _schedule(field: str, schedule: str) -> list[str]:
    try:
        parse_schedule(schedule)
    except GraftlabError as err:
        return [f"{field}: {err}"]
    return []
