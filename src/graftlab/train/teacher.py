"""SDPO's teacher schedules applied (docs/methods.md#sdpo): how the teacher, a second copy of the student's
network, follows the student during a run. A schedule is parsed once, when a run's config is made
(`graftlab.methods.sdpo.parse_schedule`, which says what each one means), and applied here as a value.

Every parameter and floating buffer is updated (a buffer such as rotary frequencies is the same in both).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from graftlab.errors import GraftlabError

if TYPE_CHECKING:
    import torch

    from graftlab.methods.sdpo import Schedule


def refresh_interval(rate: float, total_steps: int) -> int:
    """Steps between refreshes of `refresh:G` in a run of `total_steps`."""
    return max(1, round(rate * total_steps))


def update_teacher(
    teacher: torch.nn.Module, student: torch.nn.Module, s: Schedule, steps: range, total_steps: int
) -> bool:
    """Update `teacher` in place once a sampled batch's optimizer `steps` (1-based, of `total_steps`) are
    done, under the schedule `s`, as the official SDPO code does after each rollout batch's mini-batches
    (verl's `_update_teacher` after `update_policy`); True when its weights changed. An EMA blends once
    a batch; a refresh blends (gamma 1: copies) when one of the batch's steps is a refresh step."""
    if not steps or not 1 <= steps[0] <= steps[-1] <= total_steps:
        raise GraftlabError(f"update_teacher: steps {list(steps)} outside 1..{total_steps}")
    if s.kind == "frozen":
        return False
    if s.kind == "refresh":
        every = refresh_interval(s.rate, total_steps)
        if not any(step % every == 0 and step < total_steps for step in steps):
            return False
        _blend(teacher, student, s.gamma)
        return True
    _blend(teacher, student, s.rate)
    return True


def _blend(teacher: torch.nn.Module, student: torch.nn.Module, rate: float) -> None:
    """teacher <- (1 - rate) teacher + rate student, tensor by tensor; rate 1 copies the student."""
    import torch

    with torch.no_grad():
        _blend_tensors(teacher, student, rate)


def _blend_tensors(teacher: torch.nn.Module, student: torch.nn.Module, rate: float) -> None:
    t_state, s_state = _floating(teacher), _floating(student)
    if t_state.keys() != s_state.keys():
        extra = sorted(t_state.keys() ^ s_state.keys())[:3]
        raise GraftlabError(f"update_teacher: teacher and student differ in tensors, e.g. {extra}")
    for name, t in t_state.items():
        s = s_state[name]
        if t.shape != s.shape:
            raise GraftlabError(
                f"update_teacher: {name} is {tuple(t.shape)} in the teacher, {tuple(s.shape)} in the student"
            )
        if rate == 1.0:
            t.copy_(s)
        else:
            # lerp_: t + rate (s - t), one fused pass; in the teacher's dtype (fp32 master weights here).
            t.lerp_(s.to(device=t.device, dtype=t.dtype), rate)


def _floating(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    # state_dict(keep_vars) shares storage with the module: writing into it updates the module. Tied
    # weights appear under each name and are blended once per name, which for the same tensor twice
    # would blend twice: keep the first name of each storage.
    # A sharded module's (graftlab.train.shard) are its own shards: teacher and student are sharded alike.
    seen, out = set(), {}
    for name, t in module.state_dict(keep_vars=True).items():
        t = t.to_local() if hasattr(t, "to_local") else t
        if t.is_floating_point() and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            out[name] = t.data
    return out
