"""Diagonal retention Fisher: `F = (1/N) sum_n g_n * g_n`, with `g_n` the gradient of the summed
log-likelihood of rollout n's completion tokens (docs/methods.md). Rollouts are the model's own samples, so this
is the true Fisher by Monte Carlo, not the empirical one.

Per-rollout gradients come from hooks, not from per-example autograd: forward hooks keep each module's
input and hook its output, and one backward per batch, taken only down to the input embeddings (no weight
gradient is ever formed), hands each module its output gradient `d`. There the per-rollout gradient is
formed and squared at once, so no output gradient outlives its layer's backward: a linear weight's is
`sum_t d_t x_t^T` over the rollout's tokens, an embedding's scatters `d` to the token rows, a norm's (or
anything else's) is the module's own vector-Jacobian product, vmapped over rollouts. Per-rollout gradients
are materialised `CHUNK_FLOATS` at a time, so memory is one forward-backward's plus one chunk, whatever the
batch: a single 8k-token rollout runs as a batch of one. The forward may use any attention (SDPA, flash)
and autocast: nothing is traced through it. (The former `torch.func.vmap` path needed eager attention and
held every per-example gradient of the batch at once; this one is exact as well, tests/test_fisher.py.)

Sequences are right-padded and run without an attention mask: under causal attention a pad only ever
follows the real tokens, so it cannot change their logits, and its own loss is masked out.
"""

from collections import Counter
from contextlib import nullcontext
from pathlib import Path

import polars as pl
import torch
from torch import nn
from tqdm import tqdm

from graftlab.errors import GraftlabError
from graftlab.io.tables import read_table
from graftlab.memory import CHUNK_FLOATS  # per-rollout gradients are materialised this many at a time

ROLLOUT_COLUMNS = ("prompt_ids", "completion_ids")


def read_rollouts(path, vocab_size: int | None = None) -> list[tuple[list[int], list[int]]]:
    """Each rollout's (prompt_ids, completion_ids), refused with the row named when a column is not
    lists of integers, a row holds a null or no completion token, or an id lies outside
    [0, vocab_size): an embedding lookup would stop with an IndexError deep in the forward pass."""
    frame = read_table(path, ROLLOUT_COLUMNS, "rollouts")
    for column in ROLLOUT_COLUMNS:
        dtype, ids = frame.schema[column], frame[column]
        if not (isinstance(dtype, pl.List) and dtype.inner.is_integer()):
            raise GraftlabError(f"rollouts ({path}): column {column} is {dtype}, not lists of integer token ids")
        problems = {
            "is null or holds a null id": ids.is_null() | ids.list.eval(pl.element().is_null()).list.any(),
            "holds a negative token id": ids.list.min() < 0,
        }
        if vocab_size is not None:
            problems[f"holds a token id >= the model's vocabulary size {vocab_size}"] = ids.list.max() >= vocab_size
        if column == "completion_ids":
            problems["has no completion tokens"] = ids.list.len() == 0
        for problem, rows in problems.items():
            bad = rows.fill_null(False).arg_true()
            if len(bad):
                row, shown = bad[0], ids[bad[0]]
                shown = "null" if shown is None else f"{shown.to_list()[:8]}..."
                raise GraftlabError(
                    f"rollouts ({path}): row {row} {column} {problem} ({shown}; {len(bad)} such row(s))"
                )
    return list(zip(frame["prompt_ids"].to_list(), frame["completion_ids"].to_list()))


def checked_inputs(model_dir, rollouts_path) -> list[tuple[list[int], list[int]]]:
    """The rollouts of a Fisher, read and checked against the model at `model_dir` before it loads: a
    model directory, with finite weights (NaN weights give a NaN Fisher), ids within its vocabulary."""
    from graftlab.io.safetensors_io import read_config, refuse_nonfinite

    config = read_config(model_dir) if Path(model_dir).is_dir() else None
    if config is None:
        raise GraftlabError(f"model {model_dir}: not a model directory (no config.json)")
    vocab = config.get("vocab_size", (config.get("text_config") or {}).get("vocab_size"))
    rollouts = read_rollouts(rollouts_path, vocab)
    refuse_nonfinite(model_dir)
    return rollouts


