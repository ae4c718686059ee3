"""The presets of the grafting paper's real setups, each dry-run with its job count (nothing fetched), and
every hub model pinned by a revision field."""

import re

import pytest
import yaml

from tests.conftest import REPO, snakemake

# Jobs of a dry-run from nothing: fetches, data sets, traces, SFT, grafts, evaluations, analysis.
PRESETS = {
    "qwen3-1.7b-star.yaml": 150,
    "qwen3-1.7b-teacher.yaml": 291,
    "qwen3-8b-star.yaml": 150,
    "olmo3-7b-knowledge.yaml": 508,
    "qwen3-4b-sdpo.yaml": 185,
}


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_preset_dry_run_job_count(preset, tmp_path):
    proc = snakemake(tmp_path, "-n", configs=(REPO / "configs" / preset,))
    assert proc.returncode == 0, proc.stderr[-3000:]
    total = re.search(r"^total\s+(\d+)$", proc.stdout + proc.stderr, re.M)
    assert total and int(total.group(1)) == PRESETS[preset]


@pytest.mark.parametrize("preset", [p for p in sorted(PRESETS) if p != "qwen3-1.7b-star.yaml"])
def test_new_presets_pin_a_revision_and_size_every_model(preset):
    models = yaml.safe_load((REPO / "configs" / preset).read_text())["models"]
    assert all("revision" in m and m["params"] > 1e9 for m in models.values())


def test_olmo_pretraining_donors_take_the_post_models_rope():
    models = yaml.safe_load((REPO / "configs" / "olmo3-7b-knowledge.yaml").read_text())["models"]
    assert {n for n, m in models.items() if m.get("rope_from")} == {"olmo3-7b-stage1", "olmo3-7b-base"}
    assert all(m["rope_from"] == "olmo3-7b" for m in models.values() if m.get("rope_from"))
