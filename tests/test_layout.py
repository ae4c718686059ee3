"""The results layout: run keys built from each shipped config parse back to what built them, and which
runs, inputs and timing records an experiment's jobs read."""

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from graftlab.fisher import KINDS as FISHER_KINDS
from graftlab.planning.config import resolve
from graftlab.planning.layout import (
    KEY_COLUMNS,
    ON_POLICY,
    Experiment,
    Run,
    checkpoint_groups,
    checkpoint_rule,
    eval_root,
    fisher_name,
    fisher_options,
    mining_homes,
    parse_run,
    retention_homes,
    run,
    shared_evaluations,
    shared_sources,
    source_file,
    source_id,
    study_experiments,
    sweep_groups,
    sweep_rule,
    world_checkpoint,
    worlds,
)

REPO = Path(__file__).resolve().parents[1]
CONFIGS = ("config.yaml", "configs/smoke.yaml", "configs/qwen3-1.7b-star.yaml", "configs/qwen3-4b-sdpo.yaml")
# What each kind of run parses to, by whether its base model is the post model.
METHOD = {("sft", True): "sft", ("sft", False): "donor_sft", ("graft", True): "merge", ("graft", False): "graft"}
METHOD |= {("opsd", True): "opsd", ("donor", False): "donor"}
METHOD |= {(kind, True): kind for kind in ("grpo", "sdpo", "sdpo_cot")}


def load(name: str) -> dict:
    return resolve(yaml.safe_load((REPO / name).read_text()))


@pytest.fixture(scope="module")
def smoke() -> dict:
    return load("configs/smoke.yaml")


def layouts(config: dict) -> list[Experiment]:
    return [Experiment.of(config, name) for name in config["experiments"]]


@pytest.mark.parametrize("name", CONFIGS)
def test_every_built_run_parses_back_to_the_keys_it_was_built_from(name):
    for xp in layouts(load(name)):
        built = xp.run_list()
        assert len({r.key for r in built}) == len(built), f"{xp.name}: a run is built twice"
        for r in built:
            parsed = parse_run(r.key)
            if r.kind == "post":
                assert parsed == {"method": "post", "donor": None} | dict.fromkeys(KEY_COLUMNS)
                continue
            assert parsed["method"] == METHOD[r.kind, r.donor == "post"]
            assert parsed.pop("donor") == r.donor and parsed.pop("method")
            assert parsed == dict.fromkeys(KEY_COLUMNS) | r.keys


