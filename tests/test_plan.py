"""`graftlab plan`: the cost model against figures computed by hand, and the command on every config."""

import copy
import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from graftlab.commands.cli import main
from graftlab.planning.config import resolve
from graftlab.planning.layout import SWEEP, Experiment
from graftlab.planning.plan import Assumptions, estimate, load_config, render
from graftlab.planning.work import job_work

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = [ROOT / "config.yaml", *sorted((ROOT / "configs").glob("*.yaml"))]

# A 1B-parameter model named by hub id only (nothing fetched: bf16 assumed), one donor, STaR data.
# Every sequence is 256 prompt + 744 generated = 1,000 tokens.
# A graft's kept samples (graftlab.planning.work.SAMPLE_BYTES_PER_TOKEN): HAND's (50 + 10 problems) x 2
# samples of 744 tokens, 4 bytes each.
SAMPLES = 60 * 2 * 744 * 4
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


@pytest.mark.parametrize("bound", ["flops", "kv-cache"])
def test_hand_computed_plan(tmp_path, bound):
    # Decoding bound by its FLOPs (a memory so fast its reads never bind), or by reading the KV cache.
    bandwidth = 1e18 if bound == "flops" else 2e12
    a = Assumptions(mfu=0.5, decode_mfu=0.25, gpu_flops=1e15, gpu_bandwidth=bandwidth, kv_utilisation=0.5)
    a = replace(a, prompt_tokens=256, kept=0.5, jobs=1)
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
    # A graft and a merge, 2 GB each in bf16, written but not kept: each a sweep of one lam whose job
    # evaluates its model, (50 + 10 problems) x 2 samples, and measures its sensitivity share. Its samples
    # are kept: 120 answers of 744 tokens at 4 bytes a token.
    for sweep in ("graft_lam_1", "graft_lam_0p5"):  # the graft's lam, the merge's
        assert (c[sweep].jobs, c[sweep].written, c[sweep].kept) == (1, 2e9 + SAMPLES, SAMPLES)
        assert c[sweep].flops == pytest.approx(2e9 * 60 * 2 * 1000)
    # post in an evaluation job of its own; SFT of post at epochs 1 and 2 in one job (rules/evaluate.smk).
    assert (c["evaluate"].jobs, c["evaluate"].flops) == (1, pytest.approx(2e9 * 60 * 2 * 1000))
    run = c["evaluate_run_epoch_1_2"]
    assert (run.jobs, run.flops) == (1, pytest.approx(2 * 2e9 * 60 * 2 * 1000))
    assert c["fetch_model"].written == 4e9
    assert c["sensitivity_update"].jobs == 2 and c["dataset"].jobs == 3 and "opsd" not in c
    # Decoding (mining, STaR, rollouts, evaluation) at 0.25 of the peak, SFT and the Fisher at 0.5.
    decoded, passed = 1.6e15 + 3.2e14 + 2e14 + 1.2e15, 9.6e14 + 6e14
    # Or each of the 1,660 answers' 744 new tokens reads the cache of the 256 + t tokens before it, each
    # 2 (K, V) x 20 layers x 3 KV heads x 128 x 2 bytes (the shape a 1e9 model is assumed to have): 14.4 GB
    # an answer at 0.5 x 2e12 B/s is 14 ms, against 8 ms of FLOPs (2e12 at 0.25 x 1e15).
    answers = 100 * 8 + 40 * 4 + 100 + 60 * 2 * (1 + 2 + 2)  # mining, STaR, rollouts, evaluations, 2 grafts
    assert answers * 2e9 * 1000 == pytest.approx(decoded)
    kv = answers * 2 * 20 * 3 * 128 * 2 * (256 * 744 + 744**2 / 2) / (0.5 * 2e12)
    decode = decoded / 0.25 / 1e15 if bound == "flops" else kv
    assert plan.total_gpu_hours == pytest.approx((decode + passed / 0.5 / 1e15) / 3600)
    # Kept: 16 GB of SFT checkpoints, 4 GB of Fisher, 4 GB fetched, the graft's and the merge's samples; one
    # graft on disk at once (--jobs 1).
    assert plan.peak_disk == pytest.approx(24e9 + 2 * SAMPLES + 2e9, rel=1e-9)
    assert "| **total** | **" in render(plan)


