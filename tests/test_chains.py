"""A continual experiment's chains (graftlab.planning.chains): where each method's stage k starts from, what a graft
chain adds, where an SDPO teacher comes from, and the config checks of `stages`."""

import pytest

from graftlab.planning.chains import Chain, Continual, parse_chain
from graftlab.planning.config import ConfigError, resolve

STAGES = [
    {"domain": "order", "epochs": 2, "steps": 3},
    {"domain": "knowledge", "knowledge": {"entities": 4, "facts": 8, "replay": 0}},
    {"domain": "muln", "steps": 5},
]


def continual(**experiment) -> Continual:
    x = {
        "stages": STAGES,
        "donors": ["step~100"],
        "sft": {"lr": ["1e-3"], "epochs": 4},
        "graft": {"lam": ["1"], "masks": {"kinds": ["diag"], "rho": ["0.1"]}},
        "merge": {"lam": ["0.5"], "masks": {"kinds": ["diag"], "rho": ["0.1"]}},
        "opsd": {"alpha": ["0.5"], "steps": 8},
        "grpo": {"lr": ["1e-4"], "steps": 8},
        "sdpo": {"teachers": ["frozen", "ema:0.05", "refresh:1"], "cot_teachers": ["ema:0.05"], "steps": 8},
    } | experiment
    return Continual.of(resolve({"experiments": {"c": x}}), "c")


def test_every_method_is_one_chain_per_setting():
    labels = [c.label for c in continual().chains()]
    assert labels == [
        "sft",
        *["graft_chain"] * 2,  # unmasked and diag-masked
        *["graft_cumulative"] * 2,
        *["merge_chain"] * 2,  # the merge section's lam, unmasked and masked
        "opsd",
        "grpo",
        "sdpo:frozen",
        "sdpo:ema:0.05",
        "sdpo:refresh:1",
        "sdpo_cot:ema:0.05",
    ]
    only_chain = continual(continual={"graft_forms": ["chain"]})
    assert {c.kind for c in only_chain.chains()} == {"sft", "graft_chain", "opsd", "grpo", "sdpo", "sdpo_cot"}


def test_each_stage_starts_from_the_same_chains_previous_stage():
    c = continual()
    sft, grpo = Chain("sft", "post", {"lr": "1e-3"}), Chain("grpo", "post", {"lr": "1e-4"})
    root = "results/c/chain"
    assert c.stage_model(sft, 0) == ("results/world/post", "results/world/post")
    # Stage epochs and steps override the sections': stage 1 trains 2 epochs, stage 2 takes sft.epochs.
    assert c.stage_model(sft, 1) == (f"{root}/sft/post/lr~1e-3/stage~1", f"{root}/sft/post/lr~1e-3/stage~1/epoch~2")
    assert c.stage_model(sft, 2)[1].endswith("stage~2/epoch~4")
    assert c.stage_model(grpo, 1)[1] == f"{root}/grpo/post/lr~1e-4/stage~1/step~3"
    assert c.stage_model(grpo, 2)[1].endswith("stage~2/step~8")
    assert c.stage_model(grpo, 3)[1].endswith("stage~3/step~5")
    # A donor's SFT chain starts from the donor.
    assert c.stage_model(Chain("sft", "step~100", {"lr": "1e-3"}), 0)[1] == "results/world/ladder/step~100"


def test_graft_chain_adds_the_fixed_donors_update_and_cumulative_only_the_new_part():
    c = continual()
    keys = {"lr": "1e-3", "lam": "1", "mask": "none", "rho": "0"}
    fixed, carried = Chain("graft_chain", "step~100", keys), Chain("graft_cumulative", "step~100", keys)
    donor = ("results/world/ladder", "results/world/ladder/step~100")
    for k in (1, 3):
        before, after = c.donor_pair(fixed, k)
        assert before == donor
        assert after[1] == f"results/c/chain/tune/step~100/lr~1e-3/stage~{k}/epoch~{c.epochs(k)}"
    before, after = c.donor_pair(carried, 1)
    assert before == donor and after[1] == "results/c/chain/sft/step~100/lr~1e-3/stage~1/epoch~2"
    before, after = c.donor_pair(carried, 3)
    assert before[1] == "results/c/chain/sft/step~100/lr~1e-3/stage~2/epoch~4"
    assert after[1] == "results/c/chain/sft/step~100/lr~1e-3/stage~3/epoch~4"
    # Each graft lands on the chain's own previous model.
    assert c.stage_model(fixed, 2)[1] == c.stage_dir(fixed, 2) + "/model"


def test_a_merge_chain_adds_its_own_models_update_on_each_stage():
    """merge_chain's donor is the chain's current model: at stage k its update is (SFT of the chain's stage
    k-1 model on stage k) - (that model), taken at merge.lam, so the graft is M + lam (SFT(M) - M)."""
    c = continual()
    merges = [ch for ch in c.chains() if ch.kind == "merge_chain"]
    assert [(ch.base, ch.keys["lam"], ch.keys["mask"]) for ch in merges] == [
        ("post", "0.5", "none"),
        ("post", "0.5", "diag"),
    ]
    for chain in merges:
        for k in c.stage_numbers():
            before, after = c.donor_pair(chain, k)
            assert before == c.stage_model(chain, k - 1)  # the post model at stage 1
            assert after == (f"{c.stage_dir(chain, k)}/sft", f"{c.stage_dir(chain, k)}/sft/epoch~{c.epochs(k)}")
    assert c.donor_pair(merges[0], 1)[0] == ("results/world/post", "results/world/post")
    assert (
        c.stage_model(merges[0], 1)[1]
        == "results/c/chain/merge_chain/post/lr~1e-3/lam~0.5/mask~none/rho~0/stage~1/model"
    )
    # Without the form in continual.graft_forms, no merge chain.
    assert not [ch for ch in continual(continual={"graft_forms": ["chain"]}).chains() if ch.kind == "merge_chain"]


