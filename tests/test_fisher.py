"""Diagonal retention Fisher against a per-example autograd loop on a pico model."""

import json

import polars as pl
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from graftlab.errors import GraftlabError
from graftlab.fisher import write_fisher
from graftlab.fisher.diag import diag_fisher, write_diag_fisher


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


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("tied", [False, True])
def test_diag_fisher_equals_per_example_loop(pico_model, attn, tied):
    """The hook path is exact under any attention, a tied embedding's two uses summed before squaring."""
    path = pico_model("m", tie_word_embeddings=tied)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn).eval()
    rollouts = _rollouts(0, 11)  # uneven lengths and a last batch smaller than the batch size
    fast = diag_fisher(model, rollouts, batch_size=4)
    slow = _loop_fisher(model, rollouts)
    assert fast.keys() == slow.keys()
    for name in slow:
        scale = slow[name].abs().max()
        assert (fast[name] - slow[name]).abs().max() <= 1e-5 * scale, name


def test_diag_fisher_in_small_chunks_and_under_bf16_autocast(pico_model, monkeypatch):
    """Per-rollout gradients a few rows at a time give the same Fisher; a bf16 autocast forward stays
    within bf16's percent-level error of the fp32 one (and is not silently fp32)."""
    import graftlab.fisher.diag as diag

    model = AutoModelForCausalLM.from_pretrained(pico_model("m"), attn_implementation="sdpa").eval()
    rollouts = _rollouts(2, 7)
    whole = diag_fisher(model, rollouts, batch_size=7)
    monkeypatch.setattr(diag, "CHUNK_FLOATS", 40)  # a few output rows of one rollout's gradient at a time
    chunked = diag_fisher(model, rollouts, batch_size=7)
    assert all(torch.allclose(chunked[n], whole[n], rtol=1e-5, atol=0) for n in whole)
    bf16 = diag_fisher(model, rollouts, batch_size=7, autocast=torch.bfloat16)
    errors = [((bf16[n] - whole[n]).abs().max() / whole[n].abs().max()).item() for n in whole]
    assert 0 < max(errors) < 0.1


def test_written_fisher_is_named_like_the_weights(pico_model, tmp_path):
    path = pico_model("m")
    pl.DataFrame(
        {"prompt_ids": [p for p, _ in _rollouts(1, 5)], "completion_ids": [c for _, c in _rollouts(1, 5)]}
    ).write_parquet(tmp_path / "r.parquet")
    write_diag_fisher(path, tmp_path / "r.parquet", tmp_path / "fisher")
    fisher = load_file(tmp_path / "fisher" / "diag.safetensors")
    weights = dict(AutoModelForCausalLM.from_pretrained(path).named_parameters())
    assert fisher.keys() == weights.keys()
    assert all(fisher[n].shape == weights[n].shape and fisher[n].dtype == torch.float32 for n in fisher)
    assert all(torch.isfinite(f).all() and (f >= 0).all() for f in fisher.values())


