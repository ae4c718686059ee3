"""Diagonal retention Fisher: `F = (1/N) sum_n g_n * g_n`, with `g_n` the gradient of the summed
log-likelihood of rollout n's completion tokens (docs/methods.md). Rollouts are the model's own samples, so this
is the true Fisher by Monte Carlo, not the empirical one.

Per-rollout gradients come from the pass of `graftlab.fisher.backward`, not from per-example autograd: each
module's call meets its input and its output gradient `d` in one backward per batch, taken only down to the
input embeddings (no weight gradient is ever formed), with each decoder layer recomputed. There the
per-rollout gradient is formed and squared at once, so no output gradient outlives its layer's backward: a
linear weight's is `sum_t d_t x_t^T` over the rollout's tokens, an embedding's scatters `d` to the token
rows, a norm's (or anything else's) is the module's own vector-Jacobian product, vmapped over rollouts.
Per-rollout gradients are materialised `CHUNK_FLOATS` at a time, so memory is one forward-backward's plus
one chunk, whatever the batch: a single 8k-token rollout runs as a batch of one. The forward may use any
attention (SDPA, flash) and autocast: nothing is traced through it. (The former `torch.func.vmap` path
needed eager attention and held every per-example gradient of the batch at once; this one is exact as
well, tests/test_fisher.py.)
"""

import math
from collections import Counter
from pathlib import Path

import polars as pl
import torch
from torch import nn
from tqdm import tqdm

from graftlab.errors import GraftlabError
from graftlab.fisher.backward import ModuleBackward
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
    from graftlab.io.gates import context_length
    from graftlab.io.gates import model_dir as model_gate
    from graftlab.io.tables import within_context

    config = model_gate(model_dir, "model")
    vocab = config.get("vocab_size", (config.get("text_config") or {}).get("vocab_size"))
    rollouts = read_rollouts(rollouts_path, vocab)
    lengths = [len(p) + len(c) for p, c in rollouts]
    within_context(lengths, context_length(config), f"rollouts ({rollouts_path})")
    model_gate(model_dir, "model", finite=True)
    return rollouts