def test_a_sweep_is_one_job_charged_every_graft_with_one_on_disk_at_a_time(tmp_path):
    """HAND's graft at three lam values and its merge at two: a job a sweep, charged each of its grafts'
    evaluations and bytes written, which hold one graft on disk at a time; the plan counts the starts saved."""
    x = copy.deepcopy(HAND)
    x["experiments"]["x"] |= {
        "graft": {"lam": ["0.25", "0.5", "1"], "epochs": [2]},
        "merge": {"lam": ["0.5", "1"], "epochs": [2]},
    }
    plan = estimate(resolve(x), Assumptions(prompt_tokens=256, jobs=1), root=tmp_path)
    one = 2e9 * 60 * 2 * 1000  # a graft's evaluation: (50 + 10 problems) x 2 samples x 1,000 tokens, 2 x 1e9 FLOPs
    graft, merge = plan.costs["graft_lam_0p25_0p5_1"], plan.costs["graft_lam_0p5_1"]
    assert (graft.jobs, graft.flops, graft.written) == (1, pytest.approx(3 * one), 3 * (2e9 + SAMPLES))
    assert (merge.jobs, merge.flops, merge.written) == (1, pytest.approx(2 * one), 2 * (2e9 + SAMPLES))
    assert (graft.kept, merge.kept) == (3 * SAMPLES, 2 * SAMPLES)  # only the samples outlive the job
    assert plan.temp_peak == 2e9
    assert "Grafts: 2 jobs make and score the 5 grafts and merges of 2 sweeps, 3 job starts" in " ".join(plan.notes)
    # Its runtime charges each graft's streaming through host memory (graftlab.planning.resources), one
    # graft after another: a job of 3 streams 3 models, as it evaluates 3.
    config = resolve(x)
    layout = Experiment.of(config, "x")
    sweeps = layout.sweeps().items()
    streams = {len(lams): job_work("graft", config, layout, dict(zip(SWEEP, key))).streams for key, lams in sweeps}
    assert streams == {3: 3, 2: 2}


def test_a_grown_sweep_is_charged_no_sampling_for_the_grafts_whose_samples_are_kept(tmp_path):
    """HAND's graft sweep grown to three lam values after a run that scored two of them: their sample stores
    under resume/ (graftlab.sample_chunks) are read back by the grown sweep's job, so it samples one graft of
    three; the merge's sweep, with no store, all of its two. A store without chunks counts for nothing."""
    x = copy.deepcopy(HAND)
    x["experiments"]["x"] |= {
        "graft": {"lam": ["0.25", "0.5", "1"], "epochs": [2]},
        "merge": {"lam": ["0.5", "1"], "epochs": [2]},
    }
    config = resolve(x)
    fresh = estimate(config, Assumptions(prompt_tokens=256, jobs=1), root=tmp_path)
    runs = sorted(Experiment.of(config, "x").sweep_runs().values(), key=len)  # the merge's 2, the graft's 3
    for i, run in enumerate(runs[1] + runs[0][:1]):
        store = tmp_path / "resume/results/x/eval" / run.key / "metrics.json"
        store.mkdir(parents=True)
        if i < 2:  # two of the graft's; the merge's first store holds no chunk
            (store / "0123456789abcdef0123-0.json").write_text("[]")
    plan = estimate(config, Assumptions(prompt_tokens=256, jobs=1), root=tmp_path)
    one = 2e9 * 60 * 2 * 1000  # a graft's evaluation
    graft, merge = plan.costs["graft_lam_0p25_0p5_1"], plan.costs["graft_lam_0p5_1"]
    assert (graft.flops, merge.flops) == (pytest.approx(one), pytest.approx(2 * one))
    assert fresh.costs["graft_lam_0p25_0p5_1"].flops == pytest.approx(3 * one)
    assert "Kept samples: 2 of the 5 grafts' samples were kept" in " ".join(plan.notes)
    assert not any(n.startswith("Kept samples") for n in fresh.notes)