@pytest.mark.workflow  # two real processes: the slow tier
@pytest.mark.parametrize("tied", [False, True])
def test_a_diag_fisher_sharded_over_two_processes_is_the_one_process_fisher(pico_model, tmp_path, tied, monkeypatch):
    """Both processes run every rollout through the sharded model (gloo here, graftlab.train.shard); each
    forms the gradients of the rows it holds, an odd vocabulary split unevenly, and the first writes the
    whole Fisher: the one process's, within fp32 rounding."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    path = pico_model("m", tie_word_embeddings=tied, vocab_size=33, intermediate_size=24)
    rollouts = _rollouts(2, 9)
    frame = pl.DataFrame({"prompt_ids": [p for p, _ in rollouts], "completion_ids": [c for _, c in rollouts]})
    frame.write_parquet(tmp_path / "r.parquet")
    write_fisher("diag", path, tmp_path / "r.parquet", tmp_path / "one", batch_size=4)
    write_fisher("diag", path, tmp_path / "r.parquet", tmp_path / "two", batch_size=4, processes=2)
    one, two = (load_file(tmp_path / d / "diag.safetensors") for d in ("one", "two"))
    assert one.keys() == two.keys() and "model.embed_tokens.weight" in one
    for name in one:
        assert torch.allclose(one[name], two[name], rtol=1e-5, atol=1e-12), name


@pytest.mark.workflow  # two real processes: the slow tier
def test_a_kfac_fisher_sharded_over_two_processes_is_the_one_process_fisher(pico_model, tmp_path, monkeypatch):
    """Each process forms the factors of the blocks dealt to it (and their eigen-pairs, and EKFAC's fit) and
    the diagonal's rows it holds; the first merges them into the one process's file: the same tensors within
    fp32 rounding, a shared A stored once under the same layer, the same metadata."""
    from safetensors import safe_open

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    path = pico_model("m", tie_word_embeddings=True, vocab_size=33)
    rollouts = _rollouts(3, 9)
    frame = pl.DataFrame({"prompt_ids": [p for p, _ in rollouts], "completion_ids": [c for _, c in rollouts]})
    frame.write_parquet(tmp_path / "r.parquet")
    for out, processes in (("one", 1), ("two", 2)):
        write_fisher(
            "kfac", path, tmp_path / "r.parquet", tmp_path / out, batch_size=4, processes=processes, ekfac=True
        )
    one, two = (load_file(tmp_path / d / "kfac.safetensors") for d in ("one", "two"))
    assert one.keys() == two.keys() and any(k.endswith(".ekfac") for k in one)
    for name in one:
        # An eigenvector is defined up to its sign: compared in absolute value.
        a, b = (one[name], two[name]) if not name.endswith("eigvecs") else (one[name].abs(), two[name].abs())
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-7), name
    metadata = [safe_open(tmp_path / d / "kfac.safetensors", "pt").metadata() for d in ("one", "two")]
    assert metadata[0] == metadata[1] and json.loads(metadata[0]["shared_A"])  # q/k/v share one A
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == sorted(p.name for p in (tmp_path / "one").iterdir())


def test_rollouts_without_required_columns_are_refused(pico_model, tmp_path):
    pl.DataFrame({"prompt_ids": [[1, 2]]}).write_parquet(tmp_path / "r.parquet")
    with pytest.raises(GraftlabError, match="rollouts .* lacks columns \\['completion_ids'\\]"):
        write_diag_fisher(pico_model("m"), tmp_path / "r.parquet", tmp_path / "fisher")
    assert not (tmp_path / "fisher").exists()


# --- masks ---------------------------------------------------------------------------------------


from conftest import graft_args  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from graftlab.commands.cli import main  # noqa: E402
from graftlab.fisher import make_mask  # noqa: E402
from graftlab.graft import graft  # noqa: E402


@pytest.fixture
def trio(pico_model, tmp_path):
    """post, donor, tuned pico models and a Fisher for post with many tied (zero and equal) entries."""
    post = pico_model("post", seed=0)
    donor = pico_model("donor", seed=1)
    tuned = pico_model("tuned", base=donor, noise=0.05, seed=2)
    gen = torch.Generator().manual_seed(3)
    fisher = {}
    for name, p in AutoModelForCausalLM.from_pretrained(post).named_parameters():
        f = torch.rand(p.shape, generator=gen)
        f.view(-1)[: f.numel() // 3] = 0.9  # a third of every tensor ties, where the 30% threshold falls
        fisher[name] = f
    (tmp_path / "fisher").mkdir()
    save_file(fisher, tmp_path / "fisher" / "diag.safetensors")
    return post, donor, tuned, tmp_path / "fisher", fisher


def _weights(path):
    return load_file(path / "model.safetensors")


def test_rho_zero_is_the_plain_graft_and_rho_one_keeps_post(trio, tmp_path):
    post, donor, tuned, fisher_dir, _ = trio
    graft(post, donor, tuned, 0.5, tmp_path / "plain")
    for rho, expected in ((0.0, _weights(tmp_path / "plain")), (1.0, _weights(post))):
        out = tmp_path / f"rho{rho}"
        graft(post, donor, tuned, 0.5, out, project=make_mask("diag", fisher_dir, post, donor, tuned, rho))
        got = _weights(out)
        assert all(torch.equal(got[n], expected[n]) for n in expected), rho


def _expected_global_mask(scores: dict[str, torch.Tensor], rho: float) -> tuple[dict[str, torch.Tensor], float]:
    """The documented global ranking, by hand: every score above the k-th largest (k = round(rho * total))
    masked, and of the scores equal to it the first ones in graft order (`scores`' order, then row-major)
    until exactly k are masked. Returns the masks and the threshold."""
    flat = torch.cat([s.flatten() for s in scores.values()])
    k = round(rho * flat.numel())
    threshold = flat.sort(descending=True).values[k - 1]
    masked = flat > threshold
    masked[(flat == threshold).nonzero()[:, 0][: k - int(masked.sum())]] = True
    parts = masked.split([s.numel() for s in scores.values()])
    return {n: m.view(s.shape) for (n, s), m in zip(scores.items(), parts)}, threshold.item()


@pytest.mark.parametrize("score", ["fisher_delta", "fisher"])
def test_global_mask_zeroes_exactly_round_rho_total_of_the_top_scores(trio, tmp_path, score):
    post, donor, tuned, fisher_dir, fisher = trio
    mask = make_mask("diag", fisher_dir, post, donor, tuned, 0.3, score=score)
    graft(post, donor, tuned, 1.0, tmp_path / "out", project=mask)
    total = sum(f.numel() for f in fisher.values())
    record = json.loads((tmp_path / "out" / "graftlab.json").read_text())["mask"]
    assert record["masked"] == round(0.3 * total) == sum(record["masked_per_tensor"].values())
    out, p, d, t = (_weights(x) for x in (tmp_path / "out", post, donor, tuned))
    order = list(record["masked_per_tensor"])  # the order the graft visited the tensors in
    scores = {n: fisher[n] * (t[n] - d[n]).square() if score == "fisher_delta" else fisher[n] for n in order}
    expected, threshold = _expected_global_mask(scores, 0.3)
    assert record["threshold"] == pytest.approx(threshold, rel=1e-6)
    flat = torch.cat([s.flatten() for s in scores.values()])
    if score == "fisher":  # the fixture's tied block straddles the threshold: some ties masked, some kept
        assert 0 < round(0.3 * total) - int((flat > threshold).sum()) < int((flat == threshold).sum())
    for name in order:
        delta = t[name] - d[name]
        masked = out[name] == p[name]  # the update was zeroed here (delta is never exactly 0 here)
        assert torch.equal(masked, expected[name]), name
        assert torch.allclose(out[name][~masked], (p[name] + delta)[~masked], atol=1e-6)


def test_by_default_a_diag_mask_ranks_by_the_predicted_rise_of_the_retention_loss(trio, tmp_path):
    """docs/methods.md#masks: unless `score: fisher` is asked for, the score is F * delta^2. Checked with a
    Fisher without ties, whose F-only ranking differs, for the library's entry points and the command line."""
    from graftlab.fisher.masks import DiagMask, load_diag_fisher, read_deltas

    post, donor, tuned, _, _ = trio
    gen = torch.Generator().manual_seed(4)
    fisher = {n: torch.rand(w.shape, generator=gen) + 1e-3 for n, w in _weights(post).items()}
    (tmp_path / "untied").mkdir()
    save_file(fisher, tmp_path / "untied" / "diag.safetensors")
    d, t = _weights(donor), _weights(tuned)
    delta = {n: t[n] - d[n] for n in fisher}
    expected, _ = _expected_global_mask({n: fisher[n] * delta[n].square() for n in fisher}, 0.3)
    f_only, _ = _expected_global_mask(fisher, 0.3)
    assert any(not torch.equal(expected[n], f_only[n]) for n in fisher)
    masks = {
        "make_mask": make_mask("diag", tmp_path / "untied", post, donor, tuned, 0.3),
        "DiagMask": DiagMask(
            load_diag_fisher(tmp_path / "untied", post), 0.3, deltas=read_deltas(donor, tuned, fisher)
        ),
    }
    for how, mask in masks.items():
        for name in fisher:
            want = torch.where(expected[name], torch.zeros_like(delta[name]), delta[name])
            assert torch.equal(mask(name, delta[name].clone()), want), (how, name)
        assert mask.report()["score"] == "fisher_delta"
    assert _cli(post, donor, tuned, tmp_path / "cli", tmp_path / "untied", rho="0.3") == 0
    out, p = _weights(tmp_path / "cli"), _weights(post)
    assert all(torch.equal(out[n] == p[n], expected[n]) for n in fisher)
    assert json.loads((tmp_path / "cli" / "graftlab.json").read_text())["mask"]["score"] == "fisher_delta"


def test_per_tensor_mask_zeroes_round_rho_of_each_tensor(trio, tmp_path):
    post, donor, tuned, fisher_dir, fisher = trio
    mask = make_mask("diag", fisher_dir, post, donor, tuned, 0.25, scope="tensor")
    graft(post, donor, tuned, 1.0, tmp_path / "out", project=mask)
    assert mask.report()["masked_per_tensor"] == {n: round(0.25 * f.numel()) for n, f in fisher.items()}


def _cli(post, donor, tuned, out, fisher_dir, rho="0.5"):
    return main(
        [
            "graft",
            *graft_args(post, donor, tuned, "1", out),
            "--fisher",
            str(fisher_dir),
            "--mask",
            "diag",
            "--rho",
            rho,
        ]
    )


def test_bad_masks_are_one_line_errors_without_output(trio, tmp_path, pico_model, capsys):
    post, donor, tuned, fisher_dir, fisher = trio
    assert _cli(post, donor, tuned, tmp_path / "o1", fisher_dir, rho="1.5") == 2  # the command line's
    assert "--rho: must be <= 1, got '1.5'" in capsys.readouterr().err
    nan = dict(fisher)
    nan[next(iter(nan))] = torch.full_like(nan[next(iter(nan))], float("nan"))
    (tmp_path / "nan").mkdir()
    save_file(nan, tmp_path / "nan" / "diag.safetensors")
    assert _cli(post, donor, tuned, tmp_path / "o2", tmp_path / "nan") == 1  # the data's
    assert "holds NaN or Inf" in capsys.readouterr().err
    other = pico_model("other", hidden_size=32, head_dim=16)
    (tmp_path / "wide").mkdir()
    save_file(
        {n: torch.ones_like(p) for n, p in AutoModelForCausalLM.from_pretrained(other).named_parameters()},
        tmp_path / "wide" / "diag.safetensors",
    )
    assert _cli(post, donor, tuned, tmp_path / "o3", tmp_path / "wide") == 1
    assert "computed for another architecture" in capsys.readouterr().err
    assert not any((tmp_path / f"o{i}").exists() for i in (1, 2, 3))


def test_fisher_cli_writes_the_fisher_and_refuses_bad_rollouts(pico_model, tmp_path, capsys):
    path = pico_model("m")
    rollouts = _rollouts(4, 6)
    frame = pl.DataFrame({"prompt_ids": [p for p, _ in rollouts], "completion_ids": [c for _, c in rollouts]})
    frame.write_parquet(tmp_path / "r.parquet")
    assert (
        main(["fisher", "--model", str(path), "--rollouts", str(tmp_path / "r.parquet"), "--out", str(tmp_path / "f")])
        == 0
    )
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    expected = _loop_fisher(model, rollouts)
    got = load_file(tmp_path / "f" / "diag.safetensors")
    assert all((got[n] - expected[n]).abs().max() <= 1e-5 * expected[n].abs().max() for n in expected)
    frame.drop("completion_ids").write_parquet(tmp_path / "bad.parquet")
    capsys.readouterr()  # the progress bars of the good run
    assert (
        main(
            ["fisher", "--model", str(path), "--rollouts", str(tmp_path / "bad.parquet"), "--out", str(tmp_path / "g")]
        )
        == 1
    )
    err = capsys.readouterr().err
    assert err.startswith("graftlab: error:") and err.count("\n") == 1 and "lacks columns ['completion_ids']" in err
    assert not (tmp_path / "g").exists()


def test_cli_global_mask_masks_exactly_rho_of_the_entries(trio, tmp_path):
    """The streamed radix select is exact at any size: round(rho * total) entries, no sampled quantile."""
    post, donor, tuned, fisher_dir, fisher = trio
    mask = ["--fisher", str(fisher_dir), "--mask", "diag", "--rho", "0.3"]
    assert main(["graft", *graft_args(post, donor, tuned, "1", tmp_path / "exact"), *mask]) == 0
    record = json.loads((tmp_path / "exact" / "graftlab.json").read_text())["mask"]
    assert record["masked"] == round(0.3 * record["total"])


def test_the_fisher_registry_is_what_the_command_line_offers_and_refuses_foreign_options(tmp_path):
    from graftlab.commands.cli import build_parser
    from graftlab.fisher import FISHERS, KINDS, write_fisher

    actions = {a.dest: a for p in build_parser()._subparsers._group_actions[0].choices.values() for a in p._actions}
    assert tuple(actions["kind"].choices) == KINDS == tuple(FISHERS)
    assert tuple(actions["mask"].choices) == ("none", *KINDS)
    with pytest.raises(GraftlabError, match=r"options \['max_dim'\] do not apply to Fisher kind diag"):
        write_fisher("diag", tmp_path, tmp_path / "r.parquet", tmp_path / "out", max_dim=8)
    with pytest.raises(GraftlabError, match=r"unknown Fisher kind 'ekfac'"):
        write_fisher("ekfac", tmp_path, tmp_path / "r.parquet", tmp_path / "out")
