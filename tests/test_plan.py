"""`graftlab plan`: the cost model against figures computed by hand, and the command on every config."""

import copy
from pathlib import Path

import pytest

from graftlab.cli import main
from graftlab.config import resolve
from graftlab.plan import Assumptions, estimate, render

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = [ROOT / "config.yaml", *sorted((ROOT / "configs").glob("*.yaml"))]

# A 1B-parameter model named by hub id only (nothing fetched: bf16 assumed), one donor, STaR data.
# Every sequence is 256 prompt + 744 generated = 1,000 tokens.
HAND = {
    "models": {"m": {"source": "org/Model-1B"}, "d": {"source": "org/Model-1B-Base"}},
    "experiments": {
        "x": {
            "post": "m",
            "donors": ["d"],
            "data": "star",
            "problems": {"source": "org/problems", "limit": 100},
            "benchmarks": {"b": {"source": "org/bench", "limit": 50}},
            "mining": {"samples": 8, "heldout": 10, "max_new_tokens": 744},
            "star": {"attempts": 4, "max_new_tokens": 744},
            "sft": {"lr": ["1e-5"], "epochs": 2},
            "graft": {"lam": ["1"], "epochs": [2]},
            "merge": {"lam": ["0.5"], "epochs": [2]},
            "fisher": {"rollouts": 100, "max_new_tokens": 744, "prompts": {"source": "org/old", "limit": 100}},
            "opsd": {"alpha": []},
            "eval": {"samples": 2, "max_new_tokens": 744, "donor_sft": False},
        }
    },
}


def test_hand_computed_plan(tmp_path):
    a = Assumptions(mfu=0.5, decode_mfu=0.25, gpu_flops=1e15, prompt_tokens=256, kept=0.5, jobs=1)
    plan = estimate(resolve(copy.deepcopy(HAND)), a, root=tmp_path)
    c = plan.costs
    # Mining: 2 x 1e9 FLOPs x 100 problems x 8 samples x 1,000 tokens.
    assert c["mine"].flops == pytest.approx(2e9 * 100 * 8 * 1000)
    # Half of 100 kept, 10 held out: 40 train problems, each up to 4 STaR attempts.
    assert c["star"].flops == pytest.approx(2e9 * 40 * 4 * 1000)
    # SFT of post and of the donor: 6 x 1e9 x 2 epochs x 40 examples x 1,000 tokens each; an fp32
    # checkpoint (4 GB) per epoch each.
    assert (c["sft"].jobs, c["sft"].flops, c["sft"].written) == (2, pytest.approx(2 * 6e9 * 2 * 40e3), 16e9)
    assert c["rollouts"].flops == pytest.approx(2e9 * 100e3)
    # Only the diagonal Fisher (the sensitivity analysis needs it): 6 x 1e9 per token, 4 GB in fp32.
    assert (c["fisher"].jobs, c["fisher"].flops, c["fisher"].written) == (1, pytest.approx(6e9 * 100e3), 4e9)
    # A graft and a merge, 2 GB each in bf16, written but not kept (temp()).
    assert (c["graft"].jobs, c["graft"].written, c["graft"].kept) == (2, 4e9, 0)
    # post, SFT of post at epochs 1 and 2, the graft and the merge: 5 runs x (50 + 10 problems) x 2 samples.
    assert (c["evaluate"].jobs, c["evaluate"].flops) == (5, pytest.approx(5 * 2e9 * 60 * 2 * 1000))
    assert c["fetch_model"].written == 4e9
    assert c["sensitivity_update"].jobs == 4 and c["dataset"].jobs == 3 and "opsd" not in c
    # Decoding (mining, STaR, rollouts, evaluation) at 0.25 of the peak, SFT and the Fisher at 0.5.
    decoded, passed = 1.6e15 + 3.2e14 + 2e14 + 1.2e15, 9.6e14 + 6e14
    assert plan.gpu_hours(plan.total) == pytest.approx((decoded / 0.25 + passed / 0.5) / 1e15 / 3600)
    # Kept: 16 GB of SFT checkpoints, 4 GB of Fisher, 4 GB fetched; both grafts on disk at once.
    assert plan.peak_disk == pytest.approx(24e9 + 4e9)
    assert "| **total** | **" in render(plan)


def test_stated_params_win_over_the_name(tmp_path):
    config = resolve(
        {**copy.deepcopy(HAND), "models": {"m": {"source": "org/Model-1B", "params": 3e9}, "d": HAND["models"]["d"]}}
    )
    assert estimate(config, root=tmp_path).costs["fetch_model"].written == (3e9 + 1e9) * 2


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_plan_prints_every_config(path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert main(["plan", "--configfile", str(path.relative_to(ROOT))]) == 0
    out = capsys.readouterr().out
    assert out.startswith("| rule | jobs | GPU-hours | disk written (GB) |")
    assert "| **total** |" in out and "Peak disk:" in out


# Every config but fidelity.yaml, whose dry-run alone takes 40 s.
@pytest.mark.parametrize("path", [p for p in CONFIGS if p.name != "fidelity.yaml"], ids=lambda p: p.name)
def test_jobs_match_snakemake_dag(path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert main(["plan", "--configfile", str(path.relative_to(ROOT)), "--dag"]) == 0
    assert "Snakemake's DAG has the same jobs per rule." in capsys.readouterr().out


def test_a_greedy_task_is_charged_one_answer_per_question():
    """Knowledge questions are answered once, greedily (graftlab.tasks): evaluation is charged so."""
    import yaml

    from graftlab.config import resolve
    from graftlab.layout import Experiment
    from graftlab.plan import Assumptions
    from graftlab.work import eval_sequences

    config = resolve(yaml.safe_load((Path(__file__).resolve().parents[1] / "configs" / "smoke.yaml").read_text()))
    name = next(e for e, x in config["experiments"].items() if x["data"] == "knowledge")
    layout, x = Experiment.of(config, name), config["experiments"][name]
    old = layout.world["benchmark_size"] * len(layout.world["old_tasks"]) * x["eval"]["samples"]
    new = x["knowledge"]["facts"] * x["knowledge"]["heldout_phrasings"]
    assert x["eval"]["samples"] > 1 and eval_sequences(layout, Assumptions()) == old + new