@pytest.mark.parametrize("lams", [["1"], [str(lam / 4) for lam in range(1, 41)]])
def test_adaptive_sweeps_are_priced_against_full_scoring_with_the_kept_share_a_third_needs(tmp_path, lams):
    """HAND with its grafts screened on a tenth of the problems and 0.4 of them kept: the note's hours are
    full scoring's with each graft's evaluation charged 0.1 + 0.4 of itself, and the kept share at which
    they are a third of full scoring's solves that line, or is out of reach where screening alone exceeds it."""
    x = copy.deepcopy(HAND)
    x["experiments"]["x"]["graft"]["lam"] = lams
    x["experiments"]["x"]["merge"]["lam"] = lams
    x["experiments"]["x"]["eval"] |= {"validation": 0.5}
    a = Assumptions(prompt_tokens=256, jobs=1, gpu_bandwidth=1e18, adaptive_kept=0.4)  # hours are FLOPs
    full = estimate(resolve(copy.deepcopy(x)), a, root=tmp_path).total_gpu_hours
    x["experiments"]["x"]["eval"] |= {"adaptive": 0.1}
    plan = estimate(resolve(x), a, root=tmp_path)
    grafts = 2 * len(lams) * 2e9 * 60 * 2 * 1000 / (a.decode_mfu * a.gpu_flops) / 3600  # each scored fully
    assert plan.total_gpu_hours == pytest.approx(full - grafts + (0.1 + 0.4) * grafts)
    note = next(n for n in plan.notes if n.startswith("Adaptive sweeps (x)"))
    hours = [float(h) for h in re.findall(r"([\d.e+]+) GPU-hours, against ([\d.e+]+)", note)[0]]
    assert hours == [pytest.approx(plan.total_gpu_hours, rel=1e-2), pytest.approx(full, rel=1e-2)]
    none = full - grafts + 0.1 * grafts
    if none >= full / 3:
        assert f"none of them kept, screening and every other job take {none:.3g}: a third" in note
        assert "of full scoring's is out of reach" in note
    else:
        kept = float(re.search(r"needs at most ([\d.e-]+) of them kept", note)[1])
        assert kept == pytest.approx((full / 3 - none) / grafts, rel=0.05)
    assert (none >= full / 3) == (len(lams) == 1)  # both branches are taken


@pytest.mark.parametrize("decided", ["graft", "both"])
def test_a_finished_screening_prices_its_sweeps_as_it_decided_whatever_is_assumed(tmp_path, decided):
    """HAND's graft at three lam values and its merge at two, screened on a tenth of the problems: a sweep
    whose screening has decided every graft (results/x/screen/decisions.json) is charged the grafts it kept,
    1 of the graft's 3 and both merges; a sweep it has not decided, the assumed 0.4."""
    x = copy.deepcopy(HAND)
    x["experiments"]["x"] |= {
        "graft": {"lam": ["0.25", "0.5", "1"], "epochs": [2]},
        "merge": {"lam": ["0.5", "1"], "epochs": [2]},
    }
    x["experiments"]["x"]["eval"] |= {"validation": 0.5}
    a = Assumptions(prompt_tokens=256, jobs=1, gpu_bandwidth=1e18, adaptive_kept=0.4)  # hours are FLOPs
    full = estimate(resolve(copy.deepcopy(x)), a, root=tmp_path).total_gpu_hours
    x["experiments"]["x"]["eval"] |= {"adaptive": 0.1}
    config = resolve(x)
    sweeps = sorted(Experiment.of(config, "x").sweep_runs().values(), key=len)  # the merge's 2, the graft's 3
    decisions = {r.key: {"kept": i == 0} for i, r in enumerate(sweeps[1])}
    decisions |= {r.key: {"kept": True} for r in sweeps[0]} if decided == "both" else {}
    (tmp_path / "results/x/screen").mkdir(parents=True)
    (tmp_path / "results/x/screen/decisions.json").write_text(json.dumps(decisions))
    plan = estimate(config, a, root=tmp_path)
    one = 2e9 * 60 * 2 * 1000 / (a.decode_mfu * a.gpu_flops) / 3600  # a graft's evaluation, in GPU-hours
    kept = 1 + (2 if decided == "both" else 2 * 0.4)
    assert plan.total_gpu_hours == pytest.approx(full - 5 * one + 0.1 * 5 * one + kept * one)
    # The grafts scored fully keep their samples; the screened-out ones write none.
    sweeps = [plan.costs[rule] for rule in ("graft_lam_0p25_0p5_1", "graft_lam_0p5_1")]
    assert sum(c.kept for c in sweeps) == pytest.approx(kept * SAMPLES)
    assert sum(c.written for c in sweeps) == pytest.approx(5 * 2e9 + kept * SAMPLES)
    note = next(n for n in plan.notes if n.startswith("Adaptive sweeps (x)"))
    screened = "3 of the 5 runs" if decided == "both" else "1 of the 3 runs"
    assert f"{screened} screened so far kept" in note
    if decided == "both":
        assert f"then scored fully: {plan.total_gpu_hours:.3g} GPU-hours, against {full:.3g}" in note
        assert note.endswith(f", {plan.total_gpu_hours / full:.2g} of it") and "--adaptive-kept" not in note
    else:  # the line is over the merge's 2 grafts, the only ones assumed
        none = full - 5 * one + 0.5 * one + one
        assert none >= full / 3  # HAND's other jobs alone are more than a third
        assert f"none of the others kept, screening and every other job take {none:.3g}: a third" in note


