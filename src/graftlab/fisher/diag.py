"""Diagonal retention Fisher: `F = (1/N) sum_n g_n * g_n`, with `g_n` the gradient of the summed
log-likelihood of rollout n's completion tokens (docs/methods.md). Rollouts are the model's own samples, so this
is the true Fisher by Monte Carlo, not the empirical one.

Per-example gradients come from `torch.func` (vmap over grad), one batched pass rather than one backward
per rollout. Sequences are right-padded and run without an attention mask: under causal attention a pad
only ever follows the real tokens, so it cannot change their logits, and its own loss is masked out.
(transformers' mask construction branches on tensor values, which vmap cannot trace.)
"""

from pathlib import Path

import torch
from tqdm import tqdm

from graftlab.tables import read_table

ROLLOUT_COLUMNS = ("prompt_ids", "completion_ids")


def read_rollouts(path) -> list[tuple[list[int], list[int]]]:
    frame = read_table(path, ROLLOUT_COLUMNS, "rollouts")
    return list(zip(frame["prompt_ids"].to_list(), frame["completion_ids"].to_list()))


def fisher_device() -> torch.device:
    """The GPU when there is one (the workflow gives Fisher jobs `gpu: 1`), else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def right_pad(rollouts, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded token ids and a mask that is 1 where a token is a completion token to score."""
    length = max(len(p) + len(c) for p, c in rollouts)
    ids = torch.full((len(rollouts), length), pad_id, dtype=torch.long)
    scored = torch.zeros(len(rollouts), length)
    for i, (prompt, completion) in enumerate(rollouts):
        ids[i, : len(prompt) + len(completion)] = torch.tensor(prompt + completion)
        scored[i, len(prompt) : len(prompt) + len(completion)] = 1
    return ids, scored


def diag_fisher(model, rollouts, batch_size: int = 16, pad_id: int = 0) -> dict[str, torch.Tensor]:
    """fp32 diagonal Fisher of `model` over `rollouts` [(prompt_ids, completion_ids)], by parameter name."""
    from torch.func import functional_call, grad, vmap

    params = {name: p.detach() for name, p in model.named_parameters()}

    def loglik(p, ids, scored):
        logits = functional_call(model, p, (ids[None],), {"use_cache": False}).logits[0, :-1].float()
        token_lp = logits.log_softmax(-1).gather(-1, ids[1:, None])[:, 0]
        return (token_lp * scored[1:]).sum()

    per_example = vmap(grad(loglik), in_dims=(None, 0, 0))
    fisher = {name: torch.zeros_like(p, dtype=torch.float32) for name, p in params.items()}
    for start in tqdm(range(0, len(rollouts), batch_size), desc="diag Fisher", unit="batch"):
        ids, scored = (t.to(model.device) for t in right_pad(rollouts[start : start + batch_size], pad_id))
        for name, g in per_example(params, ids, scored).items():
            fisher[name] += g.float().pow(2).sum(0)
    return {name: f / len(rollouts) for name, f in fisher.items()}


def write_diag_fisher(model_dir, rollouts_path, out_dir: Path, batch_size: int = 16) -> None:
    """`out_dir/diag.safetensors`: the diagonal Fisher of the model at `model_dir`, named like its weights."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from graftlab.atomic import atomic_dir
    from graftlab.provenance import write_provenance

    rollouts = read_rollouts(rollouts_path)
    # Eager attention: its backward has vmap batching rules; SDPA's CPU backward falls back to a loop.
    # fp32 whatever the checkpoint's dtype: bf16 gradients carry percent-level errors, fp16 underflows.
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    model = model.eval().to(fisher_device())
    pad_id = model.config.pad_token_id or 0
    fisher = diag_fisher(model, rollouts, batch_size, pad_id)
    with atomic_dir(out_dir) as tmp:
        save_file({k: v.cpu().contiguous() for k, v in fisher.items()}, tmp / "diag.safetensors")
        write_provenance(
            tmp, {"model": model_dir, "rollouts": rollouts_path}, {"kind": "diag", "rollouts": len(rollouts)}
        )