def fisher_device() -> torch.device:
    """The GPU when there is one (the workflow gives Fisher jobs `gpu: 1`), else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def fitting_batch(batch_size: int, rollouts, model, factors: float = 0.0) -> int:
    """Rollouts per pass: `batch_size`, or on a GPU as many as fit (at least one) beside the model, the fp32
    accumulator, a chunk of per-rollout gradients and `factors` bytes still to come: the batch changes memory,
    not results (graftlab.memory counts the same parts)."""
    if not torch.cuda.is_available():
        return batch_size
    from graftlab import memory

    shape = memory.Shape.of_config(model.config.to_dict())
    longest = max(len(p) + len(c) for p, c in rollouts)
    params = sum(p.numel() for p in model.parameters())
    coming = params * memory.FP32 + memory.CHUNK_BYTES + factors
    budget = memory.GPU_SHARE * torch.cuda.mem_get_info()[0] - coming
    fits = int(budget // memory.activations(shape, longest, act_bytes=memory.FP32))
    batch = max(1, min(batch_size, fits))
    print(f"fisher batch: {batch} rollouts of up to {longest} tokens a pass (batch_size {batch_size})", flush=True)
    return batch


def right_pad(rollouts, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded token ids and a mask that is 1 where a token is a completion token to score."""
    length = max(len(p) + len(c) for p, c in rollouts)
    ids = torch.full((len(rollouts), length), pad_id, dtype=torch.long)
    scored = torch.zeros(len(rollouts), length)
    for i, (prompt, completion) in enumerate(rollouts):
        ids[i, : len(prompt) + len(completion)] = torch.tensor(prompt + completion)
        scored[i, len(prompt) : len(prompt) + len(completion)] = 1
    return ids, scored


def parameter_owners(model: nn.Module) -> dict[str, list[tuple[str, str]]]:
    """Each parameter's name (as `named_parameters` gives it) -> the (module, attribute) pairs that use it;
    more than one pair means a shared (tied) weight."""
    canonical = {id(p): name for name, p in model.named_parameters()}
    owners: dict[str, list[tuple[str, str]]] = {name: [] for name in canonical.values()}
    for module_name, module in model.named_modules():
        for attr, p in module.named_parameters(recurse=False):
            owners[canonical[id(p)]].append((module_name, attr))
    return owners


def per_example_grad(module: nn.Module, attr: str, x: torch.Tensor, d: torch.Tensor, out=None) -> torch.Tensor:
    """Rollout-wise gradient of one parameter from one call of its module (input `x`, output gradient `d`,
    rollouts on dim 0), [rows, *param.shape], fp32; an embedding's is added into `out` when given (a tied
    embedding's per-rollout sum so far: no second vocabulary-sized buffer)."""
    if isinstance(module, nn.Linear):
        d, x = d.float().flatten(1, -2), x.float().flatten(1, -2)
        return torch.einsum("bto,bti->boi", d, x) if attr == "weight" else d.sum(1)
    if isinstance(module, nn.Embedding):
        vocab, rows = module.num_embeddings, x.shape[0]
        d = d.float()
        if module.padding_idx is not None:  # torch never updates the padding row
            d = d * (x != module.padding_idx)[..., None]
        index = (torch.arange(rows, device=x.device)[:, None] * vocab + x).flatten()
        out = d.new_zeros(rows, vocab, module.embedding_dim) if out is None else out
        out.view(rows * vocab, module.embedding_dim).index_add_(0, index, d.flatten(0, 1))
        return out
    # Norms and anything else: the module's own vector-Jacobian product, once per rollout.
    from torch.func import functional_call, vjp, vmap

    param = getattr(module, attr)

    def one(x_n, d_n):
        _, pull = vjp(lambda p: functional_call(module, {attr: p}, (x_n[None],)), param)
        return pull(d_n[None].to(param.dtype))[0]

    return vmap(one)(x, d).float()


class _DiagPass:
    """Hooks that square per-rollout gradients into `fisher` as the backward reaches each module."""

    def __init__(self, model: nn.Module, fisher: dict[str, torch.Tensor], seen: set):
        self.model, self.fisher, self.seen = model, fisher, seen
        self.owners = parameter_owners(model)
        self.params: dict[str, list[tuple[str, str]]] = {}  # module -> its (parameter, attribute) pairs
        for name, users in self.owners.items():
            for m, attr in users:
                self.params.setdefault(m, []).append((name, attr))
        self.modules = {m: model.get_submodule(m) for m in self.params}
        self.embedding = model.get_input_embeddings()

    def batch(self, ids: torch.Tensor, scored: torch.Tensor, autocast: torch.dtype | None) -> None:
        self.calls, self.arrived, self.partial, roots = Counter(), Counter(), {}, []
        handles = [module.register_forward_hook(self._hook(m, roots)) for m, module in self.modules.items()]
        amp = torch.autocast(ids.device.type, dtype=autocast) if autocast else nullcontext()
        try:
            with amp:
                logits = self.model(ids, use_cache=False).logits[:, :-1].float()
        finally:
            for h in handles:
                h.remove()
        if not roots:
            raise GraftlabError(f"{type(self.model).__name__}: its input embedding was not called by forward")
        loglik = (logits.log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0] * scored[:, 1:]).sum()
        # Gradients down to the embedding output only: every module's output gradient passes its hook on
        # the way, and the engine skips every weight gradient.
        grads = torch.autograd.grad(loglik, [out for _, _, out in roots], allow_unused=True)
        for (m, x, _), g in zip(roots, grads):
            if g is not None:
                self._arrive(m, x, g)
        for name, g in self.partial.items():  # shared weights some of whose calls got no gradient
            self.fisher[name] += g.square_().sum(0)
        self.seen.update(n for m in self.calls for n, _ in self.params[m])

    def _hook(self, m: str, roots: list):
        def hook(module, args, output):
            x = args[0].detach()
            self.calls[m] += 1
            if module is self.embedding:
                roots.append((m, x, output))
            elif isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(lambda g: self._arrive(m, x, g))

        return hook

    def _arrive(self, m: str, x: torch.Tensor, d: torch.Tensor) -> None:
        module = self.modules[m]
        for name, attr in self.params[m]:
            uses = sum(self.calls[u] for u, _ in self.owners[name])
            if uses == 1:  # the whole per-rollout gradient is here: square it chunk by chunk
                _add_squares(self.fisher[name], module, attr, x, d)
                continue
            # A shared (tied) weight: sum its calls' per-rollout gradients before squaring.
            if name in self.partial and isinstance(module, nn.Embedding):
                per_example_grad(module, attr, x, d, out=self.partial[name])
            elif name in self.partial:
                self.partial[name] += per_example_grad(module, attr, x, d)
            else:
                self.partial[name] = per_example_grad(module, attr, x, d)
            self.arrived[name] += 1
            if self.arrived[name] == uses:
                self.fisher[name] += self.partial.pop(name).square_().sum(0)


