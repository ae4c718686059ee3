"""The one pass both Fishers make over a batch of rollouts: a forward, then the gradient of the scored
log-likelihood taken down to the input embedding's output only (no weight gradient is ever formed), handing
every call of every watched module its input `x` and its output gradient `d`: `ModuleBackward._arrive`.

Each decoder layer is recomputed (torch's non-reentrant checkpoint): the forward keeps only each layer's
input, and the backward runs the layer's forward again just before it needs it. A module inside a layer
therefore meets its input in that recomputation (a pre-hook, flagged by the checkpoint's `context_fn`) and
its output gradient in the backward (a tensor hook on the first forward's output), in either order;
whichever comes second completes the pair. Activations are then each layer's input plus one layer's whole
set: an 8,704-token rollout of Qwen3-1.7B in fp32 keeps 2 GB of layer inputs where it kept 41 GB
(graftlab.memory). Modules outside the layers (the embedding, the final norm, the head) keep their input
from the forward.

Sequences are right-padded and run without an attention mask: under causal attention a pad only ever
follows the real tokens, so it cannot change their logits, and its own loss is masked out.
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from contextlib import nullcontext

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from graftlab.errors import GraftlabError
from graftlab.train.shard import decoder_layers


@contextlib.contextmanager
def _checkpointed(layers: list[nn.Module], contexts):
    """Each of `layers` run under torch's non-reentrant checkpoint for the duration, with `contexts` its
    `context_fn`. The layer's own `forward` is wrapped in place, not the module: a wrapper module would rename
    every parameter below it."""
    for layer in layers:
        layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False, context_fn=contexts)
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward  # the instance attribute: the class's forward again


class ModuleBackward:
    """One forward and backward a batch over `model`, pairing each call of the `watched` modules (by name)
    with its input and output gradient: `_arrive(name, x, d)`, rollouts on dim 0. `calls` counts each
    watched module's calls in the batch's forward."""

    def __init__(self, model: nn.Module, watched: dict[str, nn.Module]) -> None:
        self.model, self.modules = model, watched
        self.embedding = model.get_input_embeddings()
        self.embedding_name = next(n for n, m in model.named_modules() if m is self.embedding)
        layers = decoder_layers(model)
        # Modules inside a recomputed layer: they meet their input and output gradient in the backward.
        self.inside = {m for m in watched if any(m.startswith(f"{layer}.") for layer in layers)}
        self.layers = [model.get_submodule(layer) for layer in layers]
        self.recomputing = False

    def _arrive(self, m: str, x: torch.Tensor, d: torch.Tensor) -> None:
        raise NotImplementedError

    def run(self, ids: torch.Tensor, scored: torch.Tensor, autocast: torch.dtype | None = None) -> None:
        """The batch's forward under `autocast` (a dtype, or None), and its backward."""
        self.calls, roots = Counter(), []
        self.inputs: dict[str, list] = {m: [] for m in self.inside}
        self.grads: dict[str, list] = {m: [] for m in self.inside}
        handles = [module.register_forward_hook(self._hook(m)) for m, module in self.modules.items()]
        handles.append(self.embedding.register_forward_hook(lambda module, args, out: roots.append((args[0], out))))
        # Kept through the backward, where the layers are recomputed.
        recomputed = [self.modules[m].register_forward_pre_hook(self._recomputed(m)) for m in self.inside]
        amp = torch.autocast(ids.device.type, dtype=autocast) if autocast else nullcontext()
        try:
            # The whole layer recomputed (no early stop): every module inside it meets its input again.
            with amp, _checkpointed(self.layers, self._contexts), set_checkpoint_early_stop(False):
                logits = self.model(ids, use_cache=False).logits[:, :-1].float()
        finally:
            for h in handles:
                h.remove()
        if not roots:
            raise GraftlabError(f"{type(self.model).__name__}: its input embedding was not called by forward")
        loglik = (logits.log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0] * scored[:, 1:]).sum()
        # Gradients down to the embedding output only: every module's output gradient passes its hook on
        # the way, and the engine skips every weight gradient.
        try:
            grads = torch.autograd.grad(loglik, [out for _, out in roots], allow_unused=True)
        finally:
            for h in recomputed:
                h.remove()
        if self.embedding_name in self.modules:
            for (x, _), g in zip(roots, grads):
                if g is not None:
                    self._arrive(self.embedding_name, x.detach(), g)

    def _hook(self, m: str):
        def hook(module, args, output):
            if self.recomputing:
                return  # the backward's second run of a layer: its inputs are met by `_recomputed`
            self.calls[m] += 1
            if module is self.embedding or not (isinstance(output, torch.Tensor) and output.requires_grad):
                return  # the embedding's pair is made after the backward, from its output's gradient
            if m in self.inside:  # its input is not kept: the recomputation gives it again
                output.register_hook(lambda g: self._meet(m, self.grads, g))
            else:
                x = args[0].detach()
                output.register_hook(lambda g: self._arrive(m, x, g))

        return hook

    def _recomputed(self, m: str):
        def pre_hook(module, args):
            if self.recomputing:
                self._meet(m, self.inputs, args[0].detach())

        return pre_hook

    def _meet(self, m: str, arrived: dict, value: torch.Tensor) -> None:
        """An input (recomputed) or an output gradient of module `m`; with its partner already here, the
        pair arrives. A module is called once a layer run: the pairs come in order."""
        other = self.grads if arrived is self.inputs else self.inputs
        if not other[m]:
            arrived[m].append(value)
            return
        partner = other[m].pop(0)
        x, d = (value, partner) if arrived is self.inputs else (partner, value)
        self._arrive(m, x, d)

    @contextlib.contextmanager
    def _recomputing(self):
        self.recomputing = True
        try:
            yield
        finally:
            self.recomputing = False

    def _contexts(self):
        """torch's checkpoint `context_fn`: the first forward as it is; its recomputation flagged."""
        return nullcontext(), self._recomputing()
