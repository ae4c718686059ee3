"""Teacher schedules (graftlab.train.teacher.update_teacher) against hand computations."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graftlab.errors import GraftlabError
from graftlab.methods.sdpo import parse_schedule
from graftlab.train.teacher import refresh_interval, update_teacher


def pair(seed: int = 0):
    """A teacher and a student of the same small network (with a tied weight and a buffer), different
    weights."""
    torch.manual_seed(seed)

    def net():
        m = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5))
        m[1].weight = m[0].weight  # tied, as an LM head is to its embedding
        m.register_buffer("steps", torch.tensor(0, dtype=torch.long))
        return m.double()  # float64: the hand computation and lerp then agree to 1e-15

    return net(), net()


def flat(m):
    return {k: v.clone() for k, v in m.state_dict().items()}


def test_ema_is_exact_against_the_formula_and_blends_tied_weights_once():
    teacher, student = pair()
    t0, s = flat(teacher), flat(student)
    assert update_teacher(teacher, student, parse_schedule("ema:0.25"), range(1, 2), 10)
    for name, value in teacher.state_dict().items():
        if value.is_floating_point():
            torch.testing.assert_close(value, 0.75 * t0[name] + 0.25 * s[name], rtol=0, atol=1e-14)
    # Twice: (1-R)^2 t0 + (1 - (1-R)^2) s when the student stands still.
    update_teacher(teacher, student, parse_schedule("ema:0.25"), range(2, 3), 10)
    w = "0.weight"
    torch.testing.assert_close(teacher.state_dict()[w], 0.5625 * t0[w] + 0.4375 * s[w], rtol=0, atol=1e-14)
    assert teacher.state_dict()["steps"].item() == 0  # integer buffers are not blended


def test_ema_one_copies_the_student():
    teacher, student = pair()
    update_teacher(teacher, student, parse_schedule("ema:1"), range(3, 4), 10)
    for a, b in zip(teacher.parameters(), student.parameters()):
        assert torch.equal(a, b)


def test_frozen_never_changes():
    teacher, student = pair()
    t0 = flat(teacher)
    frozen = parse_schedule("frozen")
    assert not any(update_teacher(teacher, student, frozen, range(step, step + 1), 5) for step in range(1, 6))
    assert all(torch.equal(teacher.state_dict()[k], v) for k, v in t0.items())


@pytest.mark.parametrize(
    ("schedule", "total", "refreshed"),
    [
        ("refresh:0.25", 40, [10, 20, 30]),  # every 10 steps, never at the last one
        ("refresh:0.25", 8, [2, 4, 6]),
        ("refresh:0.01", 10, list(range(1, 10))),  # round(0.1) = 0 -> every step (max 1)
        ("refresh:1", 40, []),  # the hard restart: no refresh inside a run
        ("refresh:0.5", 3, [2]),  # round(1.5) = 2
    ],
)
def test_refresh_steps(schedule, total, refreshed):
    teacher, student = pair()
    changed = []
    for step in range(1, total + 1):
        with torch.no_grad():
            student[0].weight.add_(1.0)  # the student moves every step
        before = flat(teacher)
        if update_teacher(teacher, student, parse_schedule(schedule), range(step, step + 1), total):
            changed.append(step)
            assert all(torch.equal(a, b) for a, b in zip(teacher.parameters(), student.parameters()))
        else:
            assert all(torch.equal(teacher.state_dict()[k], v) for k, v in before.items())
    assert changed == refreshed


@pytest.mark.parametrize(
    "bad",
    ["ema", "ema:0", "ema:1.5", "refresh:-0.1", "refresh:x", "frozen:1", "EMA:0.1", "", "ema:0.1:0.5", "refresh:0.1:0"]
    + ["refresh:0.1:1.5", "refresh:0.1:0.5:0.5", "refresh:0.1:x"],
)
def test_bad_schedules_are_clear_errors(bad):
    with pytest.raises(GraftlabError, match="teacher schedule"):
        parse_schedule(bad)


def test_steps_outside_the_run_are_an_error():
    teacher, student = pair()
    for bad in (range(10, 12), range(0, 2), range(3, 3)):
        with pytest.raises(GraftlabError, match="outside 1..10"):
            update_teacher(teacher, student, parse_schedule("ema:0.1"), bad, 10)


@given(
    per_batch=st.integers(1, 6),
    total=st.integers(1, 40),
    schedule=st.sampled_from(["ema:0.3", "refresh:0.25", "refresh:0.1:0.5", "frozen"]),
)
@settings(max_examples=40, deadline=None)
def test_a_batch_updates_the_teacher_once_whatever_its_steps(per_batch, total, schedule):
    """Over a run of `total` steps in batches of `per_batch` (U x E), the teacher changes at most once a
    batch: an EMA exactly once, a refresh once where the batch holds a refresh step below the last."""
    s = parse_schedule(schedule)
    teacher, student = pair()
    for first in range(1, total + 1, per_batch):
        steps = range(first, min(first + per_batch - 1, total) + 1)
        with torch.no_grad():
            student[0].weight.add_(1.0)
        before = flat(teacher)
        changed = update_teacher(teacher, student, s, steps, total)
        w = "0.weight"
        if s.kind == "ema":
            expected = 0.7 * before[w] + 0.3 * student.state_dict()[w]
        elif s.kind == "refresh" and any(k % refresh_interval(s.rate, total) == 0 and k < total for k in steps):
            expected = (1 - s.gamma) * before[w] + s.gamma * student.state_dict()[w]
        else:
            expected = before[w]
        assert changed == (not torch.equal(expected, before[w]))
        torch.testing.assert_close(teacher.state_dict()[w], expected, rtol=0, atol=1e-12)


def test_a_soft_refresh_blends_by_gamma():
    teacher, student = pair()
    t0, s0 = flat(teacher), flat(student)
    assert update_teacher(teacher, student, parse_schedule("refresh:0.5:0.25"), range(1, 3), 4)  # step 2 refreshes
    w = "0.weight"
    torch.testing.assert_close(teacher.state_dict()[w], 0.75 * t0[w] + 0.25 * s0[w], rtol=0, atol=1e-14)


def test_parse_schedule():
    assert parse_schedule("ema:0.05") == ("ema", 0.05, 1.0)
    assert parse_schedule("refresh:1") == ("refresh", 1.0, 1.0)
    assert parse_schedule("refresh:0.2:0.5") == ("refresh", 0.2, 0.5)
    assert parse_schedule("frozen") == ("frozen", None, 1.0)
