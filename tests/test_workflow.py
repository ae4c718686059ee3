"""The workflow end to end on configs/smoke.yaml, and what its caching promises: a no-op re-run
schedules nothing, a new lambda or rho schedules only its grafts and evaluations, a new SFT learning rate
only that SFT and what depends on it, a Fisher is computed once per kind however many grafts use it."""

import json
import re
from collections import Counter
from pathlib import Path

import polars as pl
import pytest
import yaml
from conftest import REPO, SMOKE, new_data, snakemake

from graftlab.sample_chunks import FINGERPRINT

pytestmark = pytest.mark.workflow
# The per-experiment analyses every change of a run re-makes, once each (takeover: on the tiny world's
# arithmetic, as in every experiment these tests change).
ANALYSES = {
    "summary": 1,
    "pareto": 1,
    "sensitivity": 1,
    "latency": 1,
    "gain_forgetting": 1,
    "takeover": 1,
    "study": 1,
    "report_tables": 1,
    "all": 1,
}


def planned_jobs(
    workdir: Path, *configs: Path, targets: tuple[str, ...] = (), base: tuple[Path, ...] = (SMOKE,)
) -> Counter:
    """Jobs a dry-run would execute, by rule (for `targets`, else for the whole workflow), with `configs`
    laid over `base`."""
    # Targets right after -n: --configfile and --quiet each take every word up to the next option.
    proc = snakemake(workdir, "-n", *targets, "--quiet", "rules", configs=(*base, *configs))
    assert proc.returncode == 0, proc.stderr
    jobs, table = Counter(), False
    for line in proc.stdout.splitlines():
        parts = line.split()
        if line.startswith("job ") and "count" in line:
            table = True
        elif table and len(parts) == 2 and parts[1].isdigit() and parts[0] != "total":
            # The graft sweeps' rules, one a list of lam values (graftlab.planning.layout.sweep_rule), as one.
            jobs[re.sub(r"_lam(_\w+)$", "", parts[0])] += int(parts[1])
        elif table and parts[:1] == ["total"]:
            break
    return jobs


def overlay(tmp_path: Path, name: str, experiment: dict, exp: str = "expert") -> Path:
    return write_config(tmp_path, name, {"experiments": {exp: experiment}})


def write_config(tmp_path: Path, name: str, config: dict) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def retention_home(workdir: Path, exp: str = "expert") -> Path:
    """The smoke experiment's retention home in `workdir` (rules/fisher.smk), as its layout names it."""
    from graftlab.planning.config import resolve
    from graftlab.planning.layout import Experiment

    return workdir / Experiment.of(resolve(yaml.safe_load(SMOKE.read_text())), exp).retention_home()


def test_smoke_run_writes_summary_and_plot(smoke):
    exp = smoke / "results" / "expert"
    summary = pl.read_parquet(exp / "summary.parquet")
    # post; donor step~50 as it is; SFT of post and of the donor at 2 epochs; graft lam 1 and merge lam 0.5
    # at 2 epochs; diag-masked at rho 0.1: the grafts at both epochs, the merge at epoch 2 (merge.masks.epochs);
    # OPSD at 3 alphas, GRPO, SDPO under 3 teacher schedules and SDPO-CoT.
    assert summary.height == 1 + 1 + 4 + 4 + 3 + 3 + 5
    assert Counter(summary["method"]) == {
        "post": 1,
        "donor": 1,
        "sft": 2,
        "donor_sft": 2,
        "graft": 4,
        "merge": 3,
        "opsd": 3,
        "grpo": 1,
        "sdpo": 3,
        "sdpo_cot": 1,
    }
    assert set(summary.filter(pl.col("method") == "opsd")["alpha"]) == {"0", "0.5", "1"}
    masked = summary.filter(pl.col("mask") == "diag")
    assert Counter(masked["method"]) == {"graft": 2, "merge": 1} and set(masked["rho"]) == {"0.1"}
    assert set(summary.filter(pl.col("mask") == "none")["rho"]) == {"0"}
    assert summary["old"].is_between(0, 1).all() and summary["new"].is_between(0, 1).all()
    from matplotlib.image import imread

    assert imread(exp / "pareto.png").shape[0] > 100


def test_models_load_in_transformers_and_grafts_are_temporary(smoke):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # The knowledge setting's donor is a post-training checkpoint, kept beside the post model.
    models = ["results/world/ladder/step~50", "results/world/post_ladder/post~48", "results/world/post"]
    for model in models + ["results/expert/sft/post/lr~1e-3/epoch~2", "results/knowledge/sft/post~48/lr~1e-3/epoch~2"]:
        AutoModelForCausalLM.from_pretrained(smoke / model)
        assert AutoTokenizer.from_pretrained(smoke / model).eos_token == "<|im_end|>"
    assert not list((smoke / "results").rglob("graft/**/model.safetensors"))


def test_grafts_on_disk_never_exceed_the_cap_and_the_run_reports_its_disk(smoke):
    # The smoke run holds `--resources temp_grafts=1` on 2 cores (conftest.WHOLE_RUN): every graft's model
    # existed alone, though other jobs ran beside the grafts.
    from graftlab.planning.disk import graft_peak

    records = [json.loads(p.read_text()) for p in (smoke / "results").glob("*/graft/**/seconds.json")]
    assert len(records) == 25 and all(r["model_bytes"] > 0 for r in records)
    spans = sorted((r["model_written_at"], r["model_deleted_at"]) for r in records)
    assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:]))
    count, peak = graft_peak(smoke)
    assert count == 1 and peak == max(r["model_bytes"] for r in records)
    # results/disk.tsv, written when the run succeeded: every rule that left outputs, and the grafts' peak.
    disk = pl.read_csv(smoke / "results/disk.tsv", separator="\t")
    rules = {"sft", "fisher", "evaluate", "graft_lam_1", "world_pretrain", "graft (temporary, peak)"}
    assert rules <= set(disk["rule"])
    sft = disk.filter(rule="sft")
    assert sft["outputs"].item() == 12


