"""The generalized divergence D_alpha between a teacher distribution T and a student distribution S, per
response token: the loss of OPSD and SDPO (docs/methods.md#opsd), one implementation for both.

Per token position, over an outcome set (the vocabulary or a top-k subset of it):

- alpha = 0: KL(T || S)  (forward KL, mode-covering);
- alpha = 1: KL(S || T)  (reverse KL, mode-seeking);
- 0 < alpha < 1: M = alpha*T + (1-alpha)*S, D = alpha*KL(T||M) + (1-alpha)*KL(S||M)  (generalized JSD).

The endpoints are defined as the two KLs, not as limits: the JSD itself tends to 0 as alpha -> 0 or 1,
so the loss scale jumps there (compare alpha = 0.01 with alpha = 0 before reusing a learning rate).

Supports (`support`):

- "full": the whole vocabulary;
- "teacher_topk" (OPSD): the teacher's top-k ids per position, both distributions renormalised over them;
- "student_topk_tail" (SDPO): the student's top-k ids per position plus one tail bucket holding the
  left-over mass, for both distributions: proper distributions over k + 1 outcomes, not renormalised.

With k = vocabulary size both top-k supports equal "full". The loss is the mean of D over response tokens
(all response tokens of the batch pooled, not a mean of per-sequence means). Gradients reach the student
only: the teacher's logits are detached here, whatever the caller did.

TRL: `trl.experimental.gkd.GKDTrainer.generalized_jsd_loss` (TRL 1.16; GOLD and IW-OPD carry copies)
uses the same convention: beta = 0 is KL(T||S), beta = 1 is KL(S||T), otherwise the mixture
beta*T + (1-beta)*S weighted as here. Its default reduction ('batchmean' with labels) is sum over the
unmasked tokens / their count, i.e. our masked mean. We still write our own because (1) it has no top-k
supports: "teacher_topk" could reuse it by passing logits gathered at the teacher's top-k ids (its
log_softmax renormalises them), but the tail bucket cannot, since log 0 for an empty tail (k = vocab)
gives 0 * -inf = NaN in its `F.kl_div`; (2) it neither detaches the teacher nor upcasts bf16 logits
(its caller wraps the teacher in no_grad), and returns 0 for an empty mask where we raise; (3) it lives
in `trl.experimental`, whose API may change without deprecation. Reuse for the full support would be
`GKDTrainer.generalized_jsd_loss(s.float(), t.detach().float(), labels=torch.where(mask.bool(), 0, -100),
beta=alpha, temperature=temperature)`.
"""

from __future__ import annotations

import math
from numbers import Real

import torch

from graftlab.errors import GraftlabError

SUPPORTS = ("full", "teacher_topk", "student_topk_tail")


