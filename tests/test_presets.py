"""The presets of the grafting paper's real setups, each dry-run with its job count (nothing fetched), and
every hub model pinned by a revision field."""

import re

import pytest
import yaml

from tests.conftest import REPO, job_requests, snakemake

# Jobs of a dry-run from nothing: fetches, data sets, traces, SFT, graft sweeps (every lam of one in one
# job), evaluations (a training run's checkpoints in one job), analysis.
PRESETS = {
    "qwen3-1.7b-star.yaml": 51,
    "qwen3-1.7b-teacher.yaml": 84,
    "qwen3-8b-star.yaml": 108,  # every evaluation and graft sweep sampled in 3 parts (eval.parts)
    "olmo3-7b-knowledge.yaml": 267,
    "qwen3-4b-sdpo.yaml": 92,
    "qwen3-4b-continual.yaml": 209,  # 52 of them a chain's drift after a stage each
    "qwen3-4b-thinking.yaml": 179,
}


def local_sources(preset: str) -> list[str]:
    """The local data files a preset names (copied by hand before a run, as its comments say)."""
    from graftlab.io.fetch import looks_local

    text = (REPO / "configs" / preset).read_text()
    return [s for s in re.findall(r"source: (\S+?)[,}\s]", text) if looks_local(s)]


def dry_run(preset: str, workdir, *args: str) -> str:
    """The dry-run's output of `preset` in `workdir`, its local data files stood in for (the dry-run reads no
    data, but needs its inputs to exist)."""
    for path in local_sources(preset):
        (workdir / path).parent.mkdir(parents=True, exist_ok=True)
        (workdir / path).write_text('{"prompt": "q", "answer": "A", "idx": 1}\n')
    proc = snakemake(workdir, "-n", *args, configs=(REPO / "configs" / preset,))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_preset_dry_run_job_count_and_every_job_on_one_node(preset, tmp_path):
    """Under the cluster profile: the preset's jobs, each held to one node (a multi-GPU job starts its own
    processes on the node it is given, so SLURM must not spread its GPUs), none warned of (each fits its
    GPUs and, resuming within the profile's retries, its partition's time limit)."""
    out = dry_run(preset, tmp_path, "--profile", str(REPO / "profiles" / "slurm"))
    assert "warning" not in out
    total = re.search(r"^total\s+(\d+)$", out, re.M)
    assert total and int(total.group(1)) == PRESETS[preset]
    requests = [(rule, r) for rule, r in job_requests(out) if rule != "all"]
    assert len(requests) == PRESETS[preset] - 1
    assert [rule for rule, r in requests if r.get("nodes") != "1"] == []


@pytest.mark.parametrize("preset", [p for p in sorted(PRESETS) if p != "qwen3-1.7b-star.yaml"])
def test_new_presets_pin_a_revision_and_size_every_model(preset):
    models = yaml.safe_load((REPO / "configs" / preset).read_text())["models"]
    assert all("revision" in m and m["params"] > 1e9 for m in models.values())


def test_olmo_pretraining_donors_take_the_post_models_rope():
    models = yaml.safe_load((REPO / "configs" / "olmo3-7b-knowledge.yaml").read_text())["models"]
    assert {n for n, m in models.items() if m.get("rope_from")} == {"olmo3-7b-base"}
    assert all(m["rope_from"] == "olmo3-7b" for m in models.values() if m.get("rope_from"))


def test_the_continual_preset_is_planned_stage_by_stage(tmp_path):
    from graftlab.planning.plan import estimate, load_config

    plan = estimate(load_config([str(REPO / "configs" / "qwen3-4b-continual.yaml")], []))
    table = re.search(r"^job\s+count\n-+\s+-+\n(.*?)^total", dry_run("qwen3-4b-continual.yaml", tmp_path), re.M | re.S)
    dag = {rule: int(n) for rule, n in re.findall(r"^(\w+)\s+(\d+)$", table.group(1), re.M)}
    assert local_sources("qwen3-4b-continual.yaml") == [
        "data/continual/sciknoweval_chemistry_train.jsonl",
        "data/continual/sciknoweval_chemistry_test.jsonl",
        "data/continual/tooluse_train.jsonl",
        "data/continual/tooluse_test.jsonl",
    ]
    jobs = {rule: cost.jobs for rule, cost in plan.costs.items() if cost.jobs}
    assert jobs == dag  # the plan counts the dry-run's jobs, rule by rule
    # 4 stages x (GRPO, OPSD; SDPO under 3 teachers; the post model's own traces each stage).
    assert (jobs["chain_grpo"], jobs["chain_opsd"], jobs["chain_sdpo"], jobs["stage_star"]) == (4, 4, 12, 4)
    assert 100 < plan.total_gpu_hours < 1000
