"""Adaptive sweeps' screening (graftlab.analysis.screen): a graft is screened out exactly when another's
validation interval lies wholly beyond its own, so no graft on the frontier of validation means is lost."""

import json

import polars as pl
import pytest
from hypothesis import given
from hypothesis import strategies as st

from graftlab.analysis.screen import BOUNDS, dominates, main, screen, screened_out

unit = st.integers(0, 20).map(lambda i: i / 20)  # a coarse grid: ties between bounds are common


@st.composite
def interval(draw) -> dict:
    new_lo, new_hi = sorted((draw(unit), draw(unit)))
    old_lo, old_hi = sorted((draw(unit), draw(unit)))
    return {"new_val_lo": new_lo, "new_val_hi": new_hi, "old_val_lo": old_lo, "old_val_hi": old_hi}


points = st.dictionaries(st.sampled_from([f"graft/r{i}" for i in range(8)]), interval(), min_size=1)


@given(points)
def test_a_graft_is_screened_out_exactly_when_an_interval_lies_wholly_beyond_its_own(pts):
    decisions = screen(pts)
    assert set(decisions) == set(pts)
    for run, d in decisions.items():
        beyond = [
            o
            for o in pts
            if o != run
            and pts[o]["new_val_lo"] >= pts[run]["new_val_hi"]
            and pts[o]["old_val_lo"] >= pts[run]["old_val_hi"]
            and (pts[o]["new_val_lo"] > pts[run]["new_val_hi"] or pts[o]["old_val_lo"] > pts[run]["old_val_hi"])
        ]
        assert d["kept"] == (not beyond)
        assert d["by"] == (sorted(beyond)[0] if beyond else None)
        assert d["interval"] == pts[run] and d.get("by_interval") == (pts[d["by"]] if beyond else None)


@given(points, st.data())
def test_no_point_of_the_frontier_of_validation_means_is_screened_out(pts, data):
    """Any means within their intervals: the runs no other run's means dominate are all kept."""
    means = {}
    for run, p in pts.items():
        new = data.draw(st.floats(p["new_val_lo"], p["new_val_hi"]))
        old = data.draw(st.floats(p["old_val_lo"], p["old_val_hi"]))
        means[run] = (new, old)

    def over(a, b):
        return a[0] >= b[0] and a[1] >= b[1] and a != b

    front = {r for r in means if not any(over(means[o], means[r]) for o in means if o != r)}
    kept = {r for r, d in screen(pts).items() if d["kept"]}
    assert front <= kept


def test_an_interval_is_not_beyond_itself_nor_beyond_one_it_only_touches():
    a = dict.fromkeys(BOUNDS, 0.5)
    assert not dominates(a, a)
    assert dominates({**a, "new_val_lo": 0.6, "new_val_hi": 0.7}, a)


def test_screening_without_validation_scores_names_the_run(tmp_path):
    with pytest.raises(ValueError, match=r"^screening graft/x: no new_val_lo, old_val_hi \(a validation share"):
        screen({"graft/x": {"new_val_hi": 0.2, "old_val_lo": 0.1}})


def test_the_command_writes_each_decision_and_the_screened_table(tmp_path, capsys):
    """A graft is screened out by a merge, an SFT checkpoint by a later one; the merge's interval lies beyond
    the first SFT checkpoint's and the OPSD checkpoint's too, but a checkpoint has only its own method's
    runs for rivals (`rivals`), so OPSD's one checkpoint, its method's best, is kept."""
    graft, merge = (f"graft/{d}/lr~1e-3/epoch~2/lam~1/mask~none/rho~0" for d in ("step~100", "post"))
    first, last, opsd = "sft/post/lr~1e-3/epoch~1", "sft/post/lr~1e-3/epoch~2", "opsd/post/alpha~0.5/lr~1e-4/step~4"
    files = []
    for i, (run, lo) in enumerate(((graft, 0.0), (merge, 0.6), (first, 0.0), (last, 0.6), (opsd, 0.0))):
        record = {"run": run, **{k: lo + (0.3 if k.endswith("hi") else 0.0) for k in BOUNDS}}
        files.append(tmp_path / f"{i}.json")
        files[-1].write_text(json.dumps(record))
    out, table = tmp_path / "out.json", tmp_path / "screened.parquet"
    assert main([str(out), str(table), *map(str, files)]) == 0
    decisions = json.loads(out.read_text())
    assert {run: d["by"] for run, d in decisions.items()} == {
        graft: merge,
        merge: None,
        first: last,
        last: None,
        opsd: None,
    }
    assert capsys.readouterr().out == "screen: 3 of 5 runs kept for full scoring\n"
    rows = pl.read_parquet(table).sort("run").to_dicts()
    assert [r["run"] for r in rows] == [graft, first] and rows[0]["by_new_val_lo"] == 0.6
    assert screened_out(out, graft)["by"] == merge and screened_out(out, merge) is None


