"""Fisher and masks at scale (issue 15, item 3): the streamed radix-select threshold against the former exact
path (every score concatenated, kthvalue), bit for bit on the grafted output; the KFAC file storing a shared
A factor once, smaller by what the shapes predict and grafting exactly as the per-weight layout does."""

import json
import math

import polars as pl
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_fisher import _rollouts
from test_kfac import direct_kfac_mask
from transformers import AutoModelForCausalLM

from graftlab.errors import GraftlabError
from graftlab.fisher import make_mask
from graftlab.fisher.kfac import A_PARTS, write_kfac_fisher
from graftlab.fisher.kfac_mask import KfacMask, load_kfac_fisher
from graftlab.fisher.masks import DiagMask, FisherMask, _bucket_of, _keys, load_diag_fisher, read_deltas
from graftlab.graft import graft


def _kthvalue_threshold(mask: FisherMask, deltas) -> None:
    """The former exact global threshold: every score held at once, the k-th largest by kthvalue."""
    k = round(mask.rho * mask.total)
    flat = torch.cat([mask._score(n, None if deltas is None else deltas[n])[0].flatten() for n in mask.sizes])
    mask.threshold = flat.kthvalue(mask.total - k + 1).values.item() if k else math.inf
    mask.ties_left = k - int((flat > mask.threshold).sum()) if k else 0


@pytest.mark.parametrize("keep", [0, 2000, 2**24])  # pass 2 rescoring every tensor, some, none
def test_radix_select_finds_the_kth_largest_with_ties_zeros_and_negatives(monkeypatch, keep):
    import graftlab.fisher.masks as masks

    monkeypatch.setattr(masks, "KEEP_KEYS", keep)
    gen = torch.Generator().manual_seed(0)
    base = torch.rand(3000, generator=gen)
    values = torch.cat(
        [
            base,
            base[:500],  # ties everywhere
            torch.full((700,), 0.25),  # a block of ties
            torch.zeros(300),
            -torch.zeros(200),  # -0.0 equals 0.0 and must rank with it
            -torch.rand(100, generator=gen),  # negative scores order too
            0.5 + torch.arange(64) * 2**-24,  # differ only in the lowest bits: the second pass decides
        ]
    )
    values = values[torch.randperm(len(values), generator=gen)]
    parts = {f"t{i}": chunk for i, chunk in enumerate(values.split(777))}
    scored = []
    for k in (1, 2, 64, 500, 1234, 3700, 4300, 4600, len(values) - 1, len(values)):
        mask = DiagMask({n: torch.ones_like(v) for n, v in parts.items()}, 0.0, scope="tensor")
        mask.rho, mask.scope = k / len(values), "global"
        scored.clear()
        mask._global_threshold(lambda n: scored.append(n) or parts[n])
        # 2000 keeps the first two 777-entry tensors and the last of 202; the other four are scored again.
        assert len(scored) == len(parts) + {0: len(parts), 2000: 4, 2**24: 0}[keep]
        expected = values.kthvalue(len(values) - k + 1).values.item()
        assert mask.threshold == expected, k
        assert mask.ties_left == k - int((values > expected).sum()), k
    assert _bucket_of(torch.tensor([0, 3, 0, 2]), 3) == (1, 2)
    assert torch.equal(_keys(torch.tensor([-0.0])), _keys(torch.tensor([0.0])))


def _models(pico_model):
    post = pico_model("post", seed=0, tie_word_embeddings=True)
    donor = pico_model("donor", seed=1, tie_word_embeddings=True)
    return post, donor, pico_model("tuned", base=donor, noise=0.05, seed=2)