def _add_squares(fisher: torch.Tensor, module: nn.Module, attr: str, x: torch.Tensor, d: torch.Tensor) -> None:
    """fisher += the squared per-rollout gradients summed over rollouts, formed `CHUNK_FLOATS` at a time:
    rollouts in groups, and a linear weight in blocks of output rows when one rollout's gradient alone is
    larger (an 8B model's MLP weight is 50M floats)."""
    if isinstance(module, nn.Linear) and attr == "weight":
        out_features, in_features = fisher.shape
        block = max(1, min(out_features, CHUNK_FLOATS // in_features))
        step = max(1, CHUNK_FLOATS // (block * in_features))
        for o in range(0, out_features, block):
            for r in range(0, x.shape[0], step):
                g = per_example_grad(module, attr, x[r : r + step], d[r : r + step, ..., o : o + block])
                fisher[o : o + block] += g.square_().sum(0)  # in place: g is this chunk's own
        return
    step = max(1, CHUNK_FLOATS // fisher.numel())
    for r in range(0, x.shape[0], step):
        fisher += per_example_grad(module, attr, x[r : r + step], d[r : r + step]).square_().sum(0)


def diag_fisher(
    model, rollouts, batch_size: int = 16, pad_id: int = 0, autocast: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """fp32 diagonal Fisher of `model` over `rollouts` [(prompt_ids, completion_ids)], by parameter name;
    `autocast`, a dtype to run the forward under (the Fisher is accumulated in fp32 either way)."""
    device = next(model.parameters()).device
    fisher = {n: torch.zeros(p.shape, device=device) for n, p in model.named_parameters()}
    seen: set = set()
    diag = _DiagPass(model, fisher, seen)
    for start in tqdm(range(0, len(rollouts), batch_size), desc="diag Fisher", unit="batch"):
        ids, scored = (t.to(device) for t in right_pad(rollouts[start : start + batch_size], pad_id))
        diag.batch(ids, scored, autocast)
    if unseen := sorted(fisher.keys() - seen):
        # A weight used outside its module's forward (e.g. `hidden @ embed.weight.T`) is invisible to the
        # hooks: a zero Fisher would make the mask rank it least sensitive, so refuse instead.
        raise GraftlabError(f"no module call reached parameters {unseen[:3]}: their Fisher cannot be computed")
    for f in fisher.values():  # in place: a divided copy would be the job's peak, 4 more bytes a parameter
        f.div_(len(rollouts))
    return fisher


def write_diag_fisher(model_dir, rollouts_path, out_dir: Path, batch_size: int = 16) -> None:
    """`out_dir/diag.safetensors`: the diagonal Fisher of the model at `model_dir`, named like its weights."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from graftlab.io.atomic import atomic_dir
    from graftlab.io.provenance import write_provenance

    rollouts = checked_inputs(model_dir, rollouts_path)
    # fp32 whatever the checkpoint's dtype: bf16 gradients carry percent-level errors, fp16 underflows.
    # SDPA: the hooks trace nothing through attention, so the fused kernels serve (eager would hold the
    # T x T attention matrices, 8k tokens would not fit).
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model = model.eval().to(fisher_device())
    pad_id = model.config.pad_token_id or 0
    fisher = diag_fisher(model, rollouts, fitting_batch(batch_size, rollouts, model), pad_id)
    with atomic_dir(out_dir) as tmp:
        save_file({k: v.cpu().contiguous() for k, v in fisher.items()}, tmp / "diag.safetensors")
        write_provenance(
            tmp, {"model": model_dir, "rollouts": rollouts_path}, {"kind": "diag", "rollouts": len(rollouts)}
        )
