"""Diagonal retention Fisher against a per-example autograd loop on a pico model."""

import polars as pl
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from graftlab.fisher.diag import diag_fisher, write_diag_fisher
from graftlab.models import GraftlabError


def _rollouts(seed: int, count: int, vocab: int = 32) -> list[tuple[list[int], list[int]]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 9, (count, 2), generator=gen).tolist()
    return [
        (torch.randint(1, vocab, (p,), generator=gen).tolist(), torch.randint(1, vocab, (c,), generator=gen).tolist())
        for p, c in lengths
    ]


def _loop_fisher(model, rollouts) -> dict[str, torch.Tensor]:
    """The definition, one backward per rollout: (1/N) sum_n g_n^2."""
    fisher = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for prompt, completion in rollouts:
        model.zero_grad()
        ids = torch.tensor([prompt + completion])
        logp = model(ids).logits[0, :-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
        logp[len(prompt) - 1 :].sum().backward()
        for n, p in model.named_parameters():
            fisher[n] += p.grad**2 / len(rollouts)
    return fisher


def test_diag_fisher_equals_per_example_loop(pico_model):
    model = AutoModelForCausalLM.from_pretrained(pico_model("m"), attn_implementation="eager").eval()
    rollouts = _rollouts(0, 11)  # uneven lengths and a last batch smaller than the batch size
    fast = diag_fisher(model, rollouts, batch_size=4)
    slow = _loop_fisher(model, rollouts)
    assert fast.keys() == slow.keys()
    for name in slow:
        scale = slow[name].abs().max()
        assert (fast[name] - slow[name]).abs().max() <= 1e-5 * scale, name


def test_written_fisher_is_named_like_the_weights(pico_model, tmp_path):
    path = pico_model("m")
    pl.DataFrame({"prompt_ids": [p for p, _ in _rollouts(1, 5)], "completion_ids": [c for _, c in _rollouts(1, 5)]}).write_parquet(
        tmp_path / "r.parquet"
    )
    write_diag_fisher(path, tmp_path / "r.parquet", tmp_path / "fisher")
    fisher = load_file(tmp_path / "fisher" / "diag.safetensors")
    weights = dict(AutoModelForCausalLM.from_pretrained(path).named_parameters())
    assert fisher.keys() == weights.keys()
    assert all(fisher[n].shape == weights[n].shape and fisher[n].dtype == torch.float32 for n in fisher)
    assert all(torch.isfinite(f).all() and (f >= 0).all() for f in fisher.values())


def test_rollouts_without_required_columns_are_refused(pico_model, tmp_path):
    pl.DataFrame({"prompt_ids": [[1, 2]]}).write_parquet(tmp_path / "r.parquet")
    with pytest.raises(GraftlabError, match="missing \\['completion_ids'\\]"):
        write_diag_fisher(pico_model("m"), tmp_path / "r.parquet", tmp_path / "fisher")
    assert not (tmp_path / "fisher").exists()