def test_evaluation_records_and_metrics(smoke):
    run = smoke / "results/expert/eval/graft/step~50/lr~1e-3/epoch~1/lam~1/mask~none/rho~0"
    metrics = json.loads((run / "metrics.json").read_text())
    assert set(metrics["benchmarks"]) == {"add", "sub", "compare", "mul"}
    assert metrics["benchmarks"]["mul"]["role"] == "new"
    records = pl.read_parquet(run / "mul.parquet")
    assert records.height == 16 * 2  # held-out problems x samples
    assert records["correct"].mean() == pytest.approx(metrics["new"])
    old = [metrics["benchmarks"][b]["acc@n"] for b in ("add", "sub", "compare")]
    assert metrics["old"] == pytest.approx(sum(old) / 3)


def test_rollouts_are_chat_completions_of_fresh_old_task_prompts(smoke):
    from transformers import AutoTokenizer

    from graftlab.fisher.diag import read_rollouts
    from graftlab.tasks import chat_prompt

    rollouts = pl.read_parquet(retention_home(smoke) / "rollouts.parquet")
    assert Counter(rollouts["task"]) == {"add": 8, "sub": 8, "compare": 8}
    benchmark_ids = set(
        pl.concat([pl.read_parquet(f) for f in (smoke / "results/world/benchmarks").glob("*.parquet")])["id"]
    )
    assert not set(rollouts["problem_id"]) & benchmark_ids and rollouts["problem_id"].n_unique() == 24
    tok = AutoTokenizer.from_pretrained(smoke / "results/world/post")
    for row in rollouts.iter_rows(named=True):
        assert tok.decode(row["prompt_ids"], skip_special_tokens=False) == chat_prompt(tok, row["prompt"])
        assert tok.decode(row["completion_ids"], skip_special_tokens=False) == row["completion"]
        assert 1 <= len(row["completion_ids"]) <= 40 and tok.eos_token_id not in row["completion_ids"][:-1]
    assert len(read_rollouts(retention_home(smoke) / "rollouts.parquet")) == 24


def test_fisher_is_kept_and_masked_grafts_are_evaluated(smoke):
    from safetensors import safe_open

    fisher = retention_home(smoke)
    assert sorted(p.name for p in fisher.iterdir()) == [
        "diag",
        "rollouts.json",
        "rollouts.parquet",
    ]  # no kfac: no graft asks for it
    # One retention home for the five experiments on the main world's post model, one for `narrow`'s world.
    homes = sorted(p.name for p in (smoke / "results/fisher").iterdir())
    assert homes == sorted({fisher.name, retention_home(smoke, "narrow").name}) and len(homes) == 2
    with safe_open(str(fisher / "diag" / "diag.safetensors"), framework="pt") as f:
        assert any("mlp" in name for name in f.keys())
    run = smoke / "results/expert/eval/graft/post/lr~1e-3/epoch~2/lam~0.5/mask~diag/rho~0.1"
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["run"] == "graft/post/lr~1e-3/epoch~2/lam~0.5/mask~diag/rho~0.1"
    # Named by its record's directory, not the random scratch directory it was evaluated in: a re-run
    # writes the same bytes.
    assert metrics["model"] == "results/expert/graft/post/lr~1e-3/epoch~2/lam~0.5/mask~diag/rho~0.1"
    assert not (smoke / "results/expert/graft/post/lr~1e-3/epoch~2/lam~0.5/mask~diag/rho~0.1/model").exists()


def test_latency_charges_every_run_its_timed_work(smoke):
    exp = smoke / "results/expert"
    runs, summary = pl.read_parquet(exp / "latency.parquet"), pl.read_parquet(exp / "summary.parquet")
    assert runs["run"].to_list() == summary["run"].to_list()
    assert sorted(runs.filter("best")["method"]) == ["graft", "grpo", "merge", "opsd", "sdpo", "sdpo_cot", "sft"]
    on_policy = runs.filter(pl.col("method").is_in(["opsd", "grpo", "sdpo", "sdpo_cot"]))
    assert (on_policy["sample_s"] > 0).all() and (runs.filter(method="sft")["sample_s"] == 0).all()
    fisher = json.loads((retention_home(smoke) / "rollouts.json").read_text())["sample_s"]
    fisher += json.loads((retention_home(smoke) / "diag/seconds.json").read_text())["fisher_s"]
    masked = runs.filter(mask="diag")["fisher_s"].to_list()
    assert masked == pytest.approx([fisher] * 3)  # 2 grafts and a merge ranked by the diag Fisher
    steps = pl.read_parquet(exp / "latency_steps.parquet")
    on_policy = ["OPSD", "GRPO", "SDPO", "SDPO-CoT"]
    assert steps["what"].to_list() == [*on_policy, "SFT of post", "donor SFT (grafting)", "graft (once)"]
    assert steps["sampling_share"][:4].is_between(0, 1, closed="none").all()
    assert steps["sampling_share"][4:].to_list() == [0, 0, 0]


