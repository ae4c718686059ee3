"""KFAC retention Fisher (docs/methods.md#retention-fisher): for every linear layer `s = W a`, Kronecker factors

    A = mean over completion tokens of a a^T              (d_in x d_in)
    G = (1/N) sum_n sum_t d_{n,t} d_{n,t}^T               (d_out x d_out)

with `d_{n,t}` the gradient of rollout n's summed completion log-likelihood with respect to `s` at token t
(the "expand" flavour of KFAC for sequences), and their eigendecompositions. "Completion tokens" are the
positions whose next-token prediction is scored. Every other parameter (norms, embeddings, a linear layer
whose weight is shared, e.g. a tied lm_head, or one wider than `max_dim`, whose G would not fit) gets the
exact diagonal Fisher `(1/N) sum_n g_n^2` over all positions, as `graftlab.fisher.diag` computes it.
With `ekfac`, a second pass re-fits the diagonal in the Kronecker eigenbasis (George et al., 2018):
`E = (1/N) sum_n (U_G^T g_n U_A)^2`.

One batched forward and one `torch.autograd.grad` per batch of rollouts: forward hooks keep each
module's input, the gradients are taken with respect to each module's output, never the weights, so no
weight gradient is ever formed for a KFAC layer. Layers reading the same input tensor (q/k/v; gate/up)
have the same A: it is summed, eigendecomposed and stored once, under the first of them, the others named
in the file's `shared_A` metadata (format graftlab-kfac/2; /1 files, an A per layer, are still read).
File format: docs/formats.md.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from graftlab.errors import GraftlabError
from graftlab.fisher.backward import ModuleBackward
from graftlab.fisher.diag import (
    CHUNK_FLOATS,
    _DiagPass,
    _load,
    accumulators,
    checked_inputs,
    fisher_device,
    fitting_batch,
    parameter_owners,
    right_pad,
)

FORMAT = "graftlab-kfac/2"
# Formats the loader reads: /1 stored every layer's A factor, /2 stores a shared one once (metadata `shared_A`).
FORMATS = (FORMAT, "graftlab-kfac/1")
A_PARTS = ("A", "A_eigvals", "A_eigvecs")
FACTORS = ("A", "G", "A_eigvals", "A_eigvecs", "G_eigvals", "G_eigvecs")


def kfac_layers(model: nn.Module, max_dim: int) -> dict[str, str]:
    """Weight name -> linear module name, for the layers that get Kronecker factors."""
    modules = dict(model.named_modules())
    layers = {}
    for name, users in parameter_owners(model).items():
        (module_name, attr), *shared = users
        module = modules[module_name]
        if not shared and attr == "weight" and isinstance(module, nn.Linear):
            if max(module.in_features, module.out_features) <= max_dim:
                layers[name] = module_name
    return layers


def own_layers(layers: dict[str, str]) -> set[str]:
    """The KFAC layers whose factors this process forms: every one, or over several processes
    (`graftlab.train.shard`) those of the blocks (attention, MLP: the layers sharing an A lie in one) dealt to
    it in turn."""
    from graftlab.train.shard import sharded, world

    if not sharded():
        return set(layers)
    rank, size = world()
    blocks = list(dict.fromkeys(m.rpartition(".")[0] for m in layers.values()))
    dealt = {block: i % size for i, block in enumerate(blocks)}
    return {name for name, m in layers.items() if dealt[m.rpartition(".")[0]] == rank}


def factor_bytes(model: nn.Module, max_dim: int) -> int:
    """fp32 bytes of every Kronecker factor and its eigenvectors (an A counted per layer, though layers
    reading one input share it): what `fitting_batch` keeps free for them."""
    modules = dict(model.named_modules())
    dims = [(modules[m].in_features, modules[m].out_features) for m in kfac_layers(model, max_dim).values()]
    return 2 * 4 * sum(i * i + o * o for i, o in dims)


class _KfacPass(_DiagPass):
    """The statistics pass (`graftlab.fisher.backward`): each KFAC layer's Kronecker sums over the counted
    positions, and the exact diagonal of every other parameter (`graftlab.fisher.diag`). Layers whose calls
    read the same input tensor (q/k/v; gate/up) share one A: `share` maps each layer to the first of them in
    `layers`' order, fixed by the first batch, and only that one's `A` is summed (and stored, and
    eigendecomposed); the product is formed once an input."""

    def __init__(self, model, layers: dict[str, str], mine: set, sums: dict, diag: dict, seen: set, share: dict, rows):
        super().__init__(model, diag, seen, rows)
        self.kfac_layers, self.mine, self.sums, self.share = layers, mine, sums, share
        self.layer_of = {m: name for name, m in layers.items()}
        # A KFAC layer's weight is in its factors, not the diagonal; its module is still watched.
        self.params = {m: [(n, a) for n, a in pairs if n not in layers] for m, pairs in self.params.items()}

    def batch(self, ids, scored, counted) -> None:
        self.counted, self.read, self.products = counted, {}, {}
        super().batch(ids, scored, None)
        first: dict[tuple, str] = {}
        for name in self.kfac_layers:
            read = self.read.get(name)
            owner = self.share.setdefault(name, first.setdefault(read, name))
            if first.get(read) != owner:
                raise GraftlabError(f"KFAC layer {name} read the input of {owner} in one batch but not in another")
        for read, product in self.products.items():
            key = f"{first[read]}.A"
            self.sums[key] = self.sums.get(key, 0) + product

    def _arrive(self, m: str, x: torch.Tensor, d: torch.Tensor) -> None:
        name = self.layer_of.get(m)
        if name is not None:
            # What the layer read: its input tensor within its parent's call (q/k/v read one, gate/up one).
            read = (m.rpartition(".")[0], x.data_ptr(), tuple(x.shape))
            self.read[name] = read
            if name in self.mine:  # sharded, another process forms the factors of the others
                if read not in self.products:
                    a = x[self.counted].float()
                    self.products[read] = a.T @ a
                g = d[self.counted].float()
                self.sums[f"{name}.G"] += g.T @ g
        super()._arrive(m, x, d)


class _EkfacPass(ModuleBackward):
    """The EKFAC pass: `fit[name] += sum_n (U_G^T g_n U_A)^2`, g_n rollout n's whole gradient of the weight."""

    def __init__(self, model, layers: dict[str, str], factors: dict, fit: dict):
        super().__init__(model, {m: model.get_submodule(m) for m in layers.values()})
        self.layer_of, self.factors, self.fit = {m: name for name, m in layers.items()}, factors, fit

    def _arrive(self, m: str, a: torch.Tensor, d: torch.Tensor) -> None:
        name = self.layer_of[m]
        u_a, u_g, fit = self.factors[f"{name}.A_eigvecs"], self.factors[f"{name}.G_eigvecs"], self.fit[name]
        step = max(1, CHUNK_FLOATS // fit.numel())  # [rows, out, in] per-rollout gradients
        for start in range(0, len(a), step):
            rows = slice(start, start + step)
            fit += torch.einsum("bto,bti->boi", d[rows].float() @ u_g, a[rows].float() @ u_a).square().sum(0)


def _eigh(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # fp64: the small eigenvalues decide the mask's ranking, and fp32 eigh smears them. PSD by construction,
    # so negative eigenvalues are rounding and are clamped.
    vals, vecs = torch.linalg.eigh(matrix.double())
    return vals.clamp_min(0).float(), vecs.float().contiguous()


POSITIONS = ("completion", "all")


def _batches(rollouts, batch_size: int, pad_id: int, desc: str, device, positions: str = "completion"):
    """Padded batches and the positions the Kronecker factors count: `completion`, those whose next-token
    prediction is scored (docs/methods.md#retention-fisher); `all`, every real token, prompt included
    (completion tokens read the prompt's keys and values, so k/v projections carry much of their gradient
    there)."""
    for start in tqdm(range(0, len(rollouts), batch_size), desc=desc, unit="batch"):
        chunk = rollouts[start : start + batch_size]
        ids, scored = (t.to(device) for t in right_pad(chunk, pad_id))
        counted = torch.zeros_like(scored, dtype=torch.bool)
        if positions == "all":
            for i, (prompt, completion) in enumerate(chunk):
                counted[i, : len(prompt) + len(completion)] = True
        else:  # position t predicts token t+1
            counted[:, :-1] = scored[:, 1:] > 0
        yield ids, scored, counted


def kfac_statistics(
    model, rollouts, batch_size=16, pad_id=0, max_dim=8192, positions="completion"
) -> dict[str, torch.Tensor]:
    """The pass over the rollouts: normalised `{weight}.A`, `{weight}.G` of the KFAC layers and
    `{param}.diag` of every other parameter, fp32."""
    layers = kfac_layers(model, max_dim)
    mine = own_layers(layers)
    device = model.device
    width = {name: model.get_submodule(m).out_features for name, m in layers.items() if name in mine}
    sums = {f"{name}.G": torch.zeros(o, o, device=device) for name, o in width.items()}
    diag_owners = [n for n in parameter_owners(model) if n not in layers]
    # Sharded over processes, the diagonal is each process's rows, as graftlab.fisher.diag forms them.
    diag, rows = accumulators(model, diag_owners)
    tokens, seen, share = 0, set(), {}
    statistics = _KfacPass(model, layers, mine, sums, diag, seen, share, rows)
    for ids, scored, predicts in _batches(rollouts, batch_size, pad_id, "KFAC statistics", device, positions):
        statistics.batch(ids, scored, predicts)
        tokens += int(predicts.sum())
    if unseen := sorted(set(diag_owners) - seen):
        # A weight used outside its module's forward (e.g. `hidden @ embed.weight.T`) is invisible to the
        # hooks: a zero Fisher would make the mask rank it least sensitive, so refuse instead.
        raise GraftlabError(f"no module call reached parameters {unseen[:3]}: their Fisher cannot be computed")
    # Divided in place, as every Fisher here: divided copies would be the job's peak memory.
    out = {k: v.div_(max(tokens, 1) if k.endswith(".A") else len(rollouts)) for k, v in sums.items()}
    for name, owner in share.items():  # one tensor object for a shared factor: the file stores it once
        if f"{owner}.A" in out:  # its layers' factors are this process's
            out[f"{name}.A"] = out[f"{owner}.A"]
    return out | {f"{n}.diag": f.div_(len(rollouts)) for n, f in diag.items()}


def kfac_fisher(
    model, rollouts, batch_size=16, pad_id=0, max_dim=8192, ekfac=False, positions="completion"
) -> dict[str, torch.Tensor]:
    """The KFAC file's tensors (docs/formats.md): `{weight}.A`, `.G`, their eigen-pairs (and `.ekfac`)
    for KFAC layers, `{param}.diag` for every other parameter; fp32."""
    if positions not in POSITIONS:
        raise GraftlabError(f"KFAC positions must be one of {list(POSITIONS)}, got {positions!r}")
    out = kfac_statistics(model, rollouts, batch_size, pad_id, max_dim, positions)
    every = kfac_layers(model, max_dim)
    layers = {name: m for name, m in every.items() if name in own_layers(every)}
    done: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # by factor object: a shared A once
    for name in layers:
        for f in ("A", "G"):
            factor = out[f"{name}.{f}"]
            if id(factor) not in done:
                done[id(factor)] = _eigh(factor)
            out[f"{name}.{f}_eigvals"], out[f"{name}.{f}_eigvecs"] = done[id(factor)]
    if ekfac:
        out |= _ekfac(model, rollouts, batch_size, pad_id, layers, out)
    return out


def _ekfac(model, rollouts, batch_size, pad_id, layers, factors) -> dict[str, torch.Tensor]:
    """`{weight}.ekfac = (1/N) sum_n (U_G^T g_n U_A)^2`, g_n rollout n's whole gradient of the weight."""
    fit = {
        name: factors[f"{name}.G"].new_zeros(factors[f"{name}.G"].shape[0], factors[f"{name}.A"].shape[0])
        for name in layers
    }
    ekfac = _EkfacPass(model, layers, factors, fit)
    for ids, scored, _ in _batches(rollouts, batch_size, pad_id, "EKFAC diagonal", model.device):
        ekfac.run(ids, scored)
    return {f"{name}.ekfac": f.div_(len(rollouts)) for name, f in fit.items()}


def shared_factors(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors to store, each shared A factor (and its eigen-pair) once under its first layer, and the
    `shared_A` map of every other layer reading it to that first one; sharing is by tensor object."""
    first: dict[int, str] = {}
    shared = {}
    for key, tensor in tensors.items():
        name, part = key.rsplit(".", 1)
        if part == "A" and first.setdefault(id(tensor), name) != name:
            shared[name] = first[id(tensor)]
    stored = {
        k: t for k, t in tensors.items() if not (k.rsplit(".", 1)[1] in A_PARTS and k.rsplit(".", 1)[0] in shared)
    }
    return stored, shared


def write_kfac_fisher(
    model_dir,
    rollouts_path,
    out_dir: Path,
    batch_size: int = 16,
    *,
    max_dim: int = 8192,
    ekfac: bool = False,
    positions: str = "completion",
    processes: int = 1,
) -> None:
    """`out_dir/kfac.safetensors`: the KFAC Fisher of the model at `model_dir` on its rollouts, into `out_dir`,
    a directory its caller makes whole at once (`graftlab.fisher.write_fisher`). Over `processes` (one per GPU:
    `graftlab.train.shard`) every process runs every rollout through the sharded model, forms the factors of
    the blocks dealt to it and the diagonal's rows it holds; the first writes the whole file."""
    from graftlab.io.provenance import write_provenance

    rollouts = checked_inputs(model_dir, rollouts_path)
    if positions not in POSITIONS:  # before the model loads
        raise GraftlabError(f"KFAC positions must be one of {list(POSITIONS)}, got {positions!r}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    options = (max_dim, ekfac, positions)
    if processes > 1:
        from graftlab.train.shard import launch

        launch(processes, _sharded_kfac, str(model_dir), rollouts, out_dir, batch_size, options)
    else:
        model = _load(model_dir).to(fisher_device())
        batch_size = fitting_batch(batch_size, rollouts, model, factor_bytes(model, max_dim), recompute=True)
        tensors = kfac_fisher(model, rollouts, batch_size, model.config.pad_token_id or 0, *options)
        _save(tensors, out_dir, len(rollouts), ekfac, positions)
    params = {"kind": "kfac", "rollouts": len(rollouts), "max_dim": max_dim, "ekfac": ekfac, "positions": positions}
    write_provenance(out_dir, {"model": model_dir, "rollouts": rollouts_path}, params)


def _save(tensors: dict, out_dir: Path, rollouts: int, ekfac: bool, positions: str) -> None:
    """`out_dir/kfac.safetensors`: each shared A once, the file's metadata (docs/formats.md)."""
    from safetensors.torch import save_file

    stored, shared = shared_factors(tensors)
    meta = {"format": FORMAT, "rollouts": str(rollouts), "ekfac": str(ekfac).lower(), "positions": positions}
    meta["shared_A"] = json.dumps(shared, sort_keys=True)
    save_file({k: v.cpu().contiguous() for k, v in stored.items()}, out_dir / "kfac.safetensors", metadata=meta)


def _sharded_kfac(model_dir: str, rollouts, out_dir: Path, batch_size: int, options: tuple) -> None:
    """One process of a sharded KFAC Fisher: its blocks' factors to a part file, the diagonal gathered;
    the first process merges the parts into `out_dir/kfac.safetensors`."""
    import torch.distributed as dist
    from safetensors.torch import load_file, safe_open, save_file

    from graftlab.fisher.diag import _whole
    from graftlab.train import shard

    max_dim, ekfac, positions = options
    model = shard.shard(_load(model_dir))
    factors = factor_bytes(model, max_dim)
    batch = int(shard.least(fitting_batch(batch_size, rollouts, model, factors, recompute=True)))
    tensors = kfac_fisher(model, rollouts, batch, model.config.pad_token_id or 0, *options)
    params = dict(model.named_parameters())
    diag = {k: _whole(t, params[k.removesuffix(".diag")].shape[0]) for k, t in tensors.items() if k.endswith(".diag")}
    layers = kfac_layers(model, max_dim)
    first: dict[int, str] = {}  # a shared A is one tensor object: its first layer owns it
    share = {n: first.setdefault(id(tensors[f"{n}.A"]), n) for n in layers if f"{n}.A" in tensors}

    def kept(key: str) -> bool:  # a shared A's parts once, under their first layer
        name, part = key.rsplit(".", 1)
        return not key.endswith(".diag") and (part not in A_PARTS or share[name] == name)

    own = {k: t.cpu().contiguous() for k, t in tensors.items() if kept(k)}
    rank, size = shard.world()
    save_file(own, out_dir / f".part-{rank}.safetensors", metadata={"share": json.dumps(share)})
    dist.barrier()
    if rank:
        return
    got, share = {}, {}
    for r in range(size):
        part = out_dir / f".part-{r}.safetensors"
        with safe_open(part, "pt") as f:
            share |= json.loads(f.metadata()["share"])
        got |= load_file(part)
        part.unlink()
    merged = {}
    for name in layers:  # in the layers' order: a shared A's first layer comes first, as one process writes it
        merged |= {f"{name}.{p}": got[f"{share[name]}.{p}"] for p in A_PARTS}  # one object: stored once
        own_parts = ("G", "G_eigvals", "G_eigvecs") + (("ekfac",) if ekfac else ())
        merged |= {f"{name}.{p}": got[f"{name}.{p}"] for p in own_parts}
    _save(merged | diag, out_dir, len(rollouts), ekfac, positions)
