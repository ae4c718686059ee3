"""The RL step-log helpers: degenerate repeated tails, the student's token entropy, the training plot."""

import math

import pytest
import torch

from graftlab.train.curves import mean_entropy, plot_training, repeated_rate, repeated_tail


@pytest.mark.parametrize(
    "text",
    [
        "\\boxed\\boxed\\boxed\\boxed",
        "<think>\n2*3=6\n</think>\n\n6666666666666666",
        "the the the the the the ",  # whitespace inside the unit is part of it
        "ab" * 8 + "<|im_end|>",
        "x" * 40 + " \n<|im_end|>\n",  # trailing whitespace and end of turn ignored, in any order
        "=" * 5000,  # a loop to the token budget
    ],
)
def test_a_short_unit_repeated_to_the_end_is_a_repeated_tail(text):
    assert repeated_tail(text)


@pytest.mark.parametrize(
    "text",
    [
        "1000",  # three zeros: a number, not a loop
        "<think>\n12*12=144\n</think>\n\n144<|im_end|>",
        "a" * 15,  # under min_span
        "abcabcabc",  # three repeats, under min_repeats
        "\\boxed\\boxed\\boxed\\boxed and then an answer",  # the loop must be at the end
        "",
        "<|im_end|>",
    ],
)
def test_answers_and_short_runs_are_not_repeated_tails(text):
    assert not repeated_tail(text)


def test_the_floors_are_parameters():
    assert repeated_tail("abcabcabc", min_repeats=3, min_span=9)
    assert not repeated_tail("abcabcabc", min_repeats=3, min_span=10)
    assert not repeated_tail("0123456789" * 4, max_unit=9)
    assert repeated_tail("0123456789" * 4, max_unit=10)


def test_repeated_rate_is_the_share_of_looping_texts():
    assert repeated_rate(["a" * 20, "42", "b" * 30, "7"]) == 0.5
    assert repeated_rate([]) == 0.0


def test_mean_entropy_is_the_masked_mean_in_nats_computed_in_float32():
    uniform = torch.zeros(1, 1, 8)  # entropy log 8
    peaked = torch.tensor([[[100.0] + [0.0] * 7]])  # entropy ~0
    logits = torch.cat([torch.cat([uniform, peaked], 1), torch.cat([peaked, uniform], 1)]).to(torch.bfloat16)
    mask = torch.tensor([[1, 1], [1, 0]])
    assert mean_entropy(logits, mask) == pytest.approx(math.log(8) / 3, abs=1e-6)
    assert mean_entropy(logits, torch.zeros(2, 2)) == 0.0
    # Against torch's Categorical, on random logits and a ragged mask.
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=gen)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    ref = torch.distributions.Categorical(logits=logits).entropy()[mask.bool()].mean().item()
    assert mean_entropy(logits, mask) == pytest.approx(ref, rel=1e-6)


def test_plot_training_draws_the_metrics_present_and_writes_atomically(tmp_path):
    log = [
        {"step": s, "loss": 1.0 / s, "reward": 0.1 * s, "entropy": 2.0, "sample_s": 0.5, "tag": "x", "ok": True}
        for s in range(1, 6)
    ]
    plot_training(log, tmp_path / "training.png")
    assert (tmp_path / "training.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir()] == ["training.png"]  # no temporary left behind
    plot_training([], tmp_path / "empty.png")  # a log without metrics still writes its plot
    assert (tmp_path / "empty.png").exists()