def test_drift_and_the_study_cover_every_tiny_world_experiment(smoke):
    from graftlab.analysis.drift import drift_ratio

    drift = pl.read_parquet(smoke / "results/narrow/drift.parquet")
    # graft epochs [2] x one donor x one lr; the ratio is the world's, from its own init, base and post.
    assert drift.select("donor", "lr", "epoch").rows() == [("step~50", "1e-3", "2")]
    world = smoke / "results/worlds/narrow"
    assert drift["drift_ratio"][0] == pytest.approx(
        drift_ratio(world / "init", world / "ladder/step~150", world / "post")
    )
    assert -1 <= drift["cos"][0] <= 1
    study = pl.read_parquet(smoke / "results/study/study.parquet")
    assert sorted(study["exp"]) == sorted(["expert", "knowledge", "teacher", "star", "pedagogical", "narrow"])
    assert study.filter(exp="narrow")["drift_ratio"][0] == pytest.approx(drift["drift_ratio"][0])
    # Only narrow is evaluated with a validation split: its verdict exists on both splits.
    assert study.filter(pl.col("reproduces_val").is_not_null())["exp"].to_list() == ["narrow"]
    summary = pl.read_parquet(smoke / "results/narrow/summary.parquet")
    assert summary["old_val"].is_not_null().all() and summary["new_val"].is_not_null().all()
    assert pl.read_parquet(smoke / "results/study/groups.parquet").height == 6


def test_the_study_can_cover_part_of_the_experiments(smoke, tmp_path):
    part = write_config(tmp_path, "part", {"study": {"experiments": ["narrow"]}})
    # The table and its report page only; every result is kept.
    assert planned_jobs(smoke, part) == {"study": 1, "report_tables": 1, "all": 1}


def test_takeover_reads_every_run_of_the_tiny_world_experiments(smoke):
    summary = pl.read_parquet(smoke / "results/narrow/summary.parquet")
    takeover = pl.read_parquet(smoke / "results/narrow/takeover.parquet")
    assert sorted(takeover["run"]) == sorted(summary["run"])
    assert takeover.filter(method="post")["takeover"].item() < 0.05  # it never saw a multiplication trace
    assert takeover.select(pl.col("takeover", "own_form").is_between(0, 1).all()).row(0) == (True, True)
    study = pl.read_parquet(smoke / "results/study/study.parquet")
    shown = study.filter(pl.col("takeover_sft").is_not_null())["exp"]
    assert sorted(shown) == ["expert", "narrow"]  # knowledge and the real-data settings have no procedures to read


def test_every_job_has_a_log(smoke):
    logs = {p.relative_to(smoke / "logs").as_posix() for p in (smoke / "logs").rglob("*.log")}
    assert {"world/pretrain.log", "world/posttrain.log", "expert/sft/post/lr~1e-3.log"} <= logs
    assert any(log.startswith("mined/") for log in logs)  # mining, by its home (results/mined/)
    assert "it/s" in (smoke / "logs/world/pretrain.log").read_text()  # the progress bar went to the log
    # Each trainer's live metrics, under its log's path (TRL's SFT and GRPO, our own OPSD and SDPO loops).
    board = smoke / "logs/tensorboard/expert"
    for run in (
        "sft/post/lr~1e-3",
        "grpo/post/lr~1e-3",
        "opsd/post/alpha~0.5/lr~1e-4",
        "sdpo/post/teacher~frozen/lr~1e-3",
    ):
        assert list((board / run).rglob("events.out.tfevents.*")), run


def test_every_timed_job_ran_in_a_warm_worker_that_recorded_its_own_usage(smoke):
    """The smoke run's jobs are forked from the warm process (graftlab.io.warm), each leaving its CPU seconds
    and peak memory beside its benchmark file, which `graftlab inspect` reads; the fetch rules run cold
    (they switch the hub on before their imports)."""
    from graftlab.commands.inspect_results import job_usage, read_benchmark
    from graftlab.io.warm import usage_file

    timed = sorted((smoke / "benchmarks/jobs").rglob("*.tsv"))
    assert len(timed) > 200
    for bench in timed:
        waiting = read_benchmark(bench)
        if waiting["rule"] in ("dataset", "fetch_model"):
            assert not usage_file(bench).exists(), bench
            continue
        assert usage_file(bench).is_file(), bench
        # The worker holds torch (hundreds of MB); the process Snakemake timed only waited for it.
        assert job_usage(bench)["max_rss"] > 100 > waiting["max_rss"], bench


def test_mining_keeps_never_solved_and_splits_disjointly(smoke):
    train, heldout = (pl.read_parquet(smoke / new_data("expert", part)) for part in ("train", "heldout"))
    assert heldout.height == 16 and train.height == 48 - 16
    assert not set(train["id"]) & set(heldout["id"])
    assert (pl.concat([train, heldout])["pass_rate"] == 0).any()


def test_experiments_that_mine_and_evaluate_alike_share_those_jobs(smoke):
    """star, teacher and pedagogical read one data set, mine it alike and evaluate the post model alike: one
    data set job, one mining job, one evaluation, whose records and metrics.json each experiment holds."""
    exps = ("star", "teacher", "pedagogical")
    assert len(list((smoke / "logs/sources").glob("*.log"))) == 1
    assert len(list((smoke / "results/mined").iterdir())) == 3  # expert's, theirs, narrow's
    assert not any((smoke / f"logs/{e}/mine.log").exists() for e in exps)
    assert len(list((smoke / "logs/shared").glob("eval~*.log"))) == 1
    assert not any((smoke / f"logs/{e}/eval/post.log").exists() for e in exps)
    dirs = [smoke / f"results/{e}/eval/post" for e in exps]
    names = [sorted(f.name for f in d.iterdir()) for d in dirs]
    assert names[0] == names[1] == names[2] and "heldout.parquet" in names[0] and "metrics.json" in names[0]
    assert all(len({(d / n).read_bytes() for d in dirs}) == 1 for n in names[0])


