"""KFAC factors against a direct computation, and KFAC masks against their definition (docs/methods.md#masks)."""

import json

import pytest
import torch
from conftest import graft_args
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_fisher import _rollouts
from torch import nn
from transformers import AutoModelForCausalLM

from graftlab.commands.cli import main
from graftlab.fisher import make_mask
from graftlab.fisher.diag import diag_fisher
from graftlab.fisher.kfac import kfac_fisher
from graftlab.fisher.kfac_mask import load_kfac_fisher
from graftlab.graft import graft


def _captured(model, prompt, completion):
    """One rollout alone, no padding: each linear layer's input a and output gradient d (autograd's
    `retain_grad`, not graftlab's hooks), and the whole gradient of every weight."""
    seen = {}

    def keep(name):
        def hook(module, args, out):
            out.retain_grad()
            seen[name] = (args[0].detach()[0], out)

        return hook

    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    handles = [m.register_forward_hook(keep(n)) for n, m in linears.items()]
    model.zero_grad()
    ids = torch.tensor([prompt + completion])
    logp = model(ids).logits[0, :-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
    logp[len(prompt) - 1 :].sum().backward()
    for h in handles:
        h.remove()
    grads = {n: m.weight.grad.clone() for n, m in linears.items()}
    return {n: (a, out.grad[0]) for n, (a, out) in seen.items()}, grads


def _direct_factors(model, rollouts):
    """A = mean over completion positions of a a^T; G = (1/N) sum_n sum_t d d^T; positions that predict a
    completion token are len(prompt)-1 .. len-2."""
    A, G, E, tokens = {}, {}, {}, 0
    for prompt, completion in rollouts:
        captured, grads = _captured(model, prompt, completion)
        rows = slice(len(prompt) - 1, len(prompt) + len(completion) - 1)
        tokens += len(completion)
        for name, (a, d) in captured.items():
            A[name] = A.get(name, 0) + a[rows].T @ a[rows]
            G[name] = G.get(name, 0) + d[rows].T @ d[rows]
            E.setdefault(name, []).append(grads[name])
    return {n: A[n] / tokens for n in A}, {n: G[n] / len(rollouts) for n in G}, E


def _close(x, y, rel=1e-5):
    return (x - y).abs().max() <= rel * y.abs().max()


@pytest.mark.parametrize("tied", [False, True])
def test_kfac_factors_equal_a_direct_computation(pico_model, tied):
    model = AutoModelForCausalLM.from_pretrained(pico_model("m", tie_word_embeddings=tied)).eval()
    rollouts = _rollouts(0, 9)  # uneven lengths, batches of 4 with a short last one
    got = kfac_fisher(model, rollouts, batch_size=4, ekfac=True)
    A, G, grads = _direct_factors(model, rollouts)
    layers = [n for n in A if not (tied and n == "lm_head")]  # a tied lm_head shares the embedding
    assert {k.rsplit(".", 2)[0] for k in got if k.endswith(".A")} == set(layers)
    for n in layers:
        w = f"{n}.weight"
        assert _close(got[f"{w}.A"], A[n]) and _close(got[f"{w}.G"], G[n]), n
        for f in ("A", "G"):  # the eigendecomposition reconstructs its factor
            vals, vecs = got[f"{w}.{f}_eigvals"], got[f"{w}.{f}_eigvecs"]
            assert _close(vecs @ torch.diag(vals) @ vecs.T, got[f"{w}.{f}"], 1e-4), (n, f)
        uG, uA = got[f"{w}.G_eigvecs"], got[f"{w}.A_eigvecs"]
        ekfac = torch.stack([(uG.T @ g @ uA).square() for g in grads[n]]).mean(0)
        assert _close(got[f"{w}.ekfac"], ekfac, 1e-4), n
    # Every other parameter gets the exact diagonal, as the per-example diag Fisher computes it.
    eager = AutoModelForCausalLM.from_pretrained(model.name_or_path, attn_implementation="eager").eval()
    diag = diag_fisher(eager, rollouts, 4)
    got_e = kfac_fisher(model, rollouts, batch_size=4, max_dim=0)  # every linear too wide: all diagonal
    assert {k.removesuffix(".diag") for k in got_e} == diag.keys()
    assert all(_close(got_e[f"{n}.diag"], diag[n]) for n in diag)


# --- masks ---------------------------------------------------------------------------------------


@pytest.fixture
def kfac_trio(pico_model, tmp_path, request):
    """post, donor and tuned pico models (tied embeddings: a diagonal entry in the KFAC file) and the
    post model's KFAC Fisher, written by the CLI; with EKFAC's re-fitted diagonal where the test's
    indirect parameter says so."""
    import polars as pl

    ekfac = ["--ekfac"] if getattr(request, "param", False) else []

    post = pico_model("post", seed=0, tie_word_embeddings=True)
    donor = pico_model("donor", seed=1, tie_word_embeddings=True)
    tuned = pico_model("tuned", base=donor, noise=0.05, seed=2)
    rollouts = _rollouts(5, 12)
    pl.DataFrame({"prompt_ids": [p for p, _ in rollouts], "completion_ids": [c for _, c in rollouts]}).write_parquet(
        tmp_path / "r.parquet"
    )
    assert (
        main(
            [
                "fisher",
                "--model",
                str(post),
                "--rollouts",
                str(tmp_path / "r.parquet"),
                "--kind",
                "kfac",
                "--out",
                str(tmp_path / "fisher"),
                *ekfac,
            ]
        )
        == 0
    )
    return post, donor, tuned, tmp_path / "fisher"


def _weights(path):
    return load_file(path / "model.safetensors")


def test_kfac_rho_zero_is_the_plain_graft_and_rho_one_keeps_post(kfac_trio, tmp_path):
    post, donor, tuned, fisher = kfac_trio
    graft(post, donor, tuned, 0.5, tmp_path / "plain")
    for rho, expected in ((0.0, _weights(tmp_path / "plain")), (1.0, _weights(post))):
        out = tmp_path / f"rho{rho}"
        graft(post, donor, tuned, 0.5, out, project=make_mask("kfac", fisher, post, donor, tuned, rho))
        got = _weights(out)
        assert all(torch.equal(got[n], expected[n]) for n in expected), rho


@pytest.mark.parametrize(
    ("scope", "score", "kfac_trio"),
    [
        ("global", "fisher_delta", False),
        ("tensor", "fisher_delta", False),
        ("global", "fisher", False),  # ranked by curvature alone: the update is rotated only to be masked
        ("global", "fisher_delta", True),  # EKFAC: the re-fitted diagonal is the curvature
        ("tensor", "fisher", True),
    ],
    indirect=["kfac_trio"],
    ids=["global", "tensor", "global-fisher", "global-ekfac", "tensor-fisher-ekfac"],
)
def test_kfac_mask_zeroes_the_top_scored_eigen_directions(kfac_trio, tmp_path, scope, score):
    post, donor, tuned, fisher = kfac_trio
    mask = make_mask("kfac", fisher, post, donor, tuned, 0.3, scope=scope, score=score)
    graft(post, donor, tuned, 1.0, tmp_path / "out", project=mask)
    report = json.loads((tmp_path / "out" / "graftlab.json").read_text())["mask"]
    out, p, d, t = (_weights(x) for x in (tmp_path / "out", post, donor, tuned))
    f = load_kfac_fisher(fisher, post)  # a shared A factor resolved to every layer reading it
    assert report["ekfac"] == any("ekfac" in e for e in f.values())
    kept, dropped, total, shapes = [], [], 0, set()
    for name in p:
        delta, applied, e = t[name] - d[name], out[name] - p[name], f[name]
        if "diag" in e:  # entry-wise, as the diagonal mask
            curvature, rotated, zeroed = e["diag"], delta, applied == 0
        else:  # in the eigenbasis: the applied update has exactly the masked directions removed
            uG, uA = e["G_eigvecs"], e["A_eigvecs"]
            rotated, rotated_out = uG.T @ delta @ uA, uG.T @ applied @ uA
            curvature = e["ekfac"] if "ekfac" in e else torch.outer(e["G_eigvals"], e["A_eigvals"])
            shapes.add(delta.shape[0] == delta.shape[1])
            zeroed = rotated_out.abs() <= 1e-5 * rotated.abs().max()
            assert torch.allclose(rotated_out[~zeroed], rotated[~zeroed], atol=1e-5 * rotated.abs().max())
        score_ = curvature * rotated.square() if score == "fisher_delta" else curvature
        assert int(zeroed.sum()) == report["masked_per_tensor"][name], name
        if scope == "tensor":
            assert report["masked_per_tensor"][name] == round(0.3 * score_.numel())
            assert score_[zeroed].min() >= score_[~zeroed].max()
        kept.append(score_[~zeroed]), dropped.append(score_[zeroed])
        total += score_.numel()
    assert report["total"] == total and report["kind"] == "kfac" and report["score"] == score
    assert shapes == {True, False}  # square layers, where a transposed rotation would not fail loudly, and others
    if scope == "global":
        assert report["masked"] == round(0.3 * total)
        assert torch.cat(dropped).min() >= torch.cat(kept).max()


def _orthogonal(n: int, gen: torch.Generator) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    return q.float()


def synthetic_kfac(ekfac: bool) -> tuple[dict, dict]:
    """KFAC entries of a square, a wide and a tall layer (random eigenbases, distinct eigenvalues, and with
    `ekfac` a re-fitted diagonal unrelated to them) and a parameter with a diagonal; an update for each."""
    gen = torch.Generator().manual_seed(7)
    entries, deltas = {}, {}
    for name, (rows, cols) in {"square": (6, 6), "wide": (4, 7), "tall": (7, 3)}.items():
        e = {}
        for factor, n in (("G", rows), ("A", cols)):
            vecs, vals = _orthogonal(n, gen), torch.rand(n, generator=gen) + 0.1
            e |= {factor: vecs @ torch.diag(vals) @ vecs.T, f"{factor}_eigvals": vals, f"{factor}_eigvecs": vecs}
        if ekfac:
            e["ekfac"] = torch.rand(rows, cols, generator=gen) + 0.1
        entries[name], deltas[name] = e, torch.randn(rows, cols, generator=gen)
    entries["norm"], deltas["norm"] = {"diag": torch.rand(5, generator=gen) + 0.1}, torch.randn(5, generator=gen)
    return entries, deltas


def direct_kfac_mask(entries: dict, deltas: dict, rho: float, score: str) -> dict[str, torch.Tensor]:
    """docs/methods.md#masks written out for a global ranking without ties: D = U_G^T dW U_A scored by
    l_G[i] l_A[j] D_ij^2 (the EKFAC diagonal in place of l_G l_A when present; the curvature alone with
    `score: fisher`), a diagonal entry by F delta^2; the top round(rho * total) zeroed; dW' = U_G (M * D) U_A^T."""
    rotated, scores = {}, {}
    for name, e in entries.items():
        if "diag" in e:
            rotated[name], curvature = deltas[name], e["diag"]
        else:
            rotated[name] = e["G_eigvecs"].T @ deltas[name] @ e["A_eigvecs"]
            curvature = e["ekfac"] if "ekfac" in e else torch.outer(e["G_eigvals"], e["A_eigvals"])
        scores[name] = curvature * rotated[name].square() if score == "fisher_delta" else curvature
    flat = torch.cat([s.flatten() for s in scores.values()])
    k = round(rho * flat.numel())
    threshold = flat.sort(descending=True).values[k - 1]
    assert int((flat >= threshold).sum()) == k  # no ties: the masked set is unique
    out = {}
    for name, e in entries.items():
        kept = torch.where(scores[name] >= threshold, torch.zeros_like(rotated[name]), rotated[name])
        out[name] = kept if "diag" in e else e["G_eigvecs"] @ kept @ e["A_eigvecs"].T
    return out


@pytest.mark.parametrize("ekfac", [False, True], ids=["kfac", "ekfac"])
@pytest.mark.parametrize("score", ["fisher_delta", "fisher"])
def test_kfac_mask_equals_the_eigenbasis_definition_on_square_and_non_square_layers(score, ekfac):
    from graftlab.fisher.kfac_mask import KfacMask

    entries, deltas = synthetic_kfac(ekfac)
    want = direct_kfac_mask(entries, deltas, 0.3, score)
    if ekfac:  # the re-fitted diagonal ranks otherwise than l_G l_A: ignoring it would show
        plain = {n: {p: v for p, v in e.items() if p != "ekfac"} for n, e in entries.items()}
        assert any(not torch.allclose(want[n], w) for n, w in direct_kfac_mask(plain, deltas, 0.3, score).items())
    mask = KfacMask(entries, 0.3, score=score, deltas=deltas if score == "fisher_delta" else None)
    for name, delta in deltas.items():
        torch.testing.assert_close(mask(name, delta.clone()), want[name], rtol=1e-5, atol=1e-5, msg=name)
    assert mask.report()["masked"] == round(0.3 * mask.total) and mask.report()["ekfac"] == ekfac


def _kfac_cli(post, donor, tuned, out, fisher, rho="0.5"):
    return main(
        ["graft", *graft_args(post, donor, tuned, "1", out), "--fisher", str(fisher), "--mask", "kfac", "--rho", rho]
    )


def test_bad_kfac_input_is_a_one_line_error_without_output(kfac_trio, tmp_path, pico_model, capsys):
    post, donor, tuned, fisher = kfac_trio
    capsys.readouterr()
    assert _kfac_cli(post, donor, tuned, tmp_path / "o1", fisher, rho="-0.1") == 2  # the command line's
    assert "--rho: must be >= 0, got '-0.1'" in capsys.readouterr().err
    with safe_open(str(fisher / "kfac.safetensors"), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    broken = {
        "nan": {**tensors, "model.layers.0.mlp.up_proj.weight.G_eigvals": torch.full((32,), float("nan"))},
        "missing": {k: v for k, v in tensors.items() if not k.startswith("model.norm.weight")},
    }
    for case, content in broken.items():
        (tmp_path / case).mkdir()
        save_file(content, tmp_path / case / "kfac.safetensors", metadata=meta)
    messages = {"nan": "holds NaN or Inf", "missing": "missing ['model.norm.weight']"}
    for i, case in enumerate(broken, start=2):
        assert _kfac_cli(post, donor, tuned, tmp_path / f"o{i}", tmp_path / case) == 1  # the data's
        err = capsys.readouterr().err
        assert messages[case] in err and err.count("\n") == 1, err
    other = pico_model("other", hidden_size=32, head_dim=16, tie_word_embeddings=True)
    assert _kfac_cli(other, other, other, tmp_path / "o4", fisher) == 1
    assert "computed for another architecture" in capsys.readouterr().err
    assert not any((tmp_path / f"o{i}").exists() for i in range(1, 5))


def test_a_parameter_no_module_call_reaches_is_refused_not_given_zero_fisher(pico_model):
    from graftlab.errors import GraftlabError

    model = AutoModelForCausalLM.from_pretrained(pico_model("m")).eval()
    model.model.unused = nn.LayerNorm(16)  # in named_parameters, never called by forward
    with pytest.raises(GraftlabError, match="model.unused.weight"):
        kfac_fisher(model, _rollouts(0, 3), batch_size=4)


def test_kfac_factors_over_all_positions_equal_a_direct_computation(pico_model):
    """`positions="all"`: A and G count every real token, prompt included."""
    model = AutoModelForCausalLM.from_pretrained(pico_model("m")).eval()
    rollouts = _rollouts(1, 7)
    got = kfac_fisher(model, rollouts, batch_size=3, positions="all")
    A, G, tokens = {}, {}, 0
    for prompt, completion in rollouts:
        captured, _ = _captured(model, prompt, completion)
        tokens += len(prompt) + len(completion)
        for name, (a, d) in captured.items():
            A[name], G[name] = A.get(name, 0) + a.T @ a, G.get(name, 0) + d.T @ d
    for n in A:
        assert _close(got[f"{n}.weight.A"], A[n] / tokens) and _close(got[f"{n}.weight.G"], G[n] / len(rollouts)), n
    with pytest.raises(Exception, match="positions must be one of"):
        kfac_fisher(model, rollouts, positions="prompt")
