"""Teacher schedules (graftlab.train.teacher.update_teacher) against hand computations."""

import pytest
import torch

from graftlab.errors import GraftlabError
from graftlab.methods.sdpo import parse_schedule
from graftlab.train.teacher import update_teacher


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
    assert update_teacher(teacher, student, parse_schedule("ema:0.25"), 1, 10)
    for name, value in teacher.state_dict().items():
        if value.is_floating_point():
            torch.testing.assert_close(value, 0.75 * t0[name] + 0.25 * s[name], rtol=0, atol=1e-14)
    # Twice: (1-R)^2 t0 + (1 - (1-R)^2) s when the student stands still.
    update_teacher(teacher, student, parse_schedule("ema:0.25"), 2, 10)
    w = "0.weight"
    torch.testing.assert_close(teacher.state_dict()[w], 0.5625 * t0[w] + 0.4375 * s[w], rtol=0, atol=1e-14)
    assert teacher.state_dict()["steps"].item() == 0  # integer buffers are not blended


def test_ema_one_copies_the_student():
    teacher, student = pair()
    update_teacher(teacher, student, parse_schedule("ema:1"), 3, 10)
    for a, b in zip(teacher.parameters(), student.parameters()):
        assert torch.equal(a, b)


def test_frozen_never_changes():
    teacher, student = pair()
    t0 = flat(teacher)
    assert not any(update_teacher(teacher, student, parse_schedule("frozen"), step, 5) for step in range(1, 6))
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
        if update_teacher(teacher, student, parse_schedule(schedule), step, total):
            changed.append(step)
            assert all(torch.equal(a, b) for a, b in zip(teacher.parameters(), student.parameters()))
        else:
            assert all(torch.equal(teacher.state_dict()[k], v) for k, v in before.items())
    assert changed == refreshed


@pytest.mark.parametrize("bad", ["ema", "ema:0", "ema:1.5", "refresh:-0.1", "refresh:x", "frozen:1", "EMA:0.1", ""])
def test_bad_schedules_are_clear_errors(bad):
    with pytest.raises(GraftlabError, match="teacher schedule"):
        parse_schedule(bad)


def test_step_outside_the_run_is_an_error():
    teacher, student = pair()
    with pytest.raises(GraftlabError, match="step 11 outside 1..10"):
        update_teacher(teacher, student, parse_schedule("ema:0.1"), 11, 10)


def test_parse_schedule():
    assert parse_schedule("ema:0.05") == ("ema", 0.05)
    assert parse_schedule("refresh:1") == ("refresh", 1.0)
    assert parse_schedule("frozen") == ("frozen", None)