def generalized_divergence(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor,
    alpha: float,
    support: str = "full",
    k: int | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Mean of D_alpha over the response tokens (`mask` nonzero) of the whole batch: a scalar loss.

    Logits are [batch, seq, vocab] and aligned (position t of both predicts the same token); `mask` is
    [batch, seq]. `k` is required by the top-k supports and ignored by "full".
    """
    d = token_divergence(student_logits, teacher_logits, alpha, support, k, temperature)
    if tuple(mask.shape) != tuple(d.shape):
        raise GraftlabError(
            f"divergence: mask shape {tuple(mask.shape)} does not match the logits' [batch, seq] {tuple(d.shape)}"
        )
    response = mask.to(device=d.device) != 0
    # A check that syncs with the device, but an empty mask would silently give 0/0 = NaN (or, with
    # TRL's clamp, a zero loss that hides a data bug such as every sample masked for want of context).
    if not bool(response.any()):
        raise GraftlabError("divergence: mask is all zero (no response tokens to average over)")
    # where, not d * mask: padding positions may hold non-finite logits and NaN * 0 is NaN.
    return torch.where(response, d, torch.zeros_like(d)).sum() / response.sum()


def token_divergence(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    alpha: float,
    support: str = "full",
    k: int | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """D_alpha at every position, shape [batch, seq] (no mask), for tests and logging."""
    _check_args(student_logits, teacher_logits, alpha, support, k, temperature)
    # float32 at least: bf16 log-probs lose the small differences the KL is made of; float64 stays float64.
    dtype = torch.promote_types(student_logits.dtype, torch.float32)
    s = student_logits.to(dtype) / temperature
    t = teacher_logits.detach().to(dtype) / temperature
    if support == "full":
        log_s, log_t = torch.log_softmax(s, -1), torch.log_softmax(t, -1)
    elif support == "teacher_topk":
        log_s, log_t = _teacher_topk(s, t, k)
    else:
        log_s, log_t = _student_topk_tail(s, t, k)
    # Floor the log-probs at log(smallest normal): an empty tail (log 0 = -inf) or -inf logits would make
    # p * (log p - log q) = 0 * -inf = NaN and poison the gradients; at the floor p is ~1e-38 and its
    # term is ~1e-36, so the value is unchanged to working precision and 0 * log 0 terms vanish.
    floor = math.log(torch.finfo(dtype).tiny)
    return _divergence(log_s.clamp_min(floor), log_t.clamp_min(floor), float(alpha))


def _teacher_topk(s: torch.Tensor, t: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of S and T restricted to the teacher's top-k ids, each renormalised over them."""
    ids = t.topk(k, dim=-1).indices
    # Softmax of the gathered logits is the renormalised restriction, without an O(vocab) log_softmax.
    return torch.log_softmax(s.gather(-1, ids), -1), torch.log_softmax(t.gather(-1, ids), -1)


def _student_topk_tail(s: torch.Tensor, t: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of S and T over the student's top-k ids plus a tail bucket: k + 1 outcomes each."""
    ids = s.detach().topk(k, dim=-1).indices
    in_top = torch.zeros_like(s, dtype=torch.bool).scatter_(-1, ids, True)
    log_s, log_t = torch.log_softmax(s, -1), torch.log_softmax(t, -1)
    return _with_tail(log_s, ids, in_top), _with_tail(log_t, ids, in_top)


def _with_tail(log_p: torch.Tensor, ids: torch.Tensor, in_top: torch.Tensor) -> torch.Tensor:
    """log p at `ids`, then the log of the mass outside them, as a last column."""
    # The tail as a logsumexp over the complement, not log(1 - sum p_topk): when the top-k hold nearly all
    # the mass (the usual case for a confident model) 1 - sum cancels catastrophically in float32 and
    # gives 0 or a negative number. The top-k entries are filled with a finite value, not -inf: with -inf
    # an empty complement (k = vocab) has a NaN logsumexp gradient, harmless only because masked_fill's
    # backward happens to overwrite it; finite, every intermediate stays finite. The fill is below the
    # floor applied afterwards by more than log(vocab), so its contribution (<= vocab * e^fill) never shows.
    fill = 2 * math.log(torch.finfo(log_p.dtype).tiny)
    tail = torch.logsumexp(log_p.masked_fill(in_top, fill), dim=-1, keepdim=True)
    return torch.cat([log_p.gather(-1, ids), tail], dim=-1)


def _divergence(log_s: torch.Tensor, log_t: torch.Tensor, alpha: float) -> torch.Tensor:
    """D_alpha over the last axis, from log-probs (finite) of S and T."""
    if alpha == 0.0:
        return _kl(log_t, log_s)
    if alpha == 1.0:
        return _kl(log_s, log_t)
    # log M by logaddexp of the weighted log-probs: M never underflows where either T or S is large.
    log_m = torch.logaddexp(math.log(alpha) + log_t, math.log1p(-alpha) + log_s)
    return alpha * _kl(log_t, log_m) + (1 - alpha) * _kl(log_s, log_m)


def _kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """KL(P || Q) = sum p (log p - log q) over the last axis."""
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def _check_args(student_logits, teacher_logits, alpha, support, k, temperature) -> None:
    """GraftlabError naming the first bad argument."""
    if student_logits.dim() != 3 or tuple(student_logits.shape) != tuple(teacher_logits.shape):
        raise GraftlabError(
            f"divergence: student logits {tuple(student_logits.shape)} and teacher logits "
            f"{tuple(teacher_logits.shape)} must have the same [batch, seq, vocab] shape"
        )
    if isinstance(alpha, bool) or not isinstance(alpha, Real) or not 0.0 <= alpha <= 1.0:
        raise GraftlabError(f"divergence: alpha must be a number in [0, 1], got {alpha!r}")
    if support not in SUPPORTS:
        raise GraftlabError(f"divergence: unknown support {support!r} (expected one of {', '.join(SUPPORTS)})")
    if isinstance(temperature, bool) or not isinstance(temperature, Real) or not (0.0 < temperature < math.inf):
        raise GraftlabError(f"divergence: temperature must be a positive finite number, got {temperature!r}")
    if support == "full":
        return
    vocab = student_logits.shape[-1]
    if k is None:
        raise GraftlabError(f"divergence: support {support!r} needs k (the number of top tokens)")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= vocab:
        raise GraftlabError(f"divergence: k must be an integer in [1, vocab = {vocab}], got {k!r}")