def fisher_device() -> torch.device:
    """The GPU when there is one (the workflow gives Fisher jobs `gpu: 1`), else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def fitting_batch(batch_size: int, rollouts, model, factors: float = 0.0, recompute: bool = False) -> int:
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
    fits = int(budget // memory.activations(shape, longest, act_bytes=memory.FP32, recompute=recompute))
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


class _DiagPass(ModuleBackward):
    """Squares per-rollout gradients into `fisher` as the backward reaches each module
    (`graftlab.fisher.backward`)."""

    def __init__(self, model: nn.Module, fisher: dict[str, torch.Tensor], seen: set, rows=None):
        self.fisher, self.seen = fisher, seen
        # Sharded over processes: the rows (first dimension) of each parameter this process accumulates.
        self.rows: dict[str, tuple[int, int]] = rows or {}
        self.owners = parameter_owners(model)
        self.params: dict[str, list[tuple[str, str]]] = {}  # module -> its (parameter, attribute) pairs
        for name, users in self.owners.items():
            for m, attr in users:
                self.params.setdefault(m, []).append((name, attr))
        super().__init__(model, {m: model.get_submodule(m) for m in self.params})

    def batch(self, ids: torch.Tensor, scored: torch.Tensor, autocast: torch.dtype | None) -> None:
        self.arrived, self.partial = Counter(), {}
        self.run(ids, scored, autocast)
        for name, g in self.partial.items():  # shared weights some of whose calls got no gradient
            self.fisher[name] += self._own(name, g.square_().sum(0))
        self.seen.update(n for m in self.calls for n, _ in self.params[m])

    def _own(self, name: str, square: torch.Tensor) -> torch.Tensor:
        """This process's rows of a whole parameter's squared gradients (all of them unsharded)."""
        rows = self.rows.get(name)
        return square if rows is None else square[rows[0] : rows[1]]

    def _arrive(self, m: str, x: torch.Tensor, d: torch.Tensor) -> None:
        module = self.modules[m]
        for name, attr in self.params[m]:
            uses = sum(self.calls[u] for u, _ in self.owners[name])
            if uses == 1:  # the whole per-rollout gradient is here: square it chunk by chunk
                _add_squares(self.fisher[name], module, attr, x, d, self.rows.get(name))
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
                self.fisher[name] += self._own(name, self.partial.pop(name).square_().sum(0))


def _add_squares(fisher: torch.Tensor, module: nn.Module, attr: str, x: torch.Tensor, d: torch.Tensor, rows=None):
    """fisher += the squared per-rollout gradients summed over rollouts, formed `CHUNK_FLOATS` at a time:
    rollouts in groups, and a linear weight in blocks of output rows when one rollout's gradient alone is
    larger (an 8B model's MLP weight is 50M floats). `rows`: the (first, end) rows `fisher` holds, when the
    parameter is sharded over processes: a linear weight forms only those."""
    lo, hi = rows or (0, fisher.shape[0])
    if isinstance(module, nn.Linear) and attr == "weight":
        in_features = fisher.shape[1]
        block = max(1, min(hi - lo, CHUNK_FLOATS // in_features))
        step = max(1, CHUNK_FLOATS // (block * in_features))
        for o in range(lo, hi, block):
            end = min(o + block, hi)
            for r in range(0, x.shape[0], step):
                g = per_example_grad(module, attr, x[r : r + step], d[r : r + step, ..., o:end])
                fisher[o - lo : end - lo] += g.square_().sum(0)  # in place: g is this chunk's own
        return
    step = max(1, CHUNK_FLOATS // math.prod(getattr(module, attr).shape))  # a whole parameter a rollout
    for r in range(0, x.shape[0], step):
        fisher += per_example_grad(module, attr, x[r : r + step], d[r : r + step]).square_().sum(0)[lo:hi]


def diag_fisher(
    model, rollouts, batch_size: int = 16, pad_id: int = 0, autocast: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """fp32 diagonal Fisher of `model` over `rollouts` [(prompt_ids, completion_ids)], by parameter name;
    `autocast`, a dtype to run the forward under (the Fisher is accumulated in fp32 either way). A model
    sharded over processes (`graftlab.train.shard`: every process runs the same rollouts) gives each process
    the rows of every parameter it holds."""
    device = next(model.parameters()).device
    fisher, rows = accumulators(model, [n for n, _ in model.named_parameters()])
    seen: set = set()
    diag = _DiagPass(model, fisher, seen, rows)
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


def accumulators(model, names: list[str]) -> tuple[dict[str, torch.Tensor], dict[str, tuple[int, int]]]:
    """A zero fp32 accumulator on its device for each of the parameters `names`, and the rows (`shard_rows`) of
    those sharded over processes, whose accumulators hold only this process's rows."""
    params = dict(model.named_parameters())
    rows = {n: shard_rows(params[n]) for n in names if hasattr(params[n], "to_local")}
    local = {n: params[n].to_local() if n in rows else params[n] for n in names}
    return {n: torch.zeros(p.shape, device=p.device) for n, p in local.items()}, rows


def shard_rows(param) -> tuple[int, int]:
    """The rows (first, end) of a parameter sharded over the processes that this one holds: FSDP splits the
    first dimension as `torch.chunk` does."""
    import torch.distributed as dist

    rank, size, n = dist.get_rank(), dist.get_world_size(), param.shape[0]
    chunk = -(-n // size)
    first = min(rank * chunk, n)
    end = min(first + chunk, n)
    if param.to_local().shape[0] != end - first:
        held = param.to_local().shape[0]
        raise GraftlabError(f"a shard of {tuple(param.shape)} holds {held} rows, not {end - first}")
    return first, end


def _whole(local: torch.Tensor, rows: int) -> torch.Tensor:
    """A parameter's Fisher of `rows` rows from every process's share (each gathered, one at a time)."""
    import torch.distributed as dist

    chunk = -(-rows // dist.get_world_size())
    padded = local.new_zeros((chunk, *local.shape[1:]))
    padded[: local.shape[0]] = local
    shares = [torch.empty_like(padded) for _ in range(dist.get_world_size())]
    dist.all_gather(shares, padded)
    return torch.cat(shares)[:rows].cpu()


def _load(model_dir):
    from transformers import AutoModelForCausalLM

    # fp32 whatever the checkpoint's dtype: bf16 gradients carry percent-level errors, fp16 underflows.
    # SDPA: the hooks trace nothing through attention, so the fused kernels serve (eager would hold the
    # T x T attention matrices, 8k tokens would not fit).
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    return model.eval()


def write_diag_fisher(model_dir, rollouts_path, out_dir: Path, batch_size: int = 16, processes: int = 1) -> None:
    """`out_dir/diag.safetensors`: the diagonal Fisher of the model at `model_dir`, named like its weights,
    into `out_dir`, a directory its caller makes whole at once (`graftlab.fisher.write_fisher`). Over
    `processes` (one per GPU: `graftlab.train.shard`) the model, its accumulator and the work of each rollout
    are divided among them: each process forms the gradients of its own rows."""
    from safetensors.torch import save_file

    from graftlab.io.provenance import write_provenance

    rollouts = checked_inputs(model_dir, rollouts_path)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if processes > 1:
        from graftlab.train.shard import launch

        launch(processes, _sharded_diag, str(model_dir), rollouts, out_dir, batch_size)
    else:
        model = _load(model_dir).to(fisher_device())
        pad_id = model.config.pad_token_id or 0
        fisher = diag_fisher(model, rollouts, fitting_batch(batch_size, rollouts, model, recompute=True), pad_id)
        save_file({k: v.cpu().contiguous() for k, v in fisher.items()}, out_dir / "diag.safetensors")
    write_provenance(
        out_dir, {"model": model_dir, "rollouts": rollouts_path}, {"kind": "diag", "rollouts": len(rollouts)}
    )


def _sharded_diag(model_dir: str, rollouts, out: Path, batch_size: int) -> None:
    """One process of a sharded diagonal Fisher: the first writes `out/diag.safetensors`."""
    from safetensors.torch import save_file

    from graftlab.train import shard

    model = shard.shard(_load(model_dir))
    # Every process runs each batch together: the smallest batch any of them fits.
    batch = int(shard.least(fitting_batch(batch_size, rollouts, model, recompute=True)))
    fisher = diag_fisher(model, rollouts, batch, model.config.pad_token_id or 0)
    params = dict(model.named_parameters())
    whole = {name: _whole(local, params[name].shape[0]) for name, local in fisher.items()}
    if shard.world()[0] == 0:
        save_file({k: v.contiguous() for k, v in whole.items()}, out / "diag.safetensors")
