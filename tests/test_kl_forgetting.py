"""KL against forgetting: the Monte Carlo KL(model ‖ start) from the model's own samples, checked against
a token-by-token loop and against the exact KL of one next-token distribution; the line fit of forgetting
on KL; its figure."""

import json
import subprocess
import sys

import numpy as np
import polars as pl
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, AutoTokenizer

from graftlab.analysis.kl_forgetting import fit_kl_forgetting, mc_kl, plot_kl_forgetting
from graftlab.errors import GraftlabError
from graftlab.sampling import SamplingConfig, generate_ids
from graftlab.tasks import get_task

PROMPTS = ["12+7=", "9-4="]


@pytest.fixture(scope="module")
def perturbed(world_pico, tmp_path_factory):
    """The world pico model with noise on every parameter, large enough that its next-token distribution
    is far from the start's (one-token KL about 0.35 nats)."""
    path = tmp_path_factory.mktemp("perturbed")
    model = AutoModelForCausalLM.from_pretrained(world_pico, dtype=torch.float32)
    torch.manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.2 * torch.randn_like(param))
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(world_pico).save_pretrained(path)
    return path


def test_a_model_against_itself_has_kl_exactly_zero(world_pico):
    result = mc_kl(world_pico, world_pico, PROMPTS, "add", samples=3, max_new_tokens=6, seed=1)
    assert result == {"kl": 0.0, "kl_se": 0.0, "samples": 6, "tokens": 6.0}


def sequence_logprob(model, prompt: list[int], response: list[int]) -> float:
    """log π(response | prompt), one forward pass per token on the unpadded prefix."""
    total = 0.0
    for t, token in enumerate(response):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + response[:t]])).logits[0, -1]
        total += float(torch.log_softmax(logits.double(), -1)[token])
    return total


def test_the_estimate_is_the_mean_sequence_log_ratio_of_the_models_own_samples(world_pico, perturbed):
    result = mc_kl(perturbed, world_pico, PROMPTS, "add", samples=3, max_new_tokens=6, seed=1)
    # The same draws: one batch, the same seed (the estimate is only as good as sampling from the model).
    tok = AutoTokenizer.from_pretrained(perturbed)
    posed = [get_task("add").chat_prompt(tok, p) for p in PROMPTS]
    drawn = [s for ss in generate_ids(perturbed, posed, SamplingConfig(3, 1.0, 1.0, 6, seed=1)) for s in ss]
    model, start = (
        AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval() for d in (perturbed, world_pico)
    )
    ratios = [sequence_logprob(model, p, r) - sequence_logprob(start, p, r) for p, r in drawn]
    assert result["samples"] == 6 and result["tokens"] == np.mean([len(r) for _, r in drawn])
    assert result["kl"] > 0
    assert result["kl"] == pytest.approx(np.mean(ratios), rel=1e-5)
    assert result["kl_se"] == pytest.approx(np.std(ratios, ddof=1) / np.sqrt(6), rel=1e-4)


