"""Step-log helpers shared by the on-policy RL trainers (GRPO, SDPO): what a sampled batch looks like
(degenerate repeated tails, the student's token entropy) and one plot of every metric a run logged.

A collapsing RL run shows first in its samples, not its loss: a policy that learns to stutter
(`\\boxed\\boxed\\boxed...`) until the token budget runs out, or whose entropy falls towards zero. Both
are logged per step beside the loss, so `training.png` shows the collapse when it happens.

Light at import: torch and matplotlib load inside the functions that need them.
"""

from __future__ import annotations

import math
from pathlib import Path

from graftlab.io.atomic import atomic_file

# The metrics `plot_training` draws, in panel order, where a log holds them.
METRICS = (
    "loss",
    "reward",
    "accuracy",
    "masked_share",
    "entropy",
    "js",
    "response_len",
    "repeated_rate",
    "sample_s",
    "update_s",
)
# What a sampled text may end with that is not part of its content: the chat's end-of-turn marker.
END_OF_TURN = "<|im_end|>"


def _content_tail(text: str) -> str:
    """`text` without its trailing whitespace and end-of-turn markers, in any order or number."""
    while True:
        stripped = text.rstrip()
        if stripped.endswith(END_OF_TURN):
            stripped = stripped[: -len(END_OF_TURN)]
        if stripped == text:
            return text
        text = stripped


def repeated_tail(text: str, max_unit: int = 20, min_repeats: int = 4, min_span: int = 16) -> bool:
    """Whether `text` ends in one short unit (1..`max_unit` characters) repeated back to back at least
    `min_repeats` times over at least `min_span` characters: the degenerate loop a sampled policy falls
    into (`\\boxed\\boxed\\boxed\\boxed`). Both floors matter: `1000` ends in three zeros, and an answer
    like `11` or `2222` is a number, not a loop. Trailing whitespace and `<|im_end|>` are ignored."""
    tail = _content_tail(text)
    for unit in range(1, min(max_unit, len(tail) // max(min_repeats, 1)) + 1):
        piece, repeats = tail[-unit:], 1
        # Enough once both floors are met: a long loop need not be walked to its start.
        need = max(min_repeats, math.ceil(min_span / unit))
        while repeats < need and (repeats + 1) * unit <= len(tail):
            if tail[len(tail) - (repeats + 1) * unit : len(tail) - repeats * unit] != piece:
                break
            repeats += 1
        if repeats >= need:
            return True
    return False


def repeated_rate(texts) -> float:
    """The share of `texts` with a repeated tail (`repeated_tail`); 0 for no texts."""
    texts = list(texts)
    return sum(map(repeated_tail, texts)) / len(texts) if texts else 0.0


def mean_entropy(logits, mask) -> float:
    """Mean over the positions where `mask` is non-zero of the softmax entropy of `logits`
    ([batch, positions, vocab]), in nats; 0 where the mask is empty. Computed in float32 whatever the
    logits' dtype (bf16 log-probabilities round the entropy of a peaked distribution to noise), one row
    at a time so a real vocabulary never needs a float32 copy of the whole batch."""
    import torch

    with torch.no_grad():
        total, count = 0.0, 0.0
        for row, keep in zip(logits, mask):
            logp = row.float().log_softmax(-1)
            entropy = -(logp.exp() * logp).sum(-1)
            weight = keep.float()
            total += (entropy * weight).sum().item()
            count += weight.sum().item()
    return total / count if count else 0.0


def _numeric(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def write_step_log(log: list[dict], path, png=None) -> None:
    """`log` (one dict per step) as JSON lines at `path`, and its curves (`plot_training`) at `png`,
    by default `training.png` beside it: every trainer's `steps.jsonl` and the figure drawn from it."""
    import json

    path = Path(path)
    path.write_text("".join(json.dumps(r) + "\n" for r in log))
    plot_training(log, png if png is not None else path.with_name("training.png"))


def plot_training(log: list[dict], png) -> None:
    """Every metric of `METRICS` that `log` (one dict per step, with `step`) holds a number for, against
    step, one small panel each; written as a PNG, atomically. A log without any draws one empty panel
    saying so, so the output exists whatever the run logged."""
    from matplotlib.figure import Figure

    present = [m for m in METRICS if any(_numeric(r.get(m)) for r in log)]
    cols = min(3, max(len(present), 1))
    rows = max(math.ceil(len(present) / cols), 1)
    fig = Figure(figsize=(3.4 * cols, 2.4 * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax, metric in zip(axes, present):
        points = [(r["step"], r[metric]) for r in log if _numeric(r.get(metric)) and "step" in r]
        ax.plot(*zip(*points), marker="." if len(points) < 50 else None, linewidth=1)
        ax.set_title(metric, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
    for ax in axes[len(present) :]:
        ax.axis("off")
    if not present:
        axes[0].text(0.5, 0.5, "no metrics logged", ha="center", va="center")
    with atomic_file(Path(png)) as tmp:
        fig.savefig(tmp, dpi=120, format="png")
