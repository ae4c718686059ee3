"""The collapse detector of staged chains (graftlab.analysis.collapse): looping responses against varied
arithmetic traces, the own-domain accuracy rule, a training log's entropy spike and teacher-student JS
falling to zero, and whole chains of evaluated models written by hand."""

import json
import random
import statistics
from unittest import mock

import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from graftlab.analysis.collapse import (
    RESULT_KEYS,
    accuracy_collapse,
    detect,
    detect_stages,
    log_collapse,
    records_repeated_share,
    repeated_share,
)

BUDGET = 2048  # characters: a looping response runs on to the token budget


def _normal(rng: random.Random) -> str:
    """A varied arithmetic trace and its answer, as a healthy model writes them."""
    steps = []
    for _ in range(rng.randint(1, 4)):
        a, b, c = (rng.randint(0, 99) for _ in range(3))
        steps.append(f"{a}+{b}+{c}={a + b + c}")
    return "<think>\n" + ";".join(steps) + f"</think>\n\n{rng.randint(0, 999)}"


def _loop(unit: str, prefix: str = "<think>\n4+7+0=11;") -> str:
    return (prefix + unit * BUDGET)[:BUDGET]


NORMAL = [_normal(random.Random(i)) for i in range(40)] + ["4+7+0=11;3+2+1=6</think>\n\n61", "1000", "2222"]
LOOPS = [_loop("\\boxed"), _loop("ab"), _loop("\\boxed") + "<|im_end|>", _loop("7", prefix="The answer is ")]


def test_repeated_share_tells_loops_from_normal_outputs():
    assert repeated_share(NORMAL) == 0.0
    assert repeated_share(LOOPS) == 1.0
    assert repeated_share(LOOPS + NORMAL[: len(LOOPS)]) == pytest.approx(0.5)
    assert repeated_share([]) == 0.0 and repeated_share([None, LOOPS[0]]) == 0.5


def _records(texts: list[str], correct: float = 0.5) -> pl.DataFrame:
    n = len(texts)
    return pl.DataFrame(
        {
            "problem_id": [f"p{i // 2}" for i in range(n)],
            "sample": [i % 2 for i in range(n)],
            "completion": texts,
            "answer": ["1"] * n,
            "correct": [i < correct * n for i in range(n)],
        }
    )


def test_records_repeated_share_pools_the_benchmarks(tmp_path):
    _records(LOOPS * 3).write_parquet(tmp_path / "alg.parquet")
    _records(NORMAL[:12]).write_parquet(tmp_path / "add.parquet")
    assert records_repeated_share(tmp_path, ["alg"]) == 1.0
    assert records_repeated_share(tmp_path, ["add"]) == 0.0
    assert records_repeated_share(tmp_path, ["alg", "add"]) == pytest.approx(0.5)
    with pytest.raises(FileNotFoundError, match="geo"):
        records_repeated_share(tmp_path, ["geo"])


def test_accuracy_collapse():
    assert accuracy_collapse([0.1, 0.6, 0.7, 0.02]) == 3
    assert accuracy_collapse([0.0, 0.0, 0.01]) is None
    assert accuracy_collapse([0.02, 0.3, 0.1]) is None  # fell, but not to the floor
    assert accuracy_collapse([0.03, 0.5]) is None  # low before the peak is not a collapse
    assert accuracy_collapse([0.5, None, float("nan"), 0.05]) == 3  # missing skipped; the floor is inclusive
    assert accuracy_collapse([0.15, 0.01], peak=0.1) == 1


def _log(**series) -> list[dict]:
    n = len(next(iter(series.values())))
    return [{"step": 10 * (i + 1), "loss": 0.1} | {k: v[i] for k, v in series.items()} for i in range(n)]


def test_js_falling_to_zero_fires_and_a_small_positive_one_does_not():
    falling = _log(js=[0.05, 0.04, 0.03, 0.02, 0.0, 0.0, None, 2e-5, 0.0])
    assert log_collapse(falling) == ("js_zero", 50)  # the step it fell, null (all-masked) steps passed over
    assert log_collapse(pl.DataFrame(falling)) == ("js_zero", 50)
    assert log_collapse(_log(js=[0.002] * 30)) is None  # steadily small but positive
    assert log_collapse(_log(js=[0.0] * 10)) is None  # never positive: nothing to lose
    assert log_collapse(_log(js=[0.05, 0.0, 0.0, 0.05, 0.0, 0.0, 0.04])) is None  # dips, never 3 in a row
    assert log_collapse(_log(js=[None] * 5)) is None and log_collapse([{"step": 1, "sample_s": 3.0}]) is None