@given(points, st.data())
def test_a_run_is_screened_out_only_by_a_run_of_its_own_group(pts, data):
    groups = {run: data.draw(st.sampled_from("ab")) for run in pts}
    decisions = screen(pts, groups)
    for run, d in decisions.items():
        rivals = {o: pts[o] for o in pts if groups[o] == groups[run]}
        assert d == screen(rivals)[run]  # as if its group alone were screened


def test_the_summary_leaves_a_screened_out_graft_out(tmp_path):
    """A screened-out graft's metrics.json holds screening scores only: the summary (and every frontier and
    choice made from it) leaves it out; screened.parquet lists it instead."""
    from graftlab.analysis.summary import summarize

    run = "graft/step~50/lr~1e-3/epoch~2/lam~64/mask~none/rho~0"
    scores = {"old": 0.5, "new": 0.25, "old_lo": 0.4, "old_hi": 0.6, "new_lo": 0.1, "new_hi": 0.4}
    files = {"post": {"run": "post", "benchmarks": {}, **scores}}
    files["graft"] = {"run": run, "benchmarks": {}, "old_val": 0.0, "screened_out": {"by": "post"}}
    for name, record in files.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(record))
    table = summarize([tmp_path / "post.json", tmp_path / "graft.json"], "x")
    assert table["run"].to_list() == ["post"]


def test_takeover_reads_no_records_of_a_screened_out_graft(tmp_path):
    """A screened-out graft has its metrics.json and no records: takeover (the one analysis reading each run's
    records) leaves it out rather than stopping on the missing file."""
    from graftlab.analysis.takeover import takeover_table

    kept, screened = "graft/step~50/lr~1e-3/epoch~2/lam~1/mask~none/rho~0", "post"
    for bench in ("add", "mul"):
        (tmp_path / kept).mkdir(parents=True, exist_ok=True)
        pl.DataFrame({"completion": ["<think>1+1=2</think>2"]}).write_parquet(tmp_path / kept / f"{bench}.parquet")
    (tmp_path / kept / "metrics.json").write_text(json.dumps({"run": kept}))
    (tmp_path / screened).mkdir()
    (tmp_path / screened / "metrics.json").write_text(json.dumps({"run": screened, "screened_out": {"by": kept}}))
    table = takeover_table(tmp_path, [screened, kept], ["add"], "mul")
    assert table["run"].to_list() == [kept]


@given(st.lists(st.integers(1, 500), min_size=1, max_size=4), st.sampled_from(["new", "old"]))
def test_an_interval_collapsed_at_zero_or_one_is_widened_to_the_exact_binomial_bound(problems, role):
    """Every answer of a role wrong resamples to [0, 0]: its upper bound becomes the mean over the role's
    benchmarks of 1 - 0.025^(1/P), the exact 97.5% bound of no success in P problems (and at 1 the mirror);
    bounds strictly inside (0, 1) are the bootstrap's, unchanged."""
    from graftlab.analysis.screen import bounds

    other = "old" if role == "new" else "new"
    benchmarks = {f"b{i}": {"role": role, "validation": {"problems": p}} for i, p in enumerate(problems)}
    benchmarks["o"] = {"role": other, "validation": {"problems": 10}}
    for value, key, exact in ((0, "hi", lambda p: 1 - 0.025 ** (1 / p)), (1, "lo", lambda p: 0.025 ** (1 / p))):
        record = {f"{role}_val_lo": value, f"{role}_val_hi": value, f"{other}_val_lo": 0.2, f"{other}_val_hi": 0.4}
        got = bounds(record | {"benchmarks": benchmarks})
        expected = sum(exact(p) for p in problems) / len(problems)
        assert abs(got[f"{role}_val_{key}"] - expected) < 1e-12 and 0 < expected < 1
        assert got[f"{role}_val_{'lo' if key == 'hi' else 'hi'}"] == value
        assert (got[f"{other}_val_lo"], got[f"{other}_val_hi"]) == (0.2, 0.4)