def test_second_run_schedules_nothing(smoke):
    assert planned_jobs(smoke) == Counter()


def test_new_lambda_schedules_only_its_sweeps_and_their_evaluations(smoke, tmp_path):
    jobs = planned_jobs(smoke, overlay(tmp_path, "lam", {"graft": {"lam": ["1", "2"]}}))
    # The unmasked and diag-masked sweeps (masks.lam follows graft.lam) at both epochs, now over lam 1 and 2:
    # each sweep's job makes and evaluates both grafts and measures their updates for the sensitive-weight
    # analysis (rules/graft.smk). The merges' sweeps are kept.
    assert jobs == {"graft": 4} | ANALYSES


def test_a_sweep_that_gains_a_lambda_samples_only_its_new_graft(smoke, tmp_path):
    """On a copy of the smoke run (a moved run keeps its stores: graftlab.sample_chunks), the unmasked sweep
    of epoch 2 given lam 1 and 2: its job remakes the lam 1 graft and reads that graft's samples back from
    the store the smoke run's job kept, to the same metrics.json, and samples lam 2's alone."""
    import shutil

    work = tmp_path / "run"
    shutil.copytree(smoke, work, symlinks=True)
    graft = "results/expert/eval/graft/step~50/lr~1e-3/epoch~2/lam~{}/mask~none/rho~0/metrics.json"
    before = (work / graft.format(1)).read_bytes()
    lam = overlay(tmp_path, "lam", {"graft": {"lam": ["1", "2"]}})
    proc = snakemake(work, "--cores", "all", graft.format(2), configs=(SMOKE, lam))  # the target after an option
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (work / graft.format(1)).read_bytes() == before
    log = (work / "logs/expert/graft/step~50/lr~1e-3/epoch~2/mask~none/rho~0.log").read_text()
    read = re.findall(r"^sampling: (\d+) of (\d+) chunks read back from (\S+)$", log, re.M)
    kept = [work / "resume" / graft.format(lam) for lam in (1, 2)]
    assert read and {work / store for _, _, store in read} == {kept[0]}, log[-3000:]
    assert all(done == whole for done, whole, _ in read)  # every call of lam 1 read back whole
    # Both stores kept, each with the chunks its graft's calls used: lam 1's read, lam 2's sampled.
    assert len(list(kept[0].glob("*-*.json"))) == sum(int(whole) for _, whole, _ in read)
    assert len(list(kept[1].glob("*-*.json"))) == len(read)  # the same calls, one chunk each here


def test_new_rho_schedules_only_its_masked_grafts_not_the_fisher(smoke, tmp_path):
    jobs = planned_jobs(smoke, overlay(tmp_path, "rho", {"graft": {"masks": {"rho": ["0.1", "0.2", "0.5"]}}}))
    expected = {"graft": 4}  # 2 rho x 2 epochs
    assert jobs == expected | ANALYSES


def test_new_mask_kind_computes_its_fisher_once_from_the_same_rollouts(smoke, tmp_path):
    both = {"kinds": ["diag", "kfac"]}
    jobs = planned_jobs(smoke, overlay(tmp_path, "kfac", {"graft": {"masks": both}, "merge": {"masks": both}}))
    expected = {"fisher": 1, "graft": 3}
    assert jobs == expected | ANALYSES


def test_mask_settings_rerun_masked_grafts_only(smoke, tmp_path):
    jobs = planned_jobs(smoke, overlay(tmp_path, "scope", {"graft": {"masks": {"scope": "tensor"}}}))
    expected = {"graft": 2}
    assert jobs == expected | ANALYSES


def test_fisher_settings_rerun_the_fisher_they_shape_and_never_the_rollouts(smoke, tmp_path):
    # With no KFAC mask in use, an EKFAC setting shapes nothing: refused, not silently ignored.
    refused = snakemake(smoke, "-n", configs=(SMOKE, overlay(tmp_path, "ekfac", {"fisher": {"ekfac": True}})))
    said = refused.stdout + refused.stderr  # Snakemake prints a config error on stdout
    assert refused.returncode and "experiments.expert.fisher.ekfac: is set but no mask kind is kfac" in said
    # The batch size is memory, not results: nothing re-runs.
    assert planned_jobs(smoke, overlay(tmp_path, "batch", {"fisher": {"batch_size": 4}})) == Counter()
    # More rollouts: new rollouts, a new Fisher, and every update's sensitivity: the 7 graft jobs (which
    # measure their own, and so graft and evaluate again), and 2 SFT epochs, 3 OPSD, 1 GRPO and 4 SDPO runs.
    jobs = planned_jobs(smoke, overlay(tmp_path, "more", {"fisher": {"rollouts": 30}}))
    assert jobs["rollouts"] == 1 and jobs["fisher"] == 1 and jobs["sensitivity_update"] == 10 and jobs["graft"] == 7
    assert not {"opsd", "grpo", "sdpo"} & set(jobs)  # the runs themselves are kept


def test_each_fisher_is_planned_once_however_many_grafts_use_it(tmp_path):
    masks = {"kinds": ["diag", "kfac"], "rho": ["0.01", "0.1", "0.5"]}
    sweep = overlay(tmp_path, "sweep", {"graft": {"lam": ["0.5", "1"], "masks": masks}, "merge": {"masks": masks}})
    jobs = planned_jobs(tmp_path, sweep, targets=("results/expert/summary.parquet",))
    # A job a sweep (both graft lam values in one): masked, 2 kinds x 3 rho x (2 graft epochs + 1 merge epoch);
    # unmasked, the graft's and the merge's 2 epochs each.
    assert jobs["fisher"] == 2 and jobs["rollouts"] == 1 and jobs["graft"] == 6 * (2 + 1) + 2 + 2