def test_stated_params_win_over_the_name(tmp_path):
    config = resolve(
        {**copy.deepcopy(HAND), "models": {"m": {"source": "org/Model-1B", "params": 3e9}, "d": HAND["models"]["d"]}}
    )
    assert estimate(config, root=tmp_path).costs["fetch_model"].written == (3e9 + 1e9) * 2


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_plan_prints_every_config(path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    # The presets need terabytes: room for them is stated, not measured on this machine.
    assert main(["plan", "--configfile", str(path.relative_to(ROOT)), "--disk-free", "1e6"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("| rule | jobs | GPU-hours | disk written (GB) | kept (GB) |")
    assert "| **total** |" in out and "Peak disk:" in out


def test_the_plan_gives_each_gpu_rules_gpus_and_lists_the_jobs_no_gpu_count_holds(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert main(["plan", "--configfile", "configs/qwen3-8b-star.yaml", "--disk-free", "1e6"]) == 0
    out = capsys.readouterr().out
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in out.splitlines() if line.startswith("| ")}
    # Qwen3-8B's SFT and OPSD shard over 4 of the 80 GB GPUs (their batches divide by 4), its Fishers over 3
    # (KFAC's, the hardest of the rule's jobs: the diagonal's takes 2).
    for rule, gpus in (("sft", "4"), ("opsd", "4"), ("fisher", "3")):
        assert rows[rule][5] == gpus and float(rows[rule][6].rstrip(" |")) <= 0.85 * 80, rule
    assert "Does not fit" not in out
    # Qwen3-4B's GRPO (TRL's trainer under accelerate's FSDP) shards over 4; on 300 GB GPUs it fits one.
    preset = "configs/qwen3-4b-sdpo.yaml"
    assert main(["plan", "--configfile", preset, "--disk-free", "1e6"]) == 0
    out = capsys.readouterr().out
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in out.splitlines() if line.startswith("| ")}
    assert rows["grpo"][5] == "4" and "Does not fit" not in out
    assert main(["plan", "--configfile", preset, "--disk-free", "1e6", "--gpu-memory-gb", "300"]) == 0
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in capsys.readouterr().out.splitlines()}
    assert rows["grpo"][5] == "1"


def test_a_run_whose_unshardable_jobs_fit_no_gpu_is_refused_after_its_plan(capsys, monkeypatch):
    """On 24 GB GPUs the 4B trainers' nominal activations fit no count, but they shard and take smaller
    micro-batches: listed, not refused. On 8 GB GPUs a sampling engine (8 GB of weights), which cannot shard,
    fits none: the plan is printed, then refused in one line naming the first such rule."""
    monkeypatch.chdir(ROOT)
    preset = "configs/qwen3-4b-sdpo.yaml"
    assert main(["plan", "--configfile", preset, "--disk-free", "1e6", "--gpu-memory-gb", "24"]) == 0
    listed = capsys.readouterr().out.split("Does not fit a 24 GB GPU")[1]
    assert "- grpo: no count of up to 8 GPUs dividing its batch of 64" in listed and "cannot shard" not in listed
    assert main(["plan", "--configfile", preset, "--disk-free", "1e6", "--gpu-memory-gb", "8"]) == 1
    out, err = capsys.readouterr()
    assert "| **total** |" in out and err.count("\n") == 1
    assert re.match(r"graftlab: error: mine: needs 9.7 GB a GPU on 1 \(weights 8.0 GB, .* cannot shard over GPUs", err)


def test_a_run_that_would_not_fit_the_disk_is_refused_after_its_plan(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)
    preset = "configs/qwen3-8b-star.yaml"
    plan = estimate(load_config([preset], []))
    # Exactly the peak fits; a GB less does not.
    assert main(["plan", "--configfile", preset, "--disk-free", str(plan.peak_disk / 1e9)]) == 0
    capsys.readouterr()
    short = str(plan.peak_disk / 1e9 - 1)
    assert main(["plan", "--configfile", preset, "--disk-free", short, "--directory", str(tmp_path / "new")]) == 1
    out, err = capsys.readouterr()
    assert "| **total** |" in out  # the plan is printed all the same: it says where the disk goes
    biggest = max(plan.costs, key=lambda rule: plan.costs[rule].kept)
    assert err.count("\n") == 1 and f"{biggest} keeps the most" in err and str(tmp_path / "new") in err
    # Measured: the free space of the nearest existing directory, far below what the preset needs.
    assert main(["plan", "--configfile", preset, "--directory", str(tmp_path / "a/b")]) == 1
    assert "GB are free" in capsys.readouterr().err


# Every config but fidelity.yaml, whose dry-run alone takes 40 s, and the continual chains, whose local data
# files exist only once copied (tests/test_presets.py compares one's plan with a dry-run on stand-ins).
SKIP_DAG = ("fidelity.yaml", "qwen3-4b-continual.yaml", "qwen3-4b-thinking.yaml")


@pytest.mark.parametrize("path", [p for p in CONFIGS if p.name not in SKIP_DAG], ids=lambda p: p.name)
def test_jobs_match_snakemake_dag(path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert main(["plan", "--configfile", str(path.relative_to(ROOT)), "--dag", "--disk-free", "1e6"]) == 0
    assert "Snakemake's DAG has the same jobs per rule." in capsys.readouterr().out


def test_a_greedy_task_is_charged_one_answer_per_question():
    """Knowledge questions are answered once, greedily (graftlab.tasks): evaluation is charged so."""
    import yaml

    from graftlab.planning.config import resolve
    from graftlab.planning.layout import Experiment
    from graftlab.planning.plan import Assumptions
    from graftlab.planning.work import eval_answers

    config = resolve(yaml.safe_load((Path(__file__).resolve().parents[1] / "configs" / "smoke.yaml").read_text()))
    name = next(e for e, x in config["experiments"].items() if x["data"] == "knowledge")
    layout, x = Experiment.of(config, name), config["experiments"][name]
    old = dict.fromkeys(layout.world["old_tasks"], layout.world["benchmark_size"] * x["eval"]["samples"])
    new = {"knowledge": x["knowledge"]["facts"] * x["knowledge"]["heldout_phrasings"]}
    assert x["eval"]["samples"] > 1 and eval_answers(layout, Assumptions()) == old | new


# A continual experiment on the 1B model: a data-set stage of 40 training problems (10 held out, 2 epochs), then
# a knowledge stage of 10 facts x 3 training phrasings (1 epoch); one graft chain, one SDPO chain with an EMA
# teacher. Every sequence is 256 prompt + 744 generated = 1,000 tokens.
SOLVED = {"prompt": "problem", "answer": "answer", "solution": "solution"}
CONTINUAL = {
    "models": HAND["models"],
    "experiments": {
        "c": {
            "post": "m",
            "donors": ["d"],
            "benchmarks": {"b": {"source": "org/bench", "limit": 50}},
            "stages": [
                {
                    "domain": "algebra",
                    "problems": {"source": "org/algebra", "limit": 100, "columns": SOLVED},
                    "train": 40,
                    "heldout": 10,
                    "epochs": 2,
                },
                {
                    "domain": "knowledge",
                    "knowledge": {
                        "entities": 5,
                        "facts": 10,
                        "train_phrasings": 3,
                        "heldout_phrasings": 2,
                        "replay": 0,
                    },
                },
            ],
            "sft": {"lr": ["1e-5"], "epochs": 1},
            "graft": {"lam": ["1"]},
            "fisher": {"prompts": {"source": "org/old", "limit": 100}},
            "opsd": {"alpha": []},
            "sdpo": {"teachers": ["ema:0.05"], "lr": ["1e-5"], "steps": 10, "checkpoints": 2, "max_new_tokens": 744},
            "continual": {"graft_forms": ["chain"], "response_prompts": 4, "kl_prompts": 4, "kl_samples": 2},
            "eval": {"samples": 2, "max_new_tokens": 744},
        }
    },
}


def test_hand_computed_continual_plan(tmp_path):
    from graftlab.planning.chains import Continual
    from graftlab.planning.work import job_work

    a = Assumptions(prompt_tokens=256)
    config = resolve(copy.deepcopy(CONTINUAL))
    plan = estimate(config, a, root=tmp_path)
    c = plan.costs
    # The SFT chain and the donor tuned on each stage alone (graft_chain's update): stage 1 trains on its 40
    # problems for 2 epochs, 6 x 1e9 x 2 x 40 x 1,000; stage 2 on 30 phrasings for 1, of a knowledge answer's
    # 64 tokens (not the evaluation's 744), 6 x 1e9 x 1 x 30 x 320.
    stage1, stage2 = 6e9 * 2 * 40e3, 6e9 * 1 * 30 * (256 + 64)
    assert (c["chain_sft"].jobs, c["chain_sft"].flops) == (4, pytest.approx(2 * (stage1 + stage2)))
    # The knowledge stage is what the single-domain formula gives for the stage's view; the data-set stage
    # counts the stage's `train` problems, not the view's mined candidates.
    layout = Continual.of(config, "c")
    assert job_work("sft", config, layout.stage_view(2), {}, a).compute == pytest.approx(stage2)
    # One fp32 checkpoint (4 GB) per epoch, all kept: 3 epochs in all, twice.
    assert c["chain_sft"].written == c["chain_sft"].kept == 2 * 3 * 4e9
    # Chain grafts are kept, the next stage starts from them: 2 GB each in bf16, no temporary graft.
    assert (c["chain_graft"].jobs, c["chain_graft"].kept, plan.temp_peak) == (2, 4e9, 0)
    # SDPO keeps steps 5 and 10 of each stage and its EMA teacher: 3 fp32 copies per stage.
    assert (c["chain_sdpo"].jobs, c["chain_sdpo"].written) == (2, 2 * 3 * 4e9)
    # Post, 3 chains after 2 stages and SDPO's first checkpoint in each stage: 9 evaluations of 50 x 2 (b)
    # + 10 x 2 (algebra's held-out problems)
    # + 10 x 2 knowledge questions answered once, greedily.
    assert (c["evaluate"].jobs, c["evaluate"].flops) == (9, pytest.approx(9 * 2e9 * 140 * 1000))
    # Once the post model's evaluation has measured b's answers at 100 tokens, each is charged 256 + 100.
    metrics = tmp_path / "results/c/eval/post/metrics.json"
    metrics.parent.mkdir(parents=True)
    metrics.write_text(json.dumps({"benchmarks": {"b": {"response_tokens": 100}}}))
    measured = estimate(config, a, root=tmp_path).costs["evaluate"]
    assert measured.flops == pytest.approx(9 * 2e9 * (100 * 356 + 40 * 1000))
    # Drift embeds 4 answers per benchmark of post and the 6 models; the reverse KL samples 2 answers to 4
    # prompts of each stage per chain, scored by the model and by post; the forward KL samples as many from
    # post once a stage, each scored by post and by each chain's model.
    embedded, post_sampled = 7 * 3 * 4, 2 * (4 + 4)
    sampled = 3 * post_sampled
    assert c["response_kl"].generate == pytest.approx(2e9 * (sampled + post_sampled) * 1000)
    assert c["response_kl"].compute == pytest.approx(2e9 * (embedded + 2 * sampled + 2 * 3 * post_sampled) * 1000)
    # b and the algebra problems; no masked graft, so no retention prompts, rollouts nor Fisher.
    assert c["dataset"].jobs == 2 and c["stage_data"].jobs == 2 and "rollouts" not in c and "fisher" not in c
    assert not {"sft", "graft", "summary", "pareto", "sensitivity", "drift", "takeover"} & set(c)
    assert (c["continual"].jobs, c["param_drift"].jobs) == (1, 1) and "study" not in c  # no single-domain experiment


def test_continual_rules_are_sized_as_the_plan_says():
    """Each continual rule's `sized(...)` in rules/continual.smk is the rule the plan sizes it as."""
    import re

    from graftlab.planning.plan import SIZED_AS

    text = (ROOT / "rules" / "continual.smk").read_text()
    sized = dict(re.findall(r"^rule (\w+):(?:(?!^rule ).)*?\*\*sized\(\"(\w+)\"\)", text, flags=re.M | re.S))
    assert sized and {rule: SIZED_AS.get(rule, rule) for rule in sized} == sized


def test_continual_jobs_match_snakemake_dag(tmp_path, capsys, monkeypatch):
    """A continual experiment with data-set stages, a benchmark stage, retention prompts and two mask kinds."""
    import yaml

    config = copy.deepcopy(CONTINUAL)
    x = config["experiments"]["c"]
    x["stages"].insert(
        1,
        {
            "domain": "geometry",
            "problems": {"source": "org/geo", "columns": SOLVED},
            "benchmark": {"source": "org/geo-test", "limit": 40},
            "steps": 4,
        },
    )
    x["graft"] = {"lam": ["1"], "masks": {"kinds": ["diag", "kfac"], "rho": ["0.1"], "lam": ["1"]}}
    x["continual"]["graft_forms"] = ["chain", "cumulative"]
    path = tmp_path / "continual.yaml"
    path.write_text(yaml.safe_dump(config))
    monkeypatch.chdir(ROOT)
    assert main(["plan", "--configfile", str(path), "--dag", "--disk-free", "1e6"]) == 0
    out = capsys.readouterr().out
    assert "| chain_fisher | 8 |" in out and "Snakemake's DAG has the same jobs per rule." in out


@pytest.mark.parametrize("decided", [False, True])
def test_screened_checkpoints_are_priced_as_the_grafts_are(tmp_path, decided):
    """HAND under eval.adaptive_checkpoints: its SFT run's 2 checkpoints are screened on a tenth of the
    problems (their own job) and 0.4 of them scored fully, keeping their samples, as its graft and merge
    are; once the screening has decided the run (1 of 2 kept), it is charged that, whatever is assumed."""
    x = copy.deepcopy(HAND)
    x["experiments"]["x"]["eval"] |= {"validation": 0.5}
    a = Assumptions(prompt_tokens=256, jobs=1, gpu_bandwidth=1e18, adaptive_kept=0.4)  # hours are FLOPs
    full = estimate(resolve(copy.deepcopy(x)), a, root=tmp_path).total_gpu_hours
    x["experiments"]["x"]["eval"] |= {"adaptive": 0.1, "adaptive_checkpoints": True}
    config = resolve(x)
    if decided:
        runs = ["sft/post/lr~1e-5/epoch~1", "sft/post/lr~1e-5/epoch~2"]
        (tmp_path / "results/x/screen").mkdir(parents=True)
        decisions = {run: {"kept": run.endswith("2")} for run in runs}
        (tmp_path / "results/x/screen/decisions.json").write_text(json.dumps(decisions))
    plan = estimate(config, a, root=tmp_path)
    one = 2e9 * 60 * 2 * 1000 / (a.decode_mfu * a.gpu_flops) / 3600  # a model's evaluation, in GPU-hours
    kept = 1 if decided else 2 * 0.4  # of the 2 checkpoints
    grafts = 2 * (0.1 + 0.4)  # the graft and the merge, never decided here
    assert plan.total_gpu_hours == pytest.approx(full - 4 * one + grafts * one + (2 * 0.1 + kept) * one)
    screen = plan.costs["evaluate_run_epoch_1_2_screen"]
    assert screen.jobs == 1 and screen.flops == pytest.approx(2 * 0.1 * 2e9 * 60 * 2 * 1000)
    run = plan.costs["evaluate_run_epoch_1_2"]
    assert run.kept == pytest.approx(kept * SAMPLES) and run.written == pytest.approx(kept * SAMPLES)
    note = next(n for n in plan.notes if n.startswith("Adaptive sweeps (x)"))
    assert "every graft and merge and training checkpoint first scored" in note
    assert ("1 of the 2 runs screened so far kept" in note) == decided