def test_the_smoke_expert_evaluates_every_method(smoke):
    methods = [parse_run(key)["method"] for key in Experiment.of(smoke, "expert").runs()]
    # As the smoke run's summary counts them: diag masks on both graft epochs, on the merge's epoch 2.
    assert {m: methods.count(m) for m in set(methods)} == {
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
    runs = Experiment.of(smoke, "expert").runs()
    assert "graft/post/lr~1e-3/epoch~2/lam~0.5/mask~diag/rho~0.1" in runs
    assert runs[-5:] == [
        "grpo/post/lr~1e-3/step~2",
        "sdpo/post/teacher~frozen/lr~1e-3/step~2",
        "sdpo/post/teacher~ema:0.05/lr~1e-3/step~2",
        "sdpo/post/teacher~refresh:0.5/lr~1e-3/step~2",
        "sdpo_cot/post/teacher~ema:0.05/lr~1e-3/step~2",
    ]
    assert (parse_run(runs[-1])["method"], parse_run(runs[-1])["teacher"]) == ("sdpo_cot", "ema:0.05")


def test_donors_as_they_are_and_their_sft_are_evaluated_only_with_donor_sft(smoke):
    knowledge = Experiment.of(smoke, "knowledge").runs()
    assert not [k for k in knowledge if k.startswith(("donor/", "sft/step~"))]
    assert "graft/post~48/lr~1e-3/epoch~2/lam~1/mask~none/rho~0" in knowledge


def test_world_checkpoints_are_read_from_their_ladders(smoke):
    xp = Experiment.of(smoke, "knowledge")
    assert (xp.model_input("post~48"), xp.model_dir("post~48")) == (
        "results/world/post_ladder",
        "results/world/post_ladder/post~48",
    )
    pretrained = ("results/world/ladder", "results/world/ladder/step~50")
    assert (xp.model_input("step~50"), xp.model_dir("step~50")) == pretrained
    # Only canonical step numbers name a world checkpoint: `post~048` would be a second path for post~48.
    assert [world_checkpoint(n) for n in ("post~048", "post~", "post~4a", "poster~4", "post")] == [None] * 5
    assert world_checkpoint("post~48") == ("posttrain", "post_ladder", 48)


def test_opsd_keeps_evenly_spaced_checkpoints(smoke):
    x = smoke["experiments"]["expert"] | {"opsd": smoke["experiments"]["expert"]["opsd"] | {"checkpoints": 2}}
    xp = Experiment("expert", x, worlds(smoke)["world"])
    steps = [r.keys["step"] for r in xp.run_list() if r.kind == "opsd" and r.keys["alpha"] == "0"]
    assert steps == ["2", "4"]


def test_sensitivity_measures_every_update_of_the_post_model(smoke):
    xp = Experiment.of(smoke, "expert")
    measured = {parse_run(k)["method"] for k in xp.sensitivity_runs()}
    assert measured == {"sft", "graft", "merge", "opsd", "grpo", "sdpo", "sdpo_cot"}
    assert len(xp.sensitivity_runs()) == 2 + 4 + 3 + 3 + 5


def test_latency_reads_each_training_run_graft_and_fisher(smoke):
    records = Experiment.of(smoke, "expert").latency_records()
    assert records[:5] == [
        "results/expert/sft/post/lr~1e-3",
        "results/expert/sft/step~50/lr~1e-3",
        "results/expert/opsd/post/alpha~0/lr~1e-4",
        "results/expert/opsd/post/alpha~0.5/lr~1e-4",
        "results/expert/opsd/post/alpha~1/lr~1e-4",
    ]
    assert sum(r.endswith("/seconds.json") for r in records) == 7
    home = Experiment.of(smoke, "expert").retention_home()
    assert records[-2:] == [f"{home}/diag", f"{home}/rollouts.json"]
    # Unmasked grafts only: no Fisher to charge.
    assert not [r for r in Experiment.of(smoke, "narrow").latency_records() if "/fisher/" in r]


def test_drift_pairs_each_grafted_donor_update_with_the_post_sft_update(smoke):
    (update,) = Experiment.of(smoke, "narrow").drift_updates()
    assert update == {
        "donor": "step~50",
        "lr": "1e-3",
        "epoch": 2,
        "donor_dir": "results/worlds/narrow/ladder/step~50",
        "tuned_dir": "results/narrow/sft/step~50/lr~1e-3/epoch~2",
        "post_sft_dir": "results/narrow/sft/post/lr~1e-3/epoch~2",
    }


def test_models_and_benchmarks_lie_in_the_experiments_world(smoke):
    narrow, teacher = Experiment.of(smoke, "narrow"), Experiment.of(smoke, "teacher")
    assert narrow.post_dir == "results/worlds/narrow/post"
    assert narrow.model_input("step~50") == "results/worlds/narrow/ladder"
    assert narrow.candidates() == "results/worlds/narrow/candidates.parquet"
    assert narrow.eval_benchmarks()[0] == ["add", "results/worlds/narrow/benchmarks/add.parquet", "old", "arith"]
    assert narrow.eval_benchmarks()[-1] == ["mul", f"{narrow.mining_home()}/heldout.parquet", "new", "arith"]
    assert narrow.mining_home().startswith("results/mined/worlds-narrow-post-")
    assert teacher.candidates() == source_file(teacher.x["problems"])  # read once, in results/sources/
    assert teacher.new_benchmark() == ("heldout", "arith")
    assert Experiment.of(smoke, "knowledge").new_benchmark() == ("knowledge", "knowledge")
    assert Experiment.of(load("configs/qwen3-1.7b-star.yaml"), "star").post_dir.startswith("resources/models/")


def test_each_evaluated_model_and_the_directory_it_is_read_from(smoke):
    xp = Experiment.of(smoke, "expert")
    assert xp.eval_model("post") == ("results/world/post", "results/world/post")
    assert xp.eval_model("donor/step~50") == ("results/world/ladder", "results/world/ladder/step~50")
    sft = "sft/post/lr~1e-3/epoch~2"
    assert xp.eval_model(sft) == ("results/expert/sft/post/lr~1e-3", f"results/expert/{sft}")
    graft = "graft/step~50/lr~1e-3/epoch~1/lam~1/mask~none/rho~0"
    assert xp.eval_model(graft) == (f"results/expert/{graft}/model",) * 2
    with pytest.raises(ValueError, match="no model for evaluation key 'ppo/post'"):
        xp.eval_model("ppo/post")


def test_only_masked_grafts_read_a_fisher_and_its_settings(smoke):
    xp = Experiment.of(smoke, "expert")
    assert xp.graft_fisher("diag", "0.1") == f"{xp.retention_home()}/diag"
    assert xp.graft_fisher("none", "0") == [] and xp.mask_settings("post", "none") == {}
    assert xp.mask_settings("post", "diag") == {"scope": "global", "score": "fisher_delta"}
    with pytest.raises(ValueError, match="mask~none/rho~0, not rho~0.1"):
        xp.graft_fisher("none", "0.1")


def test_experiments_reading_one_data_set_share_its_file_and_any_change_to_it_makes_another(smoke):
    """star, teacher and pedagogical read the same problems: one file, named by the source and its settings;
    a setting of the read changed (a limit) names another, a benchmark's response_tokens (sizing only) none."""
    star, teacher = Experiment.of(smoke, "star"), Experiment.of(smoke, "teacher")
    assert star.sources()["experiments.star.problems"]["task"] == "arith"
    source = Path(star.x["problems"]["source"]).stem  # the file's name, then a digest of its settings
    assert star.candidates() == teacher.candidates() and star.candidates().startswith(f"results/sources/{source}-")
    assert (
        shared_sources(layouts(smoke))[source_id(star.x["problems"])][0] == "experiments.teacher.problems"
    )  # its first reader
    limited = copy.deepcopy(smoke)
    limited["experiments"]["teacher"]["problems"]["limit"] = 5
    assert Experiment.of(resolve(limited), "teacher").candidates() != star.candidates()
    spec = dict(star.x["problems"])
    assert source_id(spec | {"response_tokens": 99}) == source_id(spec)


def test_the_study_takes_its_experiments_and_the_tiny_world_tables(smoke):
    lines = {e["exp"]: e for e in study_experiments(smoke)}
    # Every single-domain experiment; a continual one (`stages`) has no single-domain summary to study.
    assert list(lines) == [e for e, x in smoke["experiments"].items() if not x["stages"]]
    assert lines["narrow"]["drift"] == "results/narrow/drift.parquet" and lines["narrow"]["seed"] == 1
    # Knowledge and the data-set settings are not the world's arithmetic: drift, but no takeover.
    assert lines["knowledge"]["takeover"] is None and lines["teacher"]["takeover"] is None
    assert lines["expert"]["takeover"] == "results/expert/takeover.parquet"
    chosen = smoke | {"study": {"experiments": ["narrow"]}}
    assert [e["exp"] for e in study_experiments(chosen)] == ["narrow"]
    real = study_experiments(load("configs/qwen3-1.7b-star.yaml"))
    assert all(e["drift"] is None and e["takeover"] is None for e in real)


def test_the_evaluations_directory_is_found_from_a_metrics_file():
    assert eval_root("results/x/eval/sft/post/lr~1/epoch~2/metrics.json", "sft/post/lr~1/epoch~2") == "results/x/eval"
    with pytest.raises(ValueError, match="not the metrics.json of run 'post'"):
        eval_root("results/x/eval/sft/post/lr~1/epoch~2/metrics.json", "post")


@pytest.mark.parametrize("keys", [{"lr": "1/2"}, {"lr": ""}, {"a~b": "1"}])
def test_a_key_value_that_would_not_parse_back_is_refused(keys):
    with pytest.raises(ValueError, match="is no key segment"):
        _ = Run("sft", "post", keys | {"epoch": "1"}).key


def test_key_values_are_the_strings_of_the_path():
    assert run("sft", "post", lr="1e-3", epoch=2).key == "sft/post/lr~1e-3/epoch~2"
    assert Run("post").key == "post" and run("donor", "step~50").key == "donor/step~50"


def test_importing_the_layout_loads_no_numerical_library():
    # Every workflow parse imports it (rules/common.smk): a dry-run must not wait for torch.
    code = "import sys, graftlab.planning.layout; print(sorted({'torch', 'polars', 'numpy'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_parse_run_each_method() -> None:
    empty = dict.fromkeys(("lr", "epoch", "lam", "mask", "rho"))
    assert parse_run("post") == {"method": "post", "donor": None} | empty
    assert parse_run("sft/post/lr~1e-3/epoch~2") == (
        {"method": "sft", "donor": "post"} | empty | {"lr": "1e-3", "epoch": "2"}
    )
    assert parse_run("sft/step~400/lr~1e-3/epoch~1")["method"] == "donor_sft"
    assert parse_run("donor/step~400") == {"method": "donor", "donor": "step~400"} | empty
    assert parse_run("sft/step~400/lr~1e-3/epoch~1")["donor"] == "step~400"
    graft = parse_run("graft/step~400/lr~1e-3/epoch~2/lam~0.5/mask~none/rho~0")
    assert graft == {
        "method": "graft",
        "donor": "step~400",
        "lr": "1e-3",
        "epoch": "2",
        "lam": "0.5",
        "mask": "none",
        "rho": "0",
    }
    # Donor == post is model merging; values stay the strings of the path.
    merge = parse_run("graft/post/lr~1e-3/epoch~2/lam~0.5/mask~diag/rho~0.01")
    assert (merge["method"], merge["donor"], merge["rho"]) == ("merge", "post", "0.01")


def test_parse_run_keeps_extra_keys() -> None:
    assert parse_run("sft/post/lr~1e-3/epoch~2/data~star")["data"] == "star"


@pytest.mark.parametrize(
    ("run", "message"),
    [
        ("ppo/post/lr~1e-6", "unknown method 'ppo'"),
        ("", "unknown method ''"),
        ("post/lr~1e-3", "post model takes no keys"),
        ("donor/step~400/lr~1e-3", "a donor as it is takes no keys"),
        ("sft", "needs a base model"),
        ("sft/post/lr~1e-3", r"lacks key\(s\) \['epoch'\]"),
        ("graft/post/lr~1e-3/epoch~2/lam~0.5", r"lacks key\(s\) \['mask', 'rho'\]"),
        ("sft/post/lr~1e-3/epoch2", "'epoch2' is not name~value"),
        ("sft/post/lr~1e-3/epoch~1/lr~1e-4", "key 'lr' appears twice"),
        ("sft/post/lr~1e-3/epoch~1/method~x", "key 'method' clashes"),
    ],
)
def test_parse_run_rejects(run: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_run(run)


@pytest.mark.parametrize("name", CONFIGS)
def test_a_training_runs_checkpoints_are_exactly_the_evaluated_runs_it_keeps(name):
    """Every SFT and on-policy evaluation is one training run's checkpoint, evaluated by the rule its list
    of checkpoints names; every other evaluated run is no training run's."""
    for xp in layouts(load(name)):
        trained = {f"{key}/{c}" for key, cs in xp.checkpointed().items() for c in cs}
        kinds = {r.key: r.kind for r in xp.run_list()}
        assert trained == {key for key, kind in kinds.items() if kind == "sft" or kind in ON_POLICY}
        for cs in xp.checkpointed().values():
            assert checkpoint_rule(cs).startswith("evaluate_run_") and checkpoint_rule(cs).isidentifier()


@pytest.mark.parametrize("name", CONFIGS)
def test_the_sweeps_are_exactly_the_grafts_each_graft_in_one(name):
    """Every graft and merge is one lam of one sweep (its other keys), made by the rule its lam list names."""
    for xp in layouts(load(name)):
        swept = [
            f"graft/{donor}/lr~{lr}/epoch~{epoch}/lam~{lam}/mask~{mask}/rho~{rho}"
            for (donor, lr, epoch, mask, rho), lams in xp.sweeps().items()
            for lam in lams
        ]
        assert sorted(swept) == sorted(r.key for r in xp.run_list() if r.kind == "graft")
        assert len(set(swept)) == len(swept)
        for lams in xp.sweeps().values():
            assert sweep_rule("graft", lams).startswith("graft_lam_") and sweep_rule("graft", lams).isidentifier()


@given(
    st.lists(st.sampled_from(["0", "0.25", "0.5", "1", "1e-1", "1E-1", "2.5e3", "25", "0.025"]), min_size=1, max_size=4)
)
def test_every_list_of_lam_values_names_a_rule_of_its_own(lams):
    """Two lists of lam values never share a rule name (a rule's outputs are its list's), and each is a name."""
    name = sweep_rule("graft", lams)
    assert name.isidentifier()
    others = [["0", "25"], ["0.25"], ["1", "e-1"], ["1e", "-1"], ["0.02", "5"], ["0", "0.25"]]
    assert all(sweep_rule("graft", other) != name for other in others if other != lams)


def test_sweeps_over_other_lam_values_get_other_rules(smoke):
    groups = sweep_groups([xp for xp in layouts(smoke) if not xp.x["stages"]])
    assert {sweep_rule("graft", lams) for lams in groups} == {"graft_lam_1", "graft_lam_0p5"}  # grafts, merges
    # expert's graft of its donor at each SFT epoch, unmasked then masked; its merge masked at epoch 2 alone.
    assert groups[("1",)]["expert"] == [
        ("step~50", "1e-3", "1", "none", "0"),
        ("step~50", "1e-3", "2", "none", "0"),
        ("step~50", "1e-3", "1", "diag", "0.1"),
        ("step~50", "1e-3", "2", "diag", "0.1"),
    ]
    assert groups[("0.5",)]["expert"] == [
        ("post", "1e-3", "1", "none", "0"),
        ("post", "1e-3", "2", "none", "0"),
        ("post", "1e-3", "2", "diag", "0.1"),
    ]


def test_runs_keeping_other_checkpoints_get_other_rules(smoke):
    groups = checkpoint_groups([xp for xp in layouts(smoke) if not xp.x["stages"]])  # a chain's stages are its own
    assert {checkpoint_rule(cs) for cs in groups} == {
        "evaluate_run_epoch_1_2",  # every SFT run: 2 epochs
        "evaluate_run_step_4",  # OPSD
        "evaluate_run_step_2",  # GRPO and SDPO
    }
    assert groups[("epoch~1", "epoch~2")]["expert"] == ["sft/post/lr~1e-3", "sft/step~50/lr~1e-3"]
    with pytest.raises(ValueError, match="not of one kind"):
        checkpoint_rule(["epoch~1", "step~2"])


def test_experiments_share_mining_and_the_post_models_evaluation_exactly_when_their_inputs_agree(smoke):
    """star, teacher and pedagogical mine one data set alike: one mining home, whose held-out problems each
    evaluates the post model on, so that evaluation is one job too; any input or setting of either changed
    makes another."""
    single = [xp for xp in layouts(smoke) if not xp.x["stages"]]
    homes = mining_homes(single)
    assert sorted(sorted(x.name for x in users) for users in homes.values()) == [
        ["expert"],
        ["narrow"],
        ["pedagogical", "star", "teacher"],
    ]
    star = Experiment.of(smoke, "star")
    assert star.new_data("heldout") == f"{star.mining_home()}/heldout.parquet" == star.eval_benchmarks()[-1][1]
    assert Experiment.of(smoke, "knowledge").new_data("train") == "results/knowledge/data/train.parquet"
    shared = shared_evaluations(single)
    assert list(shared.values()) == [[("teacher", "post"), ("star", "post"), ("pedagogical", "post")]]
    for change in (
        {"mining": {"samples": 3}},
        {"seed": 3},
        {"eval": {"samples": 3}},
        {"eval": {"validation": 0.5}},
        {"problems": {"limit": 7}},
    ):
        changed = copy.deepcopy(smoke)
        for key, value in change.items():
            section = changed["experiments"]["star"]
            section[key] = section[key] | value if isinstance(value, dict) else value
        moved = Experiment.of(changed, "star")
        assert moved.eval_digest("post") != star.eval_digest("post"), change
        if "eval" not in change:
            assert moved.mining_home() != star.mining_home(), change
    # How an evaluation runs shapes no score: the job stays shared.
    same = copy.deepcopy(smoke)
    same["experiments"]["star"]["eval"] |= {"parts": 2, "donor_sft": False}
    assert Experiment.of(same, "star").eval_digest("post") == star.eval_digest("post")


def test_experiments_share_a_retention_home_exactly_when_its_inputs_agree(smoke):
    homes = retention_homes(smoke)
    # The five experiments on the main world's post model with the same Fisher settings; narrow's world.
    assert sorted(len(users) for users in homes.values()) == [1, 1, 5]
    expert = Experiment.of(smoke, "expert")
    assert expert.retention_home().startswith("results/fisher/world-post-")
    base = expert.retention_home()
    for change in (
        {"fisher": {"rollouts": 30}},
        {"fisher": {"temperature": 0.5}},
        {"fisher": {"max_new_tokens": 41}},
        {"seed": 3},
        {"fisher": {"prompts": {"source": "old.jsonl"}}},
        {"benchmarks": {"b": {"source": "b.jsonl", "task": "arith"}}},
    ):
        changed = copy.deepcopy(smoke)
        for key, value in change.items():
            section = changed["experiments"]["expert"]
            section[key] = section[key] | value if isinstance(value, dict) and section[key] else value
        assert Experiment.of(changed, "expert").retention_home() != base, change
    # Memory and KFAC's options shape no rollout: the home stays, and only a KFAC Fisher's name changes.
    same = copy.deepcopy(smoke)
    same["experiments"]["expert"]["fisher"] |= {"batch_size": 2, "ekfac": True, "kfac_positions": "all"}
    other = Experiment.of(same, "expert")
    assert other.retention_home() == base and other.fisher_dir("diag") == expert.fisher_dir("diag")
    assert other.fisher_dir("kfac") == f"{base}/kfac-all-ekfac" != expert.fisher_dir("kfac")


@given(st.sampled_from(sorted(FISHER_KINDS)), st.booleans(), st.sampled_from(["completion", "all"]))
def test_a_fishers_name_gives_back_its_kind_and_options(kind, ekfac, positions):
    got = fisher_options(fisher_name(kind, ekfac, positions))
    assert got == ((kind, {"ekfac": ekfac, "positions": positions}) if kind == "kfac" else (kind, {}))


@pytest.mark.parametrize("name", ["diag-all", "kfac", "kfac-all-ekfac-x", "kfac-all-x"])
def test_a_fisher_name_of_no_kind_and_options_is_refused(name):
    with pytest.raises(ValueError, match=name):
        fisher_options(name)