def test_evaluations_and_grafts_sampled_in_parts_score_byte_for_byte_as_one_job(smoke, tmp_path):
    """`eval.parts: 2` on a copy of the smoke run: the post model's evaluation, a training run's checkpoints
    and a graft, their metrics removed, are each sampled by two part jobs and then read back and graded by
    their own job. Every metrics.json is the one job's, byte for byte; the parts and their stores are gone."""
    import shutil

    work = tmp_path / "run"
    shutil.copytree(smoke, work, symlinks=True)
    sweep = "graft/step~50/lr~1e-3/epoch~2/mask~none/rho~0"  # the sweep of one lam, 1
    graft = "graft/step~50/lr~1e-3/epoch~2/lam~1/mask~none/rho~0"
    runs = ["post", "sft/step~50/lr~1e-3/epoch~1", "sft/step~50/lr~1e-3/epoch~2", graft]
    metrics = [work / "results/expert/eval" / run / "metrics.json" for run in runs]
    before = [m.read_bytes() for m in metrics]
    for m in metrics:
        m.unlink()
    parts = overlay(tmp_path, "parts", {"eval": {"parts": 2}})
    targets = [str(m.relative_to(work)) for m in metrics]
    proc = snakemake(work, "--cores", "all", *targets, configs=(SMOKE, parts))  # targets after an option
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [m.read_bytes() for m in metrics] == before
    logs = sorted(p.relative_to(work / "logs/expert").as_posix() for p in (work / "logs/expert").rglob("part~*"))
    assert logs == [
        f"{where}/part~{i}of2.log" for where in ("eval/post", "eval/sft/step~50/lr~1e-3", sweep) for i in (0, 1)
    ]
    # The parts' stores are gone; a sweep's job keeps its grafts' (test_a_sweep_that_gains_a_lambda_...), and an
    # adaptive sweep's screening its screenings' (`narrow`'s, test_an_adaptive_sweep_...).
    assert not list((work / "results").rglob("part~*"))
    stores = {p.parent.relative_to(work / "resume/results") for p in (work / "resume").rglob(FINGERPRINT)}
    assert stores and all(s.parts[1:3] == ("eval", "graft") or s.parts[1] == "screen" for s in stores), stores
    # Each job read every call back from its parts' chunks (the tiny world's calls are one chunk each).
    for log in ("eval/post.log", "eval/sft/step~50/lr~1e-3.log", f"{sweep}.log"):
        assert "sampling: 1 of 1 chunks read back" in (work / "logs/expert" / log).read_text()


def test_an_adaptive_sweep_scores_fully_only_the_grafts_that_can_reach_the_frontier(smoke, tmp_path):
    """On a copy of the smoke run, grafts at lam 64 join two adaptive sweeps (eval.adaptive). In `narrow`
    (adaptive in the smoke run), the graft already scored is re-scored to the same bytes and the new one is
    screened on the validation problems only. In `expert`, made adaptive here, the decisions are the
    screening rule's; a graft they screen out keeps its screening scores and no records, the summary leaves
    it out, and every analysis of the sweep runs with it in."""
    import shutil

    from graftlab.evaluate.run import in_validation

    work = tmp_path / "run"
    shutil.copytree(smoke, work, symlinks=True)
    keys = "step~50/lr~1e-3/epoch~2/lam~{}/mask~none/rho~0"
    kept, wild = (f"graft/{keys.format(lam)}" for lam in ("1", "64"))
    narrow, expert = work / "results/narrow", work / "results/expert"
    before = (narrow / "eval" / kept / "metrics.json").read_bytes()
    sweeps = {
        "narrow": {"graft": {"lam": ["1", "64"]}},
        "expert": {"graft": {"lam": ["1", "64"]}, "eval": {"validation": 0.5, "adaptive": 0.5}},
    }
    grown = write_config(tmp_path, "grown", {"experiments": sweeps})
    # Every analysis of the expert sweep reads its runs, a screened-out one among them.
    analyses = ["pareto.png", "gain_forgetting.parquet", "latency.parquet", "takeover.parquet", "sensitivity.parquet"]
    targets = ["results/narrow/summary.parquet", *(f"results/expert/{a}" for a in analyses)]
    proc = snakemake(work, "--cores", "all", *targets, configs=(SMOKE, grown))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (narrow / "eval" / kept / "metrics.json").read_bytes() == before  # re-decided, and kept: the same
    assert wild in json.loads((narrow / "screen/decisions.json").read_text())
    # The grown sweep's screening read the kept graft's screening samples back instead of sampling them.
    log = (work / "logs/narrow/screen/graft/step~50/lr~1e-3/epoch~2/mask~none/rho~0.log").read_text()
    assert re.search(rf"chunks read back from \S*{re.escape(kept)}", log), log[-2000:]
    # A screening samples the validation problems only, each benchmark's: the ones a full evaluation scores apart.
    benches = sorted((narrow / "screen" / wild).glob("*.parquet"))
    scored = json.loads((narrow / "eval" / wild / "metrics.json").read_text())["benchmarks"]
    assert [b.stem for b in benches] == sorted(scored)
    for bench in benches:
        ids = pl.read_parquet(bench)["problem_id"].unique().to_list()
        assert ids and all(in_validation(bench.stem, ids, 0.5))

    # The decisions are the screening rule's on the screenings written (graftlab.analysis.screen). With the
    # smoke world's 8 problems a benchmark screened, a destroyed model's interval stays wide (no answer right
    # in 8 problems bounds its accuracy only below 0.37), so no graft here lies wholly beyond another's.
    from graftlab.analysis.screen import read_points, screen

    screens = sorted((expert / "screen/graft").rglob("metrics.json"))
    decisions = json.loads((expert / "screen/decisions.json").read_text())
    assert decisions == json.loads(json.dumps(screen(read_points(screens)))) and len(decisions) == len(screens)
    # A graft the decisions screen out is scored no further: here, lam 64 screened out by lam 1's interval
    # (decisions of the run's own screenings, written as if that interval had lain beyond), so its job and
    # every analysis after it rerun.
    decisions[wild] = {"kept": False, "by": kept, "interval": decisions[wild]["interval"]}
    decisions[wild]["by_interval"] = decisions[kept]["interval"]
    (expert / "screen/decisions.json").write_text(json.dumps(decisions))
    proc = snakemake(work, "--cores", "all", *targets[1:], configs=(SMOKE, grown))
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((expert / "eval" / wild / "metrics.json").read_text())
    assert record["screened_out"]["by"] == kept and record["screening"] == 0.5 and "old" not in record
    assert record["old_val"] == json.loads((expert / "screen" / wild / "metrics.json").read_text())["old_val"]
    assert not list((expert / "eval" / wild).glob("*.parquet"))  # no records: nothing sampled
    runs = pl.read_parquet(expert / "summary.parquet")["run"].to_list()
    assert kept in runs and wild not in runs
    taken = pl.read_parquet(expert / "takeover.parquet")["run"].to_list()
    assert kept in taken and wild not in taken


