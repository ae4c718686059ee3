"""The latency analysis charges every run exactly the timed work that produced it, picks each method's best
frontier point, and refuses a run whose timing records are missing."""

import json
from pathlib import Path

import polars as pl
import pytest

from graftlab.analysis.latency import COSTS, run_costs, step_latency, write_latency


def _steps(path: Path, records: list[dict]) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def _json(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record))


GRAFT = "graft/step~50/lr~1e-3/epoch~2/lam~0.5/mask~none/rho~0"
MASKED = "graft/step~50/lr~1e-3/epoch~1/lam~1/mask~kfac/rho~0.1"
MERGE = "graft/post/lr~1e-3/epoch~1/lam~0.5/mask~none/rho~0"
OPSD = "opsd/post/alpha~0.5/lr~1e-4/step~2"
SCORES = {  # run: (new, old)
    "post": (0.0, 0.9),
    "sft/post/lr~1e-3/epoch~1": (0.5, 0.5),
    "sft/post/lr~1e-3/epoch~2": (0.7, 0.2),
    GRAFT: (0.6, 0.8),
    MASKED: (0.4, 0.85),
    MERGE: (0.3, 0.7),
    OPSD: (0.1, 0.6),
    "opsd/post/alpha~0.5/lr~1e-4/step~3": (0.1, 0.6),
}