def test_an_entropy_spike_fires_and_noise_does_not():
    assert log_collapse(_log(entropy=[0.5, 0.55, 0.45, 0.5, 0.6, 2.5, 0.5])) == ("entropy_spike", 60)
    assert log_collapse(_log(entropy=[0.5, 0.7, 0.9, 1.1, 1.3, 1.4])) is None  # a drift, never threefold
    assert log_collapse(_log(entropy=[0.01, 0.02, 0.01, 0.01, 0.08])) is None  # eightfold but tiny
    assert log_collapse(_log(entropy=[0.4, 2.0, 0.4, 0.4])) is None  # too early for a median
    # Both in one log: the earlier step wins.
    both = _log(entropy=[0.5] * 6 + [3.0], js=[0.05, 0.05, 0.0, 0.0, 0.0, 0.0, 0.0])
    assert log_collapse(both) == ("js_zero", 30)
    assert log_collapse(both, js_run=10) == ("entropy_spike", 70)


def _stage(tmp_path, name: str, own: str, acc: float, texts: list[str], others: dict | None = None):
    """An evaluated stage model: metrics.json (every domain scored: its own at `acc`, the others at 0.5 or as
    `others` says) and the records of its own benchmark and an old one."""
    d = tmp_path / name
    d.mkdir(parents=True)
    scores = dict.fromkeys(OWN, 0.5) | (others or {}) | {own: acc}
    benches = {b: {"role": "new", "task": "arith", "n": 2, "problems": 6, "acc@n": a} for b, a in scores.items()}
    benches["add"] = {"role": "old", "task": "arith", "n": 2, "problems": 6, "acc@n": 0.8}
    (d / "metrics.json").write_text(json.dumps({"run": name, "benchmarks": benches}))
    _records(texts, acc).write_parquet(d / f"{own}.parquet")
    _records(NORMAL[:12]).write_parquet(d / "add.parquet")
    return d


def _steps(tmp_path, name: str, log: list[dict]):
    path = tmp_path / name / "steps.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in log))
    return path


OWN = ["alg", "geo", "calc"]


def test_a_healthy_chain_is_not_collapsed(tmp_path):
    dirs = [_stage(tmp_path, f"s{i}", b, a, NORMAL[:12]) for i, (b, a) in enumerate(zip(OWN, (0.6, 0.5, 0.4)))]
    logs = [_steps(tmp_path, f"log{i}", _log(entropy=[0.5] * 8, js=[0.02] * 8)) for i in range(3)]
    result = detect(dirs, OWN, logs)
    assert tuple(result) == RESULT_KEYS
    assert result == {
        "collapsed": False,
        "collapse_reason": None,
        "collapse_stage": None,
        "collapse_step": None,
        "repeated_share": 0.0,
    }
    assert detect(dirs, OWN)["collapsed"] is False  # no logs (sft, grafts)


def test_a_looping_stage_collapses_the_chain(tmp_path):
    texts = [LOOPS[0]] * 8 + NORMAL[:4]  # two thirds loop
    dirs = [
        _stage(tmp_path, "s1", "alg", 0.6, NORMAL[:12]),
        _stage(tmp_path, "s2", "geo", 0.3, texts),
        _stage(tmp_path, "s3", "calc", 0.3, NORMAL[:12]),
    ]
    result = detect(dirs, OWN, [None, None, None])
    assert result == {
        "collapsed": True,
        "collapse_reason": "repeated_tail",
        "collapse_stage": 2,
        "collapse_step": None,
        "repeated_share": pytest.approx(2 / 3),
    }
    assert detect(dirs, OWN, repeated_threshold=0.7)["collapsed"] is False
    per_stage = detect_stages(dirs, OWN, stages=[4, 5, 6])
    assert [r["stage"] for r in per_stage] == [4, 5, 6]
    assert [r["collapsed"] for r in per_stage] == [False, True, True]  # later models descend from it
    assert [r["collapse_stage"] for r in per_stage] == [None, 5, 5]
    assert [r["repeated_share"] for r in per_stage] == pytest.approx([0.0, 2 / 3, 0.0])