def test_adaptive_checkpoints_screen_the_training_runs_beside_the_grafts(smoke, tmp_path):
    """On a copy of the smoke run, `narrow` (an adaptive sweep) screens its SFT and OPSD checkpoints too
    (eval.adaptive_checkpoints): each is scored first on the validation problems alone, one decision is taken
    over grafts, merges and checkpoints, and a checkpoint kept is scored fully to the bytes it had unscreened,
    its samples kept. One the decisions screen out keeps its screening scores and no records, and the
    summary leaves it out, while its kept neighbour is re-scored from its samples to the same bytes."""
    import shutil

    from graftlab.evaluate.run import in_validation
    from graftlab.train.resume import resume_dir

    work = tmp_path / "run"
    shutil.copytree(smoke, work, symlinks=True)
    narrow = work / "results/narrow"
    runs = ["sft/post/lr~1e-3/epoch~1", "sft/post/lr~1e-3/epoch~2", "opsd/post/alpha~0.5/lr~1e-4/step~4"]
    before = {run: (narrow / "eval" / run / "metrics.json").read_bytes() for run in runs}
    grown = write_config(tmp_path, "grown", {"experiments": {"narrow": {"eval": {"adaptive_checkpoints": True}}}})
    targets = ["results/narrow/summary.parquet", "results/study/study.parquet"]
    proc = snakemake(work, "--cores", "all", *targets, configs=(SMOKE, grown))
    assert proc.returncode == 0, proc.stderr[-3000:]
    decisions = json.loads((narrow / "screen/decisions.json").read_text())
    assert set(runs) < set(decisions) and len(decisions) == len(runs) + 2  # and the graft and the merge
    for run in runs:
        benches = sorted((narrow / "screen" / run).glob("*.parquet"))
        assert benches, run
        for bench in benches:
            ids = pl.read_parquet(bench)["problem_id"].unique().to_list()
            assert ids and all(in_validation(bench.stem, ids, 0.5))
        if decisions[run]["kept"]:
            metrics = f"results/narrow/eval/{run}/metrics.json"
            assert (work / metrics).read_bytes() == before[run]
            assert any((work / resume_dir(metrics)).glob("*-*.json")), run  # its samples kept

    # A checkpoint the decisions screen out (written as if epoch 2's interval had lain beyond epoch 1's) is
    # scored no further; its job reruns, and scores epoch 2 again from its kept samples.
    out, by = runs[:2]
    decisions[out] = {"kept": False, "by": by, "interval": decisions[out]["interval"]}
    decisions[out]["by_interval"] = decisions[by]["interval"]
    decisions[by]["kept"] = True
    (narrow / "screen/decisions.json").write_text(json.dumps(decisions))
    proc = snakemake(work, "--cores", "all", *targets, configs=(SMOKE, grown))
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((narrow / "eval" / out / "metrics.json").read_text())
    assert record["screened_out"]["by"] == by and record["screening"] == 0.5 and "old" not in record
    assert not list((narrow / "eval" / out).glob("*.parquet"))  # no records: nothing sampled
    assert (narrow / "eval" / by / "metrics.json").read_bytes() == before[by]
    summary = pl.read_parquet(narrow / "summary.parquet")["run"].to_list()
    assert by in summary and out not in summary


def test_each_training_run_is_evaluated_in_one_job_by_the_rule_of_its_checkpoints(tmp_path):
    """The same run key keeping other checkpoints in two experiments: each evaluated by its own list's rule,
    and no file matched by two rules (an OPSD run kept at steps 2 and 4 in `expert`, at step 2 alone in
    `knowledge`, where `expert`'s GRPO and SDPO also keep step 2 alone)."""
    both = write_config(
        tmp_path,
        "both",
        {
            "experiments": {
                "expert": {"opsd": {"alpha": ["0.5"], "checkpoints": 2}},
                "knowledge": {"opsd": {"steps": 2}, "sft": {"epochs": 3}, "graft": {"epochs": [3]}},
            }
        },
    )
    targets = ("results/expert/summary.parquet", "results/knowledge/summary.parquet")
    jobs = planned_jobs(tmp_path, both, targets=targets)
    # expert's OPSD at steps 2 and 4; at step 2 alone, expert's GRPO and 4 SDPO runs and knowledge's OPSD.
    assert jobs["evaluate_run_step_2_4"] == 1 and jobs["evaluate_run_step_2"] == 1 + 4 + 1
    assert jobs["evaluate_run_step_4"] == 0 and jobs["evaluate_run_epoch_1_2_3"] == 1  # knowledge's SFT
    assert jobs["evaluate_run_epoch_1_2"] == 2  # expert's SFT of post and of the donor
    assert jobs["evaluate"] == 2 + 1  # the post model twice, expert's donor as it is


