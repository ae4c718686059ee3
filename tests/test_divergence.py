"""graftlab.train.divergence against closed forms computed here in float64 from probabilities, with
explicit sums over the vocabulary (never by calling the code under test)."""

from __future__ import annotations

import math

import pytest
import torch

from graftlab.errors import GraftlabError
from graftlab.train.divergence import generalized_divergence, token_divergence

ALPHAS = (0.0, 0.3, 0.5, 1.0)
B, T, V = 2, 5, 7


def _logits(seed: int, scale: float = 2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, V, generator=g) * scale


def _mask() -> torch.Tensor:
    return torch.tensor([[1, 1, 0, 1, 0], [0, 1, 1, 1, 1]])


# ---- the closed forms: plain Python floats, one position at a time ----------------------------------


def _softmax(xs: list[float]) -> list[float]:
    top = max(xs)
    es = [math.exp(x - top) for x in xs]
    z = sum(es)
    return [e / z for e in es]


def _kl(p: list[float], q: list[float]) -> float:
    return sum(pi * math.log(pi / qi) for pi, qi in zip(p, q) if pi > 0)


def _d(t: list[float], s: list[float], alpha: float) -> float:
    if alpha == 0:
        return _kl(t, s)
    if alpha == 1:
        return _kl(s, t)
    m = [alpha * ti + (1 - alpha) * si for ti, si in zip(t, s)]
    return alpha * _kl(t, m) + (1 - alpha) * _kl(s, m)


def _top_ids(xs: list[float], k: int) -> list[int]:
    return sorted(range(len(xs)), key=lambda i: -xs[i])[:k]


def _ref_position(s: list[float], t: list[float], alpha: float, support: str, k: int | None) -> float:
    if support == "full":
        return _d(_softmax(t), _softmax(s), alpha)
    if support == "teacher_topk":
        ids = _top_ids(t, k)
        return _d(_softmax([t[i] for i in ids]), _softmax([s[i] for i in ids]), alpha)
    ids = _top_ids(s, k)
    rest = [i for i in range(len(s)) if i not in ids]
    pt, ps = _softmax(t), _softmax(s)
    # The tail as an explicit sum over the complement: exact even when the top-k hold nearly all the mass.
    t_outcomes = [pt[i] for i in ids] + [sum(pt[i] for i in rest)]
    s_outcomes = [ps[i] for i in ids] + [sum(ps[i] for i in rest)]
    return _d(t_outcomes, s_outcomes, alpha)


def _ref_tokens(s, t, alpha, support="full", k=None, temperature=1.0) -> torch.Tensor:
    s64 = (s.double() / temperature).tolist()
    t64 = (t.double() / temperature).tolist()
    rows = [
        [_ref_position(s_row, t_row, alpha, support, k) for s_row, t_row in zip(s_seq, t_seq)]
        for s_seq, t_seq in zip(s64, t64)
    ]
    return torch.tensor(rows, dtype=torch.float64)


def _ref_loss(s, t, mask, alpha, support="full", k=None, temperature=1.0) -> float:
    d = _ref_tokens(s, t, alpha, support, k, temperature)
    positions = [(b, j) for b in range(mask.shape[0]) for j in range(mask.shape[1]) if mask[b, j]]
    return sum(d[b, j].item() for b, j in positions) / len(positions)


# ---- values ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("alpha", ALPHAS)
def test_full_support_matches_closed_form(alpha):
    s, t, mask = _logits(0), _logits(1), _mask()
    loss = generalized_divergence(s, t, mask, alpha)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert loss.item() == pytest.approx(_ref_loss(s, t, mask, alpha), rel=1e-5, abs=1e-6)
    got = token_divergence(s, t, alpha).double()
    torch.testing.assert_close(got, _ref_tokens(s, t, alpha), rtol=1e-5, atol=1e-6)


def test_masked_positions_do_not_count_even_when_non_finite():
    s, t, mask = _logits(0), _logits(1), _mask()
    s_pad = s.clone()
    s_pad[0, 2] = float("nan")  # a padding position (mask 0) with garbage logits
    loss = generalized_divergence(s_pad, t, mask, 0.5)
    assert loss.item() == pytest.approx(_ref_loss(s, t, mask, 0.5), rel=1e-5)