def _diag_fisher_with_ties(post, out):
    """A Fisher for post with a third of every tensor tied, where a 30% threshold falls."""
    gen = torch.Generator().manual_seed(3)
    fisher = {}
    for name, p in AutoModelForCausalLM.from_pretrained(post).named_parameters():
        f = torch.rand(p.shape, generator=gen)
        f.view(-1)[: f.numel() // 3] = 0.9
        fisher[name] = f
    out.mkdir()
    save_file(fisher, out / "diag.safetensors")
    return out


def _kfac_fisher(post, tmp_path):
    rollouts = _rollouts(5, 12)
    frame = pl.DataFrame({"prompt_ids": [p for p, _ in rollouts], "completion_ids": [c for _, c in rollouts]})
    frame.write_parquet(tmp_path / "r.parquet")
    write_kfac_fisher(post, tmp_path / "r.parquet", tmp_path / "kfac")
    return tmp_path / "kfac"


@pytest.mark.parametrize("kind", ["diag", "kfac"])
def test_streamed_mask_grafts_bit_for_bit_as_the_former_exact_mask(pico_model, tmp_path, kind):
    post, donor, tuned = _models(pico_model)
    fisher = _diag_fisher_with_ties(post, tmp_path / "diag") if kind == "diag" else _kfac_fisher(post, tmp_path)
    load, cls = (load_diag_fisher, DiagMask) if kind == "diag" else (load_kfac_fisher, KfacMask)
    for scope, score, rho in [
        ("global", "fisher_delta", 0.3),
        ("global", "fisher", 0.3),
        ("tensor", "fisher_delta", 0.3),
    ]:
        streamed = make_mask(kind, fisher, post, donor, tuned, rho, scope, score)
        deltas = read_deltas(donor, tuned, streamed.sizes) if score == "fisher_delta" else None
        former = cls(load(fisher, post), rho, scope="tensor", score=score)  # no threshold computed yet
        former.scope = scope
        if scope == "global":
            _kthvalue_threshold(former, deltas)
            assert (streamed.threshold, streamed.ties_left) == (former.threshold, former.ties_left)
        outs = []
        for name, mask in (("streamed", streamed), ("former", former)):
            graft(post, donor, tuned, 1.0, tmp_path / f"{kind}-{scope}-{score}-{name}", project=mask)
            outs.append(load_file(tmp_path / f"{kind}-{scope}-{score}-{name}" / "model.safetensors"))
        assert all(torch.equal(outs[0][n], outs[1][n]) for n in outs[0]), (scope, score)
        assert streamed.report() == former.report()
        if scope == "global":
            assert streamed.report()["masked"] == round(rho * streamed.total)
        if kind == "kfac" and scope == "global":
            # Streamed and former share the eigenbasis code: both are held to the definition itself, on
            # this model's square and non-square layers alike.
            names = list(streamed.sizes)
            want = direct_kfac_mask(load(fisher, post), read_deltas(donor, tuned, names), rho, score)
            post_w = load_file(post / "model.safetensors")
            for n in names:
                torch.testing.assert_close(outs[0][n] - post_w[n], want[n], rtol=1e-4, atol=1e-6, msg=n)
    if kind == "diag":  # the tied block is where the curvature-only threshold falls: ties were broken
        assert make_mask(kind, fisher, post, donor, tuned, 0.3, "global", "fisher").threshold == pytest.approx(0.9)


def _data_bytes(path) -> int:
    with safe_open(str(path), framework="pt") as f:
        return sum(4 * math.prod(f.get_slice(k).get_shape()) for k in f.keys())


def test_kfac_file_stores_a_shared_input_factor_once_and_grafts_as_the_per_weight_layout(pico_model, tmp_path):
    post, donor, tuned = _models(pico_model)
    fisher = _kfac_fisher(post, tmp_path)
    path = fisher / "kfac.safetensors"
    with safe_open(str(path), framework="pt") as f:
        meta, stored = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    assert meta["format"] == "graftlab-kfac/2"
    config = json.loads((post / "config.json").read_text())
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    shared = json.loads(meta["shared_A"])
    expected = {}
    for i in range(layers):
        attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        expected |= {f"{attn}.{p}_proj.weight": f"{attn}.q_proj.weight" for p in "kv"}
        expected[f"{mlp}.up_proj.weight"] = f"{mlp}.gate_proj.weight"
    assert shared == expected
    # Per shared layer, A (h x h), its eigenvalues (h) and eigenvectors (h x h) are not stored: fp32 bytes.
    per_weight = dict(stored)
    for name, owner in shared.items():
        per_weight |= {f"{name}.{p}": stored[f"{owner}.{p}"].clone() for p in A_PARTS}
    (tmp_path / "v1").mkdir()
    save_file(per_weight, tmp_path / "v1" / "kfac.safetensors", metadata=meta | {"format": "graftlab-kfac/1"})
    saved = _data_bytes(tmp_path / "v1" / "kfac.safetensors") - _data_bytes(path)
    assert saved == 4 * 3 * layers * (2 * hidden * hidden + hidden)
    # The loader gives every layer of a group the one stored factor, and the masks graft identically.
    entries = load_kfac_fisher(fisher, post)
    assert (
        entries["model.layers.0.self_attn.k_proj.weight"]["A_eigvecs"]
        is (entries["model.layers.0.self_attn.q_proj.weight"]["A_eigvecs"])
    )
    for scope in ("global", "tensor"):
        outs = []
        for layout in (fisher, tmp_path / "v1"):
            out = tmp_path / f"{layout.name}-{scope}"
            graft(post, donor, tuned, 1.0, out, project=make_mask("kfac", layout, post, donor, tuned, 0.3, scope))
            outs.append(load_file(out / "model.safetensors"))
        assert all(torch.equal(outs[0][n], outs[1][n]) for n in outs[0]), scope
    # A file naming a sharer whose owner it lacks, or of an unknown format, is refused by name.
    (tmp_path / "bad").mkdir()
    owner = "model.layers.0.self_attn.q_proj.weight"
    save_file({k: v for k, v in stored.items() if not k.startswith(owner)}, tmp_path / "bad" / "kfac.safetensors", meta)
    with pytest.raises(GraftlabError, match="k_proj.weight shares the A factor of .*q_proj.weight, which it lacks"):
        load_kfac_fisher(tmp_path / "bad", post)
    save_file(stored, tmp_path / "bad" / "kfac.safetensors", meta | {"format": "graftlab-kfac/0"})
    with pytest.raises(GraftlabError, match="is not a graftlab-kfac/2 file"):
        load_kfac_fisher(tmp_path / "bad", post)