def test_new_learning_rate_reruns_only_that_sft_and_its_dependants(smoke, tmp_path):
    jobs = planned_jobs(smoke, overlay(tmp_path, "lr", {"sft": {"lr": ["2e-3"]}}))
    # SFT of post and of the donor, each run's epochs evaluated in one job; per epoch one graft and one merge,
    # the grafts masked too, the merge masked at epoch 2, each graft job evaluating its own model. The Fisher
    # belongs to the post model: kept.
    expected = {"sft": 2, "graft": 4 + 3, "evaluate_run_epoch_1_2": 2, "sensitivity_update": 2}  # SFT of post
    assert jobs == expected | ANALYSES | {"drift": 1}  # new SFT updates: the cosines with the donor's


# The smoke experiment `narrow` on its own world: every job of it, as re-planned when its inputs change.
NARROW = {"mine": 1, "expert_traces": 1, "sft": 2, "graft": 2, "opsd": 1, "rollouts": 1, "fisher": 1, "evaluate": 1}
NARROW |= {"evaluate_run_epoch_1_2": 1, "evaluate_run_step_4": 1}  # SFT of post's 2 epochs, OPSD's last step
NARROW |= {"sensitivity_update": 3, "drift": 1} | ANALYSES
NARROW |= {"graft_screen": 2, "screen": 1}  # an adaptive sweep: its graft and merge screened first
# A world's build: three old-task benchmarks, a job each.
WORLD_BUILD = {"world_tokenizer": 1, "world_benchmarks": 3, "world_candidates": 1, "world_corpus": 1}
WORLD_BUILD |= {"world_pretrain": 1, "world_posttrain": 1}


def test_a_named_world_is_built_apart_and_its_experiment_learns_on_it(smoke):
    from transformers import AutoConfig, AutoModelForCausalLM

    root = smoke / "results/worlds/narrow"
    assert AutoConfig.from_pretrained(root / "post").hidden_size == 32  # worlds.narrow.model.hidden_size
    assert AutoConfig.from_pretrained(smoke / "results/world/post").hidden_size == 64
    assert sorted(p.name for p in (root / "ladder").iterdir() if not p.name.startswith(".")) == ["step~150", "step~50"]
    AutoModelForCausalLM.from_pretrained(root / "init")
    sft = json.loads((smoke / "results/narrow/sft/step~50/lr~1e-3/epoch~2/graftlab.json").read_text())
    assert sft["inputs"]["model"] == "results/worlds/narrow/ladder/step~50"
    # The world's own seed draws its own problems; the experiment mines those.
    narrow, main = (set(pl.read_parquet(r / "candidates.parquet")["id"]) for r in (root, smoke / "results/world"))
    assert narrow != main and set(pl.read_parquet(smoke / new_data("narrow", "train"))["id"]) <= narrow
    assert (smoke / "logs/worlds/narrow/pretrain.log").exists()
    assert (smoke / "benchmarks/jobs/worlds/narrow/pretrain.tsv").exists()


def test_editing_a_named_world_reruns_that_world_and_its_experiment_only(smoke, tmp_path):
    wider = write_config(tmp_path, "wider", {"worlds": {"narrow": {"model": {"hidden_size": 48}}}})
    # The model changes from pretraining on: tokenizer, corpus and problem sets are kept.
    assert planned_jobs(smoke, wider) == {"world_pretrain": 1, "world_posttrain": 1} | NARROW


def test_an_experiment_seed_reruns_that_experiment_and_own_seeds_outlive_the_top_level_one(smoke, tmp_path):
    assert planned_jobs(smoke, overlay(tmp_path, "seed", {"seed": 5}, exp="narrow")) == NARROW
    # The main world and its five experiments follow the top-level seed (so does the moe model); the
    # narrow world and experiment, with seeds of their own, are kept.
    jobs = planned_jobs(smoke, write_config(tmp_path, "top", {"seed": 5}))
    # expert mines apart; star, teacher and pedagogical mine alike, once.
    assert jobs["world_pretrain"] == 1 and jobs["summary"] == 5 and jobs["mine"] == 2 and jobs["moe"] == 1


def test_experiments_on_a_named_world_share_its_build_and_leave_the_main_world_alone(tmp_path):
    smoke = yaml.safe_load(SMOKE.read_text())
    experiment = smoke["experiments"]["narrow"] | {"world": "a"}
    config = {
        "world": smoke["world"],
        "worlds": {"a": {"seed": 3}, "b": {}},
        "experiments": {"x": experiment, "y": experiment},
    }
    path = write_config(tmp_path, "worlds", config)
    jobs = planned_jobs(tmp_path, path, base=())
    assert {rule: n for rule, n in jobs.items() if rule.startswith("world_")} == WORLD_BUILD  # once for both
    assert jobs["mine"] == 1 and jobs["summary"] == 2  # x and y mine alike: once
    # Only what some experiment needs is built: neither the main world nor world b.
    proc = snakemake(tmp_path, "-n", configs=(path,))
    assert "results/worlds/a/post" in proc.stdout and "logs/worlds/a/pretrain.log" in proc.stdout
    assert "results/world/" not in proc.stdout and "results/worlds/b" not in proc.stdout