def test_temperature_divides_the_logits():
    s, t, mask = _logits(0), _logits(1), _mask()
    loss = generalized_divergence(s, t, mask, 0.3, temperature=2.5)
    assert loss.item() == pytest.approx(_ref_loss(s, t, mask, 0.3, temperature=2.5), rel=1e-5)


@pytest.mark.parametrize("support", ["teacher_topk", "student_topk_tail"])
@pytest.mark.parametrize("alpha", ALPHAS)
def test_topk_with_k_vocab_equals_full(support, alpha):
    s, t = _logits(2), _logits(3)
    torch.testing.assert_close(
        token_divergence(s, t, alpha, support, k=V), token_divergence(s, t, alpha), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("alpha", ALPHAS)
@pytest.mark.parametrize("k", [1, 3])
def test_teacher_topk_matches_renormalised_restriction(alpha, k):
    s, t, mask = _logits(4), _logits(5), _mask()
    got = token_divergence(s, t, alpha, "teacher_topk", k).double()
    torch.testing.assert_close(got, _ref_tokens(s, t, alpha, "teacher_topk", k), rtol=1e-5, atol=1e-6)
    loss = generalized_divergence(s, t, mask, alpha, "teacher_topk", k)
    assert loss.item() == pytest.approx(_ref_loss(s, t, mask, alpha, "teacher_topk", k), rel=1e-5, abs=1e-6)
    if k == 1:  # one outcome renormalised is certain for both: nothing to learn
        assert torch.allclose(got, torch.zeros_like(got), atol=1e-7)


@pytest.mark.parametrize("alpha", ALPHAS)
@pytest.mark.parametrize("k", [1, 3])
def test_student_topk_tail_matches_k_plus_one_outcomes(alpha, k):
    s, t, mask = _logits(6), _logits(7), _mask()
    got = token_divergence(s, t, alpha, "student_topk_tail", k).double()
    torch.testing.assert_close(got, _ref_tokens(s, t, alpha, "student_topk_tail", k), rtol=1e-5, atol=1e-6)
    loss = generalized_divergence(s, t, mask, alpha, "student_topk_tail", k)
    ref = _ref_loss(s, t, mask, alpha, "student_topk_tail", k)
    assert loss.item() == pytest.approx(ref, rel=1e-5, abs=1e-6)


def test_tail_is_accurate_when_the_top_k_hold_nearly_all_the_mass():
    # Student top-1 mass 1 - 3e-13: in float32, 1 - sum(top-k) is exactly 0 and the tail would hit the
    # floor; the complement logsumexp keeps it. KL(T||S) is dominated by T's tail (3/4) against S's.
    s = torch.tensor([[[30.0, 0.0, 0.0, 0.0]]])
    t = torch.zeros(1, 1, 4)
    got = token_divergence(s, t, 0.0, "student_topk_tail", 1)
    assert got.item() == pytest.approx(_ref_tokens(s, t, 0.0, "student_topk_tail", 1).item(), rel=1e-5)


# ---- properties --------------------------------------------------------------------------------------


@pytest.mark.parametrize("support,k", [("full", None), ("teacher_topk", 3), ("student_topk_tail", 3)])
@pytest.mark.parametrize("alpha", ALPHAS)
def test_nonnegative_and_zero_for_identical_distributions(support, k, alpha):
    s, t = _logits(8, scale=4.0), _logits(9, scale=4.0)
    assert (token_divergence(s, t, alpha, support, k) >= -1e-6).all()
    same = token_divergence(s, s.clone(), alpha, support, k)
    torch.testing.assert_close(same, torch.zeros_like(same), rtol=0, atol=1e-6)


def test_alpha_half_is_symmetric_on_the_full_support():
    s, t = _logits(10), _logits(11)
    torch.testing.assert_close(token_divergence(s, t, 0.5), token_divergence(t, s, 0.5), rtol=1e-6, atol=1e-7)
    # ... and alpha <-> 1 - alpha swaps the roles in general.
    torch.testing.assert_close(token_divergence(s, t, 0.3), token_divergence(t, s, 0.7), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(token_divergence(s, t, 0.0), token_divergence(t, s, 1.0), rtol=1e-6, atol=1e-7)


def test_bf16_logits_are_computed_in_float32():
    s, t, mask = _logits(0), _logits(1), _mask()
    loss = generalized_divergence(s.bfloat16(), t.bfloat16(), mask, 0.5)
    assert loss.dtype == torch.float32
    ref = _ref_loss(s.bfloat16().float(), t.bfloat16().float(), mask, 0.5)
    assert loss.item() == pytest.approx(ref, rel=1e-5)


# ---- gradients ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("support,k", [("full", None), ("teacher_topk", 3), ("student_topk_tail", 3)])
@pytest.mark.parametrize("alpha", ALPHAS)
def test_gradients_reach_only_the_student(support, k, alpha):
    s = _logits(12).requires_grad_()
    t = _logits(13).requires_grad_()
    generalized_divergence(s, t, _mask(), alpha, support, k).backward()
    assert t.grad is None
    assert s.grad is not None and torch.isfinite(s.grad).all() and s.grad.abs().sum() > 0
    assert (s.grad[_mask() == 0] == 0).all()  # masked positions get no gradient


@pytest.mark.parametrize("alpha", ALPHAS)
def test_tail_support_with_empty_tail_has_the_full_gradients(alpha):
    # k = vocab: the tail mass is 0 for both, log 0 must neither give NaN values nor NaN gradients.
    grads = []
    for support, k in (("full", None), ("student_topk_tail", V)):
        s = _logits(14).requires_grad_()
        loss = generalized_divergence(s, _logits(15), _mask(), alpha, support, k)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(s.grad).all()
        grads.append(s.grad)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-7)


def test_gradient_of_forward_kl_is_student_minus_teacher_probs():
    # d KL(T||S) / d student logits = S - T per position; masked mean divides by the response count.
    s = _logits(16).requires_grad_()
    t = _logits(17)
    mask = _mask()
    generalized_divergence(s, t, mask, 0.0).backward()
    diff = torch.softmax(s.detach().double(), -1) - torch.softmax(t.double(), -1)
    expected = diff * mask[..., None] / mask.sum()
    torch.testing.assert_close(s.grad.double(), expected, rtol=1e-5, atol=1e-7)


def test_non_finite_teacher_logits_stay_finite():
    # A teacher that bans a token (-inf logit) has T = 0 there: 0 * log 0 terms must be 0, not NaN.
    s = _logits(18).requires_grad_()
    t = _logits(19)
    t[..., 0] = float("-inf")
    for alpha in ALPHAS:
        for support, k in (("full", None), ("student_topk_tail", 3)):
            loss = generalized_divergence(s, t, _mask(), alpha, support, k)
            (grad,) = torch.autograd.grad(loss, s)
            assert torch.isfinite(loss) and torch.isfinite(grad).all(), (alpha, support)


# ---- bad input ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"alpha": -0.1}, "alpha"),
        ({"alpha": 1.5}, "alpha"),
        ({"alpha": float("nan")}, "alpha"),
        ({"alpha": "0.5"}, "alpha"),
        ({"alpha": 0.5, "support": "student_topk"}, "unknown support 'student_topk'"),
        ({"alpha": 0.5, "support": "teacher_topk"}, "needs k"),
        ({"alpha": 0.5, "support": "student_topk_tail"}, "needs k"),
        ({"alpha": 0.5, "support": "teacher_topk", "k": 0}, "k must be an integer in \\[1, vocab = 7\\]"),
        ({"alpha": 0.5, "support": "student_topk_tail", "k": V + 1}, "k must be"),
        ({"alpha": 0.5, "support": "teacher_topk", "k": 2.0}, "k must be"),
        ({"alpha": 0.5, "temperature": 0.0}, "temperature"),
        ({"alpha": 0.5, "temperature": float("inf")}, "temperature"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    with pytest.raises(GraftlabError, match=match):
        generalized_divergence(_logits(0), _logits(1), _mask(), **kwargs)


def test_shape_mismatches_and_empty_mask_raise():
    s, t, mask = _logits(0), _logits(1), _mask()
    with pytest.raises(GraftlabError, match="student logits .* teacher logits"):
        generalized_divergence(s, t[..., :-1], mask, 0.5)
    with pytest.raises(GraftlabError, match="student logits .* teacher logits"):
        generalized_divergence(s[0], t[0], mask[0], 0.5)
    with pytest.raises(GraftlabError, match="mask shape"):
        generalized_divergence(s, t, mask[:, :-1], 0.5)
    with pytest.raises(GraftlabError, match="all zero"):
        generalized_divergence(s, t, torch.zeros_like(mask), 0.5)