def test_sdpo_teachers_carry_over_as_the_paper_runs_them():
    c = continual()
    chain = {t: Chain("sdpo", "post", {"teacher": t, "lr": "1e-4"}) for t in ("frozen", "ema:0.05", "refresh:1")}
    post = "results/world/post"
    assert [c.teacher_start(chain["frozen"], k) for k in (1, 2, 3)] == [post] * 3
    assert c.teacher_start(chain["ema:0.05"], 1) == post
    assert c.teacher_start(chain["ema:0.05"], 3) == c.stage_dir(chain["ema:0.05"], 2) + "/teacher"
    # S-SDPO0 (refresh:1): every stage starts its teacher from the student.
    assert [c.teacher_start(chain["refresh:1"], k) for k in (1, 2)] == [None, None]
    assert [c.keeps_teacher(ch) for ch in chain.values()] == [False, True, False]


def test_evaluations_cover_every_chain_after_every_stage_on_every_benchmark():
    c = continual()
    keys = c.eval_keys()
    assert keys[0] == "post" and len(keys) == 1 + 13 * 3
    chain, stage = parse_chain(keys[-1])
    assert (chain.label, stage) == ("sdpo_cot:ema:0.05", 3)
    assert c.eval_model(keys[-1]) == c.stage_model(chain, 3)
    names = [b[0] for b in c.eval_benchmarks()]
    assert names == ["add", "sub", "compare", "order", "knowledge", "muln"]
    tasks = {b[0]: b[3] for b in c.eval_benchmarks()}
    assert tasks["order"] == "arith" and tasks["knowledge"] == "knowledge"


def test_earlier_checkpoints_of_on_policy_stages_are_scored_too():
    c = continual(grpo={"lr": ["1e-4"], "steps": 8, "checkpoints": 2})
    keys = c.checkpoint_keys()
    # GRPO keeps 2 checkpoints a stage: the first of each (stage steps 3, 8, 5 -> steps 2, 4, 2) is scored too.
    assert keys == [f"chain/grpo/post/lr~1e-4/stage~{k}/step~{s}" for k, s in ((1, 2), (2, 4), (3, 2))]
    assert keys == c.eval_keys()[-3:]
    stage = "results/c/chain/grpo/post/lr~1e-4/stage~1"
    assert c.eval_model(keys[0]) == (stage, f"{stage}/step~2")
    assert [s["step"] for s in c.checkpoint_spec()] == [2, 4, 2]


def test_retention_of_a_later_stage_adds_the_earlier_tiny_world_domains():
    c = continual()
    assert c.retention(1)[0] == ["add", "sub", "compare"]
    assert c.retention(3)[0] == ["add", "sub", "compare", "order"]  # knowledge has no fresh arithmetic prompts


def test_a_stage_is_a_single_domain_experiment_for_sizing():
    view = continual().stage_view(2)
    assert view.x["data"] == "knowledge" and view.x["knowledge"]["facts"] == 8
    assert view.x["sft"]["epochs"] == 4 and view.x["grpo"]["steps"] == 8


@pytest.mark.parametrize(
    ("stages", "message"),
    [
        ([{"domain": "order"}, {"domain": "order"}], "repeat one"),
        ([{"domain": "add"}], "is an old benchmark"),
        ([{"domain": "division"}], "no tiny-world task"),
        ([{"domain": "mul", "data": "knowledge"}], "knowledge domain"),
        ([{"domain": "mul", "train": 700, "heldout": 100}], "exceed the mul problems"),
        ([{"domain": "order", "epochs": 0}], "stages.0.epochs"),
        ([{"domain": "order", "stepz": 3}], "stepz"),
        ([{"domain": "knowledge", "knowledge": {"facts": 1, "entities": 4}}], "stages.0.knowledge"),
    ],
)
def test_bad_stages_are_one_clear_error(stages, message):
    with pytest.raises(ConfigError, match=message):
        resolve({"experiments": {"c": {"stages": stages}}})


def test_a_data_set_stage_needs_written_solutions():
    stage = {"domain": "gsm", "problems": {"source": "d.parquet", "columns": {"prompt": "q", "answer": "a"}}}
    with pytest.raises(ConfigError, match="solution"):
        resolve({"experiments": {"c": {"stages": [stage]}}})


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_each_stage_drifts_from_where_its_chain_stood_before_it(stages):
    """Every chain at every stage is paired with the post model and with its stage's start: for stage k > 1
    the model the same chain left after stage k - 1 (never its first), for stage 1 its starting model."""
    c = continual(stages=STAGES[:stages])
    pairs = c.drift_pairs()
    model = {(p["chain"], p["stage"]): p["model"] for p in pairs}
    for chain in c.chains():
        first = c.stage_model(chain, 0)[1]
        for k in range(1, stages + 1):
            mine = {p["against"]: p["base"] for p in pairs if p["chain"] == chain.key and p["stage"] == k}
            assert mine == {"stage_start": model[chain.key, k - 1] if k > 1 else first, "post": c.post_dir}
            assert model[chain.key, k] == c.stage_model(chain, k)[1]
    assert len(pairs) == 2 * stages * len(c.chains())