def test_worlds_differing_only_in_seed_draw_their_own_problems(tmp_path):
    smoke = yaml.safe_load(SMOKE.read_text())
    worlds = {"s0": {}, "s1": {"seed": 1}, "s2": {"seed": 2}}  # s0 takes the top-level seed, 0
    config = {"world": smoke["world"], "worlds": worlds, "experiments": {"x": smoke["experiments"]["expert"]}}
    roots = ["world", "worlds/s0", "worlds/s1", "worlds/s2"]
    targets = [f"results/{r}/{f}" for r in roots for f in ("candidates.parquet", "benchmarks/add.parquet")]
    proc = snakemake(tmp_path, "--cores", "2", *targets, configs=(write_config(tmp_path, "seeds", config),))
    assert proc.returncode == 0, proc.stderr[-3000:]
    drawn = {r: [pl.read_parquet(tmp_path / t)["id"].to_list() for t in targets if f"/{r}/" in t] for r in roots}
    assert drawn["worlds/s0"] == drawn["world"]
    for a, b in [("world", "worlds/s1"), ("world", "worlds/s2"), ("worlds/s1", "worlds/s2")]:
        assert all(x != y for x, y in zip(drawn[a], drawn[b])), (a, b)


def test_a_configfile_replaces_the_default_experiments(tmp_path):
    smoke = yaml.safe_load(SMOKE.read_text())
    smoke["experiments"] = {"other": smoke["experiments"]["expert"]}
    (tmp_path / "other.yaml").write_text(yaml.safe_dump(smoke))
    proc = snakemake(tmp_path, "-n", configs=(tmp_path / "other.yaml",))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "results/other/summary.parquet" in proc.stdout and "results/expert" not in proc.stdout


def test_graft_epochs_choose_which_sft_checkpoints_are_grafted(tmp_path):
    jobs = planned_jobs(
        tmp_path, overlay(tmp_path, "epochs", {"graft": {"epochs": [2]}}), targets=("results/expert/summary.parquet",)
    )
    # One donor at epoch 2 only, masked there too; merging still uses both epochs and its masked run epoch 2
    # (each graft job evaluates its own model); evaluated apart: post and the donor as it is, each SFT run's
    # 2 checkpoints in one job, the 3 OPSD runs, GRPO and 4 SDPO runs.
    assert jobs["graft"] == 1 + 1 + 2 + 1 and jobs["evaluate"] == 1 + 1
    assert jobs["evaluate_run_epoch_1_2"] == 2 and jobs["evaluate_run_step_4"] == 3 and jobs["evaluate_run_step_2"] == 5


@pytest.mark.parametrize(
    "experiment, message",
    [
        ({"grafts": {"lam": ["1"]}}, "config key experiments.expert: Additional properties are not allowed ('grafts'"),
        ({"graft": {"lam": ["-1"]}}, "config key experiments.expert.graft.lam.0: '-1' is invalid: A non-negative"),
        (
            {"donors": ["step~7"]},
            "config key experiments.expert.donors: step~7 is no checkpoint of world (step~50, step~150, post~48)",
        ),
        (
            {"graft": {"masks": {"rho": ["1.5"]}}},
            "config key experiments.expert.graft.masks.rho: ['1.5'] outside [0, 1]",
        ),
        (
            {"merge": {"masks": {"kinds": ["fim"]}}},
            "config key experiments.expert.merge.masks.kinds.0: 'fim' is not one of",
        ),
    ],
)
def test_bad_config_is_one_clear_error(tmp_path, experiment, message):
    proc = snakemake(tmp_path, "-n", configs=(SMOKE, overlay(tmp_path, "bad", experiment)))
    assert proc.returncode != 0
    assert message in proc.stdout + proc.stderr
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize(
    "config, message",
    [
        (
            {"experiments": {"expert": {"world": "w9"}}},
            "config key experiments.expert.world: 'w9' is neither `world` nor a name in worlds ['narrow']",
        ),
        (
            {"worlds": {"narrow": {"modle": {}}}},
            "config key worlds.narrow: Additional properties are not allowed ('modle' was unexpected)",
        ),
        ({"worlds": {"world": {}}}, "config key worlds: 'world' is invalid: A world's name"),
    ],
)
def test_bad_world_config_is_one_clear_error(tmp_path, config, message):
    proc = snakemake(tmp_path, "-n", configs=(SMOKE, write_config(tmp_path, "bad", config)))
    assert proc.returncode != 0
    assert message in proc.stdout + proc.stderr
    assert not (tmp_path / "results").exists()


def test_slurm_profile_plans_default_dag_without_a_cluster(tmp_path):
    proc = snakemake(tmp_path, "-n", "--profile", str(REPO / "profiles" / "slurm"), configs=())
    assert proc.returncode == 0, proc.stderr
    assert "world_pretrain" in proc.stdout and "pareto" in proc.stdout


def test_the_real_model_preset_plans_every_stage_without_the_tiny_world(tmp_path):
    # Hub ids are never contacted by a dry-run: the preset's DAG is checked here, its downloads on a cluster.
    proc = snakemake(tmp_path, "-n", "--quiet", "rules", configs=(REPO / "configs" / "qwen3-1.7b-star.yaml",))
    assert proc.returncode == 0, proc.stderr
    for rule in ("fetch_model", "dataset", "mine", "star", "sft", "rollouts", "fisher", "evaluate", "summary"):
        assert f"\n{rule} " in proc.stdout, rule
    assert "\ngraft_lam_" in proc.stdout  # a graft sweep's rule, named by its lam values
    assert "world_pretrain" not in proc.stdout