@pytest.fixture
def root(tmp_path):
    """A results/{exp} tree of timing records with round numbers, so every charge is a sum by hand."""
    sft = lambda update: [{"step": i + 1, "epoch": i // 2 + 1, "sample_s": 0.0, "update_s": update} for i in range(4)]
    _steps(tmp_path / "sft/post/lr~1e-3", sft(1.0))  # 2 steps an epoch, 1 s each
    _steps(tmp_path / "sft/step~50/lr~1e-3", sft(2.0))
    _steps(tmp_path / "opsd/post/alpha~0.5/lr~1e-4", [{"step": s, "sample_s": 9.0, "update_s": 1.0} for s in (1, 2, 3)])
    for run, seconds in ((GRAFT, 0.25), (MASKED, 0.5), (MERGE, 0.125)):
        _json(tmp_path / run / "seconds.json", {"graft_s": seconds})
    _json(tmp_path / "fisher/home/rollouts.json", {"sample_s": 3.0, "rollouts": 8})
    _json(tmp_path / "fisher/home/kfac/seconds.json", {"fisher_s": 4.0})
    return tmp_path


def fishers(root) -> dict:
    """The retention Fisher a masked graft is charged, as the latency rule passes it (its home, here a folder of
    `root`, holds the rollouts' statistics)."""
    return {"kfac": root / "fisher/home/kfac"}


def _summary(runs=SCORES) -> pl.DataFrame:
    from graftlab.planning.layout import parse_run

    rows = [{"run": r, "new": n, "old": o} | parse_run(r) for r, (n, o) in runs.items()]
    return pl.DataFrame(rows).select(
        "run", "method", "donor", "lr", "epoch", "lam", "mask", "rho", "alpha", "step", "new", "old"
    )


def test_each_run_is_charged_the_work_that_made_it(root):
    table = run_costs(_summary(), root, fishers(root))
    cost = {r["run"]: tuple(r[c] for c in COSTS) for r in table.iter_rows(named=True)}  # sample, update, graft, fisher
    assert cost["post"] == (0, 0, 0, 0)
    assert cost["sft/post/lr~1e-3/epoch~1"] == (0, 2.0, 0, 0)  # epoch 1's two steps
    assert cost["sft/post/lr~1e-3/epoch~2"] == (0, 4.0, 0, 0)
    assert cost[GRAFT] == (0, 8.0, 0.25, 0)  # the donor's two epochs at 2 s a step, and the graft
    assert cost[MASKED] == (0, 4.0, 0.5, 7.0)  # ... and the whole Fisher: rollouts 3 s + statistics 4 s
    assert cost[MERGE] == (0, 2.0, 0.125, 0)  # the post model's own SFT to epoch 1
    assert cost[OPSD] == (18.0, 2.0, 0, 0)  # steps 1..2 only
    assert table.filter(run=OPSD)["total_s"].item() == 20.0


def test_best_point_is_the_highest_mean_accuracy_on_the_methods_own_front(root):
    table = run_costs(_summary(), root, fishers(root))
    best = dict(table.filter("best").select("method", "run").iter_rows())
    # SFT: 0.5/0.5 (mean 0.5) beats 0.7/0.2; graft: 0.6/0.8 beats the masked 0.4/0.85; OPSD: a tie of equal
    # scores goes to the cheaper run, step 2. The post model and donor SFTs are no method's best point.
    assert best == {"sft": "sft/post/lr~1e-3/epoch~1", "graft": GRAFT, "merge": MERGE, "opsd": OPSD}
    assert table.filter(run=MASKED)["on_front"].item()  # its own method's front, not the joint one


def test_step_latency_splits_sampling_from_update(root):
    steps = step_latency(root, run_costs(_summary(), root, fishers(root)))
    rows = {r["what"]: r for r in steps.iter_rows(named=True)}
    assert rows["OPSD"]["sample_s"] == 9.0 and rows["OPSD"]["update_s"] == 1.0
    assert rows["OPSD"]["sampling_share"] == pytest.approx(0.9)
    assert rows["SFT of post"]["update_s"] == 1.0 and rows["SFT of post"]["count"] == 4
    assert rows["donor SFT (grafting)"]["update_s"] == 2.0 and rows["donor SFT (grafting)"]["sampling_share"] == 0
    assert rows["graft (once)"]["update_s"] == 0.25  # the median of 0.125, 0.25, 0.5


def test_write_latency_writes_tables_and_a_figure(root, tmp_path):
    summary = tmp_path / "summary.parquet"
    _summary().write_parquet(summary)
    out = tmp_path / "out"
    write_latency(
        summary,
        root,
        out / "latency.parquet",
        out / "steps.parquet",
        out / "latency.png",
        title="t",
        fishers=fishers(root),
    )
    assert pl.read_parquet(out / "latency.parquet").height == len(SCORES)
    assert pl.read_parquet(out / "steps.parquet").height == 4
    assert (out / "latency.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    "remove, message",
    [
        (f"{GRAFT}/seconds.json", "seconds of this graft"),
        ("fisher/home/rollouts.json", "retention rollout statistics"),
        ("sft/step~50/lr~1e-3/steps.jsonl", "per-step seconds"),
    ],
)
def test_a_missing_record_is_named(root, remove, message):
    (root / remove).unlink()
    with pytest.raises(FileNotFoundError, match=message):
        run_costs(_summary(), root, fishers(root))


def test_steps_without_the_epoch_asked_for_are_refused(root):
    _steps(
        root / "sft/post/lr~1e-3", [{"step": 1, "sample_s": 0.0, "update_s": 1.0}]
    )  # an SFT from before epochs were logged
    with pytest.raises(ValueError, match="no steps of epoch 1"):
        run_costs(_summary(), root, fishers(root))
    opsd = {r: s for r, s in SCORES.items() if r.startswith(("post", "opsd"))}
    _steps(root / "opsd/post/alpha~0.5/lr~1e-4", [{"step": 1, "sample_s": 1.0, "update_s": 1.0}])
    with pytest.raises(ValueError, match="1 of 2 steps"):
        run_costs(_summary(opsd), root, fishers(root))


def test_a_reused_batch_spreads_its_sampling_over_the_steps_that_use_it():
    from graftlab.analysis.latency import per_batch

    steps = pl.DataFrame({"sample_s": [1.0, 0.0, 3.0, 0.0], "update_s": [0.25, 0.5, 0.25, 0.25]})
    assert per_batch(steps).rows() == [(0.5, 0.375), (1.5, 0.25)]
    sft = pl.DataFrame({"sample_s": [0.0, 0.0], "update_s": [0.2, 0.4]})
    assert per_batch(sft).rows() == [(0.0, 0.2), (0.0, 0.4)]
