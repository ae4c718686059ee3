"""A run that diverges stops: the first optimizer step whose loss or gradient is not finite ends every trainer
(SFT, GRPO, the Pedagogical RL teacher, OPSD, SDPO) with one line naming the step, and the optimizer never
applies a non-finite gradient. Every trainer publishes its output at once when training ends, so nothing is
written; a resume state saved before that step is kept, and a rerun of the same configuration diverges there
again (tests/test_diverge.py).

(Not `graftlab.train.divergence`, the D_alpha loss of OPSD and SDPO.)
"""

from __future__ import annotations

import math

from graftlab.errors import GraftlabError


def diverged(what: str, step: int, said: str) -> GraftlabError:
    return GraftlabError(
        f"{what} diverged at step {step}: {said}; no output written. Lower the learning rate or check the data"
    )


def refuse_diverged(what: str, step: int, loss: float | None, grad_norm: float | None) -> None:
    """Refuse optimizer step `step` of `what` (e.g. `SFT`) when its loss or its gradient's global norm before
    clipping is not finite; None: not known."""
    if all(v is None or math.isfinite(v) for v in (loss, grad_norm)):
        return
    said = [f"loss {loss:.4g}"] if loss is not None else []
    said += [f"gradient norm {grad_norm:.4g} (before clipping)"] if grad_norm is not None else []
    raise diverged(what, step, ", ".join(said))


def trainer_callback(what: str):
    """A TrainerCallback refusing the first diverged step of a Transformers Trainer's run of `what`."""
    import torch
    from transformers import TrainerCallback

    class RefuseDiverged(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            # The Trainer's norm before clipping reaches callbacks only in the step's log, after the optimizer
            # step. Its clipping (at infinity when max_grad_norm is 0) multiplies every gradient by NaN when that
            # norm is not finite, so the gradient about to be applied shows it. One pass over the gradients.
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            norm = torch.nn.utils.get_total_norm(grads)
            if not math.isfinite(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)):
                raise diverged(what, state.global_step + 1, "gradient norm not finite (before clipping)")

        def on_log(self, args, state, control, logs=None, **kwargs):
            # What the gradient cannot show: a norm overflowing to inf over finite gradients (clipped to zero)
            # and a non-finite loss. Logged every step (`trl_args`), before the Trainer saves the step.
            if logs and "loss" in logs:
                refuse_diverged(what, state.global_step, logs["loss"], logs.get("grad_norm"))

    return RefuseDiverged()