def test_accuracy_and_log_collapses_of_a_chain(tmp_path):
    # `alg`, learnt to 0.6 in stage 1, is lost by stage 3 (0.02); every stage's own domain stays learnt.
    own = (0.6, 0.6, 0.6)
    lost = ({}, {"alg": 0.3}, {"alg": 0.02})
    dirs = [_stage(tmp_path, f"s{i}", b, a, NORMAL[:12], o) for i, (b, a, o) in enumerate(zip(OWN, own, lost))]
    fell = detect(dirs, OWN)
    assert (fell["collapse_reason"], fell["collapse_stage"], fell["collapse_step"]) == ("accuracy_collapse", 3, None)
    # A domain never learnt to the peak (alg at 0.1) is no collapse when it later reads zero.
    never = [
        _stage(tmp_path, f"n{i}", b, a, NORMAL[:12], o)
        for i, (b, a, o) in enumerate(zip(OWN, (0.1, 0.6, 0.6), ({}, {"alg": 0.0}, {"alg": 0.0})))
    ]
    assert not detect(never, OWN)["collapsed"]
    # A JS log that drops to zero in stage 2's training comes first, with its step.
    logs = [None, _steps(tmp_path, "log2", _log(js=[0.03, 0.03, 0.0, 0.0, 0.0])), None]
    js = detect(dirs, OWN, logs)
    assert (js["collapse_reason"], js["collapse_stage"], js["collapse_step"]) == ("js_zero", 2, 30)
    # Thresholds of the log rules pass through.
    assert detect(dirs, OWN, logs, log_thresholds={"js_run": 4})["collapse_reason"] == "accuracy_collapse"


def test_mismatched_chains_are_refused(tmp_path):
    d = _stage(tmp_path, "s1", "alg", 0.5, NORMAL[:12])
    with pytest.raises(ValueError, match="1 eval dirs, 2 own benchmarks"):
        detect([d], ["alg", "geo"])
    with pytest.raises(ValueError, match="own benchmark 'ghost'"):
        detect([d], ["ghost"])


ENTROPIES = st.lists(st.floats(0.01, 6.0, allow_nan=False), min_size=1, max_size=12)


@given(entropies=ENTROPIES)
@settings(max_examples=200, deadline=None)
def test_an_entropy_spike_is_the_first_step_past_3x_the_median_of_all_earlier_steps(entropies):
    """Against the definition written out with statistics.median (an even count's median is the mean of
    its two middle values), for any entropy curve."""
    from graftlab.analysis.collapse import ENTROPY_FACTOR, ENTROPY_FLOOR, ENTROPY_WARMUP, entropy_spike

    log = [{"step": 10 * (i + 1), "entropy": e} for i, e in enumerate(entropies)]
    expected = next(
        (
            10 * (i + 1)
            for i, e in enumerate(entropies)
            if i >= ENTROPY_WARMUP and e > ENTROPY_FACTOR * statistics.median(entropies[:i]) and e > ENTROPY_FLOOR
        ),
        None,
    )
    assert entropy_spike(log) == expected


@given(
    accs=st.integers(1, 5).flatmap(
        lambda n: st.lists(
            st.lists(st.sampled_from([0.0, 0.03, 0.05, 0.1, 0.2, 0.5]), min_size=n, max_size=n), min_size=n, max_size=n
        )
    )
)
@settings(max_examples=200, deadline=None)
def test_a_domain_collapses_only_after_its_own_stage_learnt_it(accs):
    """accs[i][j]: stage model i's accuracy on stage j's own benchmark. A chain collapses at the first model
    i where some domain j <= i, at the peak in one of models j..i-1, is at the floor: a domain is followed
    from its own stage on, never from models trained before it (the chain's first)."""
    from graftlab.analysis import collapse

    n = len(accs)
    expected = min(
        (
            i
            for j in range(n)
            for i in range(j, n)
            if accs[i][j] <= collapse.ACC_FLOOR and any(accs[k][j] >= collapse.ACC_PEAK for k in range(j, i))
        ),
        default=None,
    )
    with mock.patch.object(collapse, "_own_accuracy", lambda d, bench: accs[d][int(bench)]):
        assert collapse.domain_collapse(list(range(n)), [str(j) for j in range(n)]) == expected
