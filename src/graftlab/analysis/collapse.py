"""Collapse of a method's chain of staged models (issue 17): the point where a model stops being a model of
the task and becomes a loop, a coin or a copy of its teacher. Four signals, each a rule with thresholds
(module constants, each with why):

    repeated_tail       most of a stage model's evaluated responses end in one short unit repeated back
                        to back (`\\boxed\\boxed\\boxed...`, `ababab...` to the token budget):
                        `graftlab.train.curves.repeated_tail`, the detector the trainers log per step
    accuracy_collapse   own-domain accuracy (each stage's model on its own stage's benchmark) falls to
                        about zero after the chain had learned a domain well
    entropy_spike       the student's token entropy in a training log jumps far above its running median
                        (the policy's distribution blowing up into noise)
    js_zero             teacher–student JS in a training log falls to about zero and stays there after
                        having been clearly positive: the teacher no longer teaches (an EMA teacher that
                        caught up with a collapsed student, or a student copying the teacher's context)

`detect` reads a chain's evaluated models (their metrics.json and per-sample records) and training logs
(steps.jsonl, absent for methods without one: sft, grafts) and says whether, where and why it collapsed.

Light at import: polars and the standard library only.
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import polars as pl

from graftlab.train.curves import repeated_tail

# A stage model collapsed when more than half its responses loop: a healthy policy's truncated or
# stuttering samples are a few percent (the trainers log the rate per step); past half, the loop is
# what the model does, not an accident of sampling.
REPEATED_SHARE = 0.5
# Own-domain accuracy at or under 5% after having reached 20%: a chain that learned a domain to 20% and
# then solves (almost) nothing of the next is no longer learning. 5% leaves room for the few problems a
# broken model still guesses; 20% makes sure the earlier peak was learning, not the noise of a domain
# the starting model never solved (acc 0.0, 0.0, 0.01 never fires).
ACC_FLOOR = 0.05
ACC_PEAK = 0.2
# Entropy spike: above 3x the median of the earlier steps, and above 1 nat. A sampling policy's token
# entropy moves by tens of percent from step to step, never threefold; the absolute floor keeps a peaked
# policy (median 0.02 nats) from firing on a wobble to 0.07. At least 3 earlier steps make the median.
ENTROPY_FACTOR = 3.0
ENTROPY_FLOOR = 1.0
ENTROPY_WARMUP = 3
# JS (nats per distilled token, at most ln 2) under 1e-4 for 3 logged steps in a row, after having been at
# least 1e-3 (ten times the epsilon) earlier. A teacher that differs from its student only by its context
# still moves answer tokens by far more than 1e-4 nats; 1e-4 is float rounding of two equal models. The
# run of 3 keeps one all-masked or lucky batch from firing, and "clearly positive" before keeps a run that
# starts at zero (nothing to distil) from being called a collapse.
JS_EPS = 1e-4
JS_POSITIVE = 1e-3
JS_RUN = 3

REASONS = ("entropy_spike", "js_zero", "repeated_tail", "accuracy_collapse")
RESULT_KEYS = ("collapsed", "collapse_reason", "collapse_stage", "collapse_step", "repeated_share")


def repeated_share(completions: Iterable[str | None]) -> float:
    """The share of `completions` whose tail is one short unit repeated (`curves.repeated_tail`); 0 for
    none. A null completion counts as a response that does not loop."""
    texts = list(completions)
    return sum(repeated_tail(t or "") for t in texts) / len(texts) if texts else 0.0


def records_repeated_share(eval_dir: str | Path, benchmarks: Sequence[str]) -> float:
    """`repeated_share` of an evaluated model's responses (`eval_dir/{benchmark}.parquet`, the per-sample
    records of `graftlab.evaluate.run`), pooled over `benchmarks`."""
    completions: list[str | None] = []
    for bench in benchmarks:
        path = Path(eval_dir) / f"{bench}.parquet"
        if not path.is_file():
            raise FileNotFoundError(f"collapse: no records of benchmark {bench!r} at {path}")
        completions += pl.read_parquet(path, columns=["completion"])["completion"].to_list()
    return repeated_share(completions)


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def accuracy_collapse(accs: Sequence[float | None], floor: float = ACC_FLOOR, peak: float = ACC_PEAK) -> int | None:
    """The first index whose accuracy is ≤ `floor` after an earlier one was ≥ `peak`; None if there is
    none. Missing accuracies (None, NaN) are skipped."""
    reached = False
    for i, acc in enumerate(accs):
        if not _number(acc):
            continue
        if reached and acc <= floor:
            return i
        reached = reached or acc >= peak
    return None


def read_steps(path: str | Path) -> list[dict]:
    """A training log, steps.jsonl: one dict per non-blank line."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def _series(steps: list[dict], key: str) -> list[tuple[int, float]]:
    """(step, value) for each logged step holding a finite number under `key`; the step is the record's
    `step`, else its position in the log."""
    return [(r.get("step", i), float(r[key])) for i, r in enumerate(steps) if _number(r.get(key))]