def test_one_token_responses_approach_the_exact_kl_of_the_next_token_distributions(world_pico, perturbed):
    """84 tokens: a top-k of 50 left in the sampler would bias the estimate well outside its error."""
    result = mc_kl(perturbed, world_pico, PROMPTS[:1], "add", samples=3000, max_new_tokens=1, seed=0, batch_size=1000)
    tok = AutoTokenizer.from_pretrained(perturbed)
    ids = torch.tensor([tok(get_task("add").chat_prompt(tok, PROMPTS[0]), add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        logp, logq = (
            torch.log_softmax(AutoModelForCausalLM.from_pretrained(d).eval()(ids).logits[0, -1].double(), -1)
            for d in (perturbed, world_pico)
        )
    exact = float((logp.exp() * (logp - logq)).sum())
    assert result["tokens"] == 1.0 and result["samples"] == 3000
    assert result["kl_se"] < 0.1 * exact
    assert abs(result["kl"] - exact) < 3 * result["kl_se"], (result, exact)


def test_each_model_is_tabled_with_both_directions_of_its_kl(world_pico, perturbed, tmp_path):
    """kl_frame's reverse KL is the model's own samples' (mc_kl(model, post)); its forward KL the post model's
    samples' (mc_kl(post, model)): the same draws, so equal to the last digit; and they differ."""
    from graftlab.analysis.continual_probes import kl_frame

    for name, acc in (("post", 0.8), ("sft", 0.6)):
        (tmp_path / name).mkdir()
        bench = {"add": {"role": "old", "acc@n": acc}}
        (tmp_path / name / "metrics.json").write_text(json.dumps({"benchmarks": bench}))
    model = {"method": "sft", "stage": 1, "step": None, "eval_dir": str(tmp_path / "sft"), "model": str(perturbed)}
    cfg = {"samples": 3, "max_new_tokens": 6, "seed": 1, "post_eval_dir": str(tmp_path / "post")}
    frame = kl_frame(str(world_pico), [model], {1: (PROMPTS, "add")}, cfg)
    post, row = frame.row(0, named=True), frame.row(1, named=True)
    assert post["kl_reverse"] == post["kl_forward"] == 0.0 and post["forgetting"] == 0.0
    reverse = mc_kl(perturbed, world_pico, PROMPTS, "add", samples=3, max_new_tokens=6, seed=1)
    forward = mc_kl(world_pico, perturbed, PROMPTS, "add", samples=3, max_new_tokens=6, seed=1)
    assert (row["kl_reverse"], row["kl_reverse_se"]) == pytest.approx((reverse["kl"], reverse["kl_se"]), rel=1e-9)
    assert (row["kl_forward"], row["kl_forward_se"]) == pytest.approx((forward["kl"], forward["kl_se"]), rel=1e-9)
    assert row["kl_forward"] > 0 and abs(row["kl_forward"] - row["kl_reverse"]) > 1e-3
    assert row["forgetting"] == pytest.approx(0.25)


def test_bad_arguments_are_refused(world_pico):
    with pytest.raises(GraftlabError, match="max_new_tokens >= 1"):
        mc_kl(world_pico, world_pico, PROMPTS, "add", samples=2, max_new_tokens=0, seed=0)


def line_frame(a=0.05, b=0.4):
    kl = [0.0, 0.5, 1.0, 2.0, 3.5]
    return pl.DataFrame(
        {
            "method": ["sft", "sft", "grpo", "grpo", "graft"],
            "stage": [1, 2, 1, 2, 1],
            "kl": kl,
            "forgetting": [a + b * x for x in kl],
        }
    )


def test_the_fit_recovers_a_line_exactly():
    fit = fit_kl_forgetting(line_frame())
    assert fit["a"] == pytest.approx(0.05, abs=1e-12) and fit["b"] == pytest.approx(0.4, abs=1e-12)
    assert fit["r2"] == pytest.approx(1.0) and fit["n"] == 5
    assert np.abs(fit["frame"]["residual"].to_numpy()).max() < 1e-12
    assert fit["frame"].columns == ["method", "stage", "kl", "forgetting", "fitted", "residual"]


def test_rows_without_forgetting_are_left_out_of_the_fit_and_have_no_residual():
    unscored = pl.DataFrame(
        {"method": ["opsd"], "stage": [1], "kl": [9.0], "forgetting": [None]}, schema=line_frame().schema
    )
    fit = fit_kl_forgetting(pl.concat([line_frame(), unscored]))
    assert fit["n"] == 5 and fit["b"] == pytest.approx(0.4)
    assert fit["frame"]["residual"][-1] is None
    noisy = line_frame().with_columns(forgetting=pl.col("forgetting") + pl.Series([0.1, -0.1, 0.0, 0.1, -0.1]))
    r = fit_kl_forgetting(noisy)
    assert 0 < r["r2"] < 1 and r["frame"]["residual"].sum() == pytest.approx(0.0, abs=1e-12)


def test_a_fit_needs_two_distinct_kl_values():
    with pytest.raises(GraftlabError, match="two distinct KL"):
        fit_kl_forgetting(line_frame().with_columns(kl=pl.lit(1.0)))
    with pytest.raises(GraftlabError, match=r"lacks columns \['stage'\]"):
        fit_kl_forgetting(line_frame().drop("stage"))


def test_the_figure_is_written(tmp_path):
    frame = line_frame().with_columns(forgetting=pl.col("forgetting") + 0.01 * pl.col("stage"))
    fit = fit_kl_forgetting(frame)
    plot_kl_forgetting(fit["frame"], [fit], tmp_path / "kl.png")
    plot_kl_forgetting(frame, [fit], tmp_path / "again.png")  # residuals computed from the fit
    both = frame.rename({"kl": "kl_reverse"}).with_columns(kl_forward=2 * pl.col("kl_reverse"))
    fits = [fit_kl_forgetting(both, d) for d in ("reverse", "forward")]
    plot_kl_forgetting(both, fits, tmp_path / "both.png")
    assert {"fitted_reverse", "residual_reverse"} <= set(fits[0]["frame"].columns)
    assert fits[1]["b"] == pytest.approx(fits[0]["b"] / 2)
    assert (tmp_path / "kl.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "again.png").stat().st_size > 0
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_importing_the_module_leaves_torch_and_matplotlib_out():
    heavy = "{'torch', 'transformers', 'matplotlib'}"
    code = f"import sys, graftlab.analysis.kl_forgetting; print(sorted({heavy} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


@given(
    rows=st.lists(
        st.tuples(st.floats(0, 5, allow_nan=False), st.floats(-1, 1, allow_nan=False)), min_size=2, max_size=12
    ).filter(lambda rows: len({round(k, 6) for k, _ in rows}) >= 2)
)
@settings(max_examples=100, deadline=None)
def test_the_fit_is_closed_form_least_squares_and_a_residual_is_forgetting_above_the_line(rows):
    """For any rows: b = cov(kl, forgetting) / var(kl), a = mean(forgetting) - b mean(kl), and each residual
    is forgetting minus the line (positive: forgets more than its KL predicts)."""
    kl, forgetting = (np.array(v, dtype=np.float64) for v in zip(*rows))
    frame = pl.DataFrame(
        {"method": ["m"] * len(rows), "stage": list(range(len(rows))), "kl": kl, "forgetting": forgetting}
    )
    fit = fit_kl_forgetting(frame)
    b = ((kl - kl.mean()) * (forgetting - forgetting.mean())).sum() / ((kl - kl.mean()) ** 2).sum()
    a = forgetting.mean() - b * kl.mean()
    assert fit["b"] == pytest.approx(b, rel=1e-6, abs=1e-6) and fit["a"] == pytest.approx(a, rel=1e-6, abs=1e-6)
    expected = forgetting - (a + b * kl)
    assert fit["frame"]["residual"].to_numpy() == pytest.approx(expected, rel=1e-6, abs=1e-6)