def entropy_spike(
    steps: list[dict], factor: float = ENTROPY_FACTOR, floor: float = ENTROPY_FLOOR, warmup: int = ENTROPY_WARMUP
) -> int | None:
    """The first step whose `entropy` exceeds both `factor` times the median of the earlier steps' (at
    least `warmup` of them) and `floor`; None if none does or the log has no entropy."""
    earlier: list[float] = []
    for step, value in _series(steps, "entropy"):
        if len(earlier) >= warmup:
            n = len(earlier)
            median = earlier[n // 2] if n % 2 else (earlier[n // 2 - 1] + earlier[n // 2]) / 2
            if value > factor * median and value > floor:
                return step
        bisect.insort(earlier, value)
    return None


def js_zero(steps: list[dict], eps: float = JS_EPS, positive: float = JS_POSITIVE, run: int = JS_RUN) -> int | None:
    """The first step of the first `run` logged steps in a row whose `js` is under `eps`, after an earlier
    step's was at least `positive`; None if there is none or the log has no `js` values (steps whose `js`
    is null, all masked, are passed over)."""
    reached, start, length = False, None, 0
    for step, value in _series(steps, "js"):
        if reached and value < eps:
            start, length = (step, 1) if length == 0 else (start, length + 1)
            if length >= run:
                return start
        else:
            length = 0
        reached = reached or value >= positive
    return None


def log_collapse(
    steps: list[dict] | pl.DataFrame,
    entropy_factor: float = ENTROPY_FACTOR,
    entropy_floor: float = ENTROPY_FLOOR,
    entropy_warmup: int = ENTROPY_WARMUP,
    js_eps: float = JS_EPS,
    js_positive: float = JS_POSITIVE,
    js_run: int = JS_RUN,
) -> tuple[str, int] | None:
    """(reason, step) of the first collapse a training log shows, `entropy_spike` or `js_zero` (the earlier
    step; the spike on a tie), or None. Either rule needs its column: an SFT log of seconds never fires."""
    if isinstance(steps, pl.DataFrame):
        steps = steps.to_dicts()
    found = [
        (step, reason)
        for reason, step in (
            ("entropy_spike", entropy_spike(steps, entropy_factor, entropy_floor, entropy_warmup)),
            ("js_zero", js_zero(steps, js_eps, js_positive, js_run)),
        )
        if step is not None
    ]
    if not found:
        return None
    step, reason = min(found, key=lambda f: f[0])
    return reason, step


def _own_accuracy(eval_dir: str | Path, bench: str) -> float:
    metrics = json.loads((Path(eval_dir) / "metrics.json").read_text())
    scores = metrics.get("benchmarks", {}).get(bench)
    if scores is None:
        raise ValueError(f"collapse: {eval_dir} is not scored on its stage's own benchmark {bench!r}")
    return scores["acc@n"]


def domain_collapse(
    eval_dirs: Sequence[str | Path], own_benchmarks: Sequence[str], floor: float = ACC_FLOOR, peak: float = ACC_PEAK
) -> int | None:
    """The first index i at which the domain of some stage j <= i, once at `peak` or above in a model j..i-1,
    has fallen to `floor` or below in model i: a capability learnt and then lost (each domain followed
    from its own stage on, so a later domain that was never learnt does not count)."""
    found = [
        j + hit
        for j, bench in enumerate(own_benchmarks)
        if (hit := accuracy_collapse([_own_accuracy(d, bench) for d in eval_dirs[j:]], floor, peak)) is not None
    ]
    return min(found, default=None)


def detect_stages(
    eval_dirs: Sequence[str | Path],
    own_benchmarks: Sequence[str],
    logs: Sequence[str | Path | None] | None = None,
    *,
    stages: Sequence[int] | None = None,
    repeated_threshold: float = REPEATED_SHARE,
    floor: float = ACC_FLOOR,
    peak: float = ACC_PEAK,
    log_thresholds: Mapping[str, float] | None = None,
) -> list[dict]:
    """One record per stage model of a method's chain: `stage`, then `RESULT_KEYS`. `repeated_share` is
    the model's own (on its own-domain benchmark); the collapse fields name the chain's first collapse up
    to and including this stage, so once a chain collapses every later model is marked too (they descend
    from the collapsed one).

    `eval_dirs[i]`: the evaluation of stage i's model (metrics.json and its records); `own_benchmarks[i]`:
    the benchmark of that stage's domain; `logs[i]`: its training log (steps.jsonl) or None where the
    method keeps none (sft, grafts), `logs` None for all; `stages`: the stage numbers, 1..K unless given.
    Within a stage the log's rules come first (training precedes evaluation), then `repeated_tail`
    (share above `repeated_threshold`), then `accuracy_collapse` of any domain learnt so far
    (`domain_collapse`: `floor`, `peak`). `log_thresholds`:
    keyword arguments of `log_collapse`."""
    k = len(eval_dirs)
    logs = [None] * k if logs is None else list(logs)
    stages = list(range(1, k + 1)) if stages is None else list(stages)
    if not len(own_benchmarks) == len(logs) == len(stages) == k:
        raise ValueError(
            f"collapse: {k} eval dirs, {len(own_benchmarks)} own benchmarks, {len(logs)} logs, {len(stages)} stages"
        )
    fallen = domain_collapse(eval_dirs, own_benchmarks, floor, peak)
    first: dict = {"collapsed": False, "collapse_reason": None, "collapse_stage": None, "collapse_step": None}
    records = []
    for i, (eval_dir, bench, log, stage) in enumerate(zip(eval_dirs, own_benchmarks, logs, stages)):
        share = records_repeated_share(eval_dir, [bench])
        if not first["collapsed"]:
            found = log_collapse(read_steps(log), **(log_thresholds or {})) if log is not None else None
            if found is None and share > repeated_threshold:
                found = ("repeated_tail", None)
            if found is None and fallen == i:
                found = ("accuracy_collapse", None)
            if found is not None:
                first = {"collapsed": True, "collapse_reason": found[0], "collapse_stage": stage}
                first["collapse_step"] = found[1]
        records.append({"stage": stage, **first, "repeated_share": share})
    return records


def detect(
    eval_dirs: Sequence[str | Path],
    own_benchmarks: Sequence[str],
    logs: Sequence[str | Path | None] | None = None,
    *,
    stages: Sequence[int] | None = None,
    repeated_threshold: float = REPEATED_SHARE,
    floor: float = ACC_FLOOR,
    peak: float = ACC_PEAK,
    log_thresholds: Mapping[str, float] | None = None,
) -> dict:
    """Whether a method's chain collapsed (arguments as `detect_stages`): `RESULT_KEYS`, the collapse
    fields of its first collapse (None where it never did; `collapse_step` only for a training log's rule)
    and `repeated_share` the largest of its stage models' (so a share above the threshold is always a
    collapsed chain)."""
    records = detect_stages(
        eval_dirs,
        own_benchmarks,
        logs,
        stages=stages,
        repeated_threshold=repeated_threshold,
        floor=floor,
        peak=peak,
        log_thresholds=log_thresholds,
    )
    if not records:
        raise ValueError("collapse: a chain of no stages")
    return {k: records[-1][k] for k in RESULT_KEYS[:-1]} | {"repeated_share": max(r["repeated_share"] for r in records)}
