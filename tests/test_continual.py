"""Staged continual post-training's tables (graftlab.analysis.continual): every column against the formulas
computed here from the metrics.json files written by hand, acc₀ = 0 and unscored benchmarks, the stage
averages, the written files and the two figures."""

import json
import math

import polars as pl
import pytest

from graftlab.analysis.continual import (
    continual_table,
    plot_accuracy,
    plot_heatmaps,
    stage_averages,
    write_continual,
)

DOMAINS = {1: "alg", 2: "geo"}
# Benchmark: (role, acc₀). `alg` is a domain the starting model never solves (acc₀ = 0).
BASE = {"add": ("old", 0.80), "alg": ("new", 0.0), "geo": ("new", 0.40)}
# (method, stage): {benchmark: acc}. `sdpo:frozen` is also scored on `extra`, which the starting model
# never was: its row has no acc₀ and no change.
ACC = {
    ("sft", 1): {"add": 0.60, "alg": 0.50, "geo": 0.40},
    ("sft", 2): {"add": 0.20, "alg": 0.10, "geo": 0.70},
    ("sdpo:frozen", 1): {"add": 0.90, "alg": 0.30, "geo": 0.30, "extra": 0.25},
    ("sdpo:frozen", 2): {"add": 0.80, "alg": 0.25, "geo": 0.60, "extra": 0.50},
}
ROLES = {b: r for b, (r, _) in BASE.items()} | {"extra": "old"}
COLUMNS = [
    "method",
    "stage",
    "benchmark",
    "acc",
    "acc_lo",
    "acc_hi",
    "base_acc",
    "delta",
    "rel_delta",
    "gain",
    "forgetting",
    "domain",
    "role",
]


def _bench(role: str, acc: float) -> dict:
    """One benchmark's entry of a metrics.json, as graftlab.evaluate.run writes it."""
    return {
        "role": role,
        "task": "arith",
        "n": 4,
        "problems": 50,
        "acc@n": acc,
        "acc@n_lo": max(acc - 0.05, 0.0),
        "acc@n_hi": min(acc + 0.05, 1.0),
        "pass@1": acc,
        "pass@4": min(1.0, 2 * acc),
    }


def _write(path, accs: dict) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    benches = {b: _bench(ROLES[b], a) for b, a in accs.items()}
    path.write_text(json.dumps({"run": str(path.parent), "benchmarks": benches, "old": None, "new": None}))
    return str(path)


@pytest.fixture
def inputs(tmp_path):
    base = _write(tmp_path / "base" / "metrics.json", {b: a for b, (_, a) in BASE.items()})
    models = [
        {
            "method": method,
            "stage": stage,
            "domain": DOMAINS[stage],
            "metrics": _write(tmp_path / method / f"stage{stage}" / "metrics.json", accs),
        }
        for (method, stage), accs in ACC.items()
    ]
    return models, base


def _expected(method: str, stage: int, bench: str) -> dict:
    """The row computed independently of the module."""
    acc = ACC[method, stage][bench]
    base = BASE[bench][1] if bench in BASE else None
    delta = None if base is None else acc - base
    rel = delta / base if base else None
    return {
        "method": method,
        "stage": stage,
        "benchmark": bench,
        "acc": acc,
        "acc_lo": max(acc - 0.05, 0.0),
        "acc_hi": min(acc + 0.05, 1.0),
        "base_acc": base,
        "delta": delta,
        "rel_delta": rel,
        "gain": None if rel is None else max(rel, 0.0),
        "forgetting": None if rel is None else max(-rel, 0.0),
        "domain": DOMAINS[stage],
        "role": ROLES[bench],
    }


def _same(got, want) -> bool:
    if want is None or got is None:
        return got is None and want is None
    if isinstance(want, float):
        return got == pytest.approx(want, abs=1e-12)
    return got == want


def test_every_column_matches_the_formulas(inputs):
    table = continual_table(*inputs)
    assert table.columns == COLUMNS
    assert table.schema["stage"] == pl.Int64 and table.schema["acc"] == pl.Float64
    expected = [_expected(m, s, b) for (m, s), accs in ACC.items() for b in accs]
    assert table.height == len(expected)
    assert table.select("method", "stage", "benchmark").rows() == [
        (e["method"], e["stage"], e["benchmark"]) for e in expected
    ]
    for row, want in zip(table.iter_rows(named=True), expected):
        bad = {c: (row[c], want[c]) for c in COLUMNS if not _same(row[c], want[c])}
        assert not bad, (want["method"], want["stage"], want["benchmark"], bad)


def test_zero_and_missing_base_leave_the_relative_change_undefined(inputs):
    table = continual_table(*inputs)
    alg = table.filter(benchmark="alg")
    assert alg["base_acc"].to_list() == [0.0] * 4 and alg["delta"].to_list() == pytest.approx(alg["acc"].to_list())
    assert alg.select("rel_delta", "gain", "forgetting").null_count().row(0) == (4, 4, 4)
    extra = table.filter(benchmark="extra")
    assert extra.select("base_acc", "delta", "rel_delta", "gain", "forgetting").null_count().row(0) == (2,) * 5
    # Elsewhere gain and forgetting are never both positive, and unchanged is exactly 0, never -0.0.
    add = table.filter(benchmark="add")
    assert ((add["gain"] > 0) & (add["forgetting"] > 0)).sum() == 0
    same = table.filter(method="sdpo:frozen", stage=2, benchmark="add").row(0, named=True)
    assert (same["gain"], same["forgetting"]) == (0.0, 0.0) and math.copysign(1, same["forgetting"]) == 1


def test_stage_averages_by_hand(inputs):
    averages = stage_averages(continual_table(*inputs))
    assert averages.columns == ["method", "stage", "avg_acc", "avg_forgetting", "avg_acc_seen"]
    assert averages.select("method", "stage").rows() == list(ACC)
    for row in averages.iter_rows(named=True):
        m, s = row["method"], row["stage"]
        rows = [_expected(m, s, b) for b in ACC[m, s]]
        forgetting = [r["forgetting"] for r in rows if r["forgetting"] is not None]
        # Seen: the old benchmarks and the domains of stages 1..s.
        seen_names = {DOMAINS[t] for t in DOMAINS if t <= s}
        seen = [r["acc"] for r in rows if r["role"] == "old" or r["benchmark"] in seen_names]
        assert row["avg_acc"] == pytest.approx(sum(r["acc"] for r in rows) / len(rows))
        assert row["avg_forgetting"] == pytest.approx(sum(forgetting) / len(forgetting))
        assert row["avg_acc_seen"] == pytest.approx(sum(seen) / len(seen))
    # Spot checks in numbers: sft stage 1 sees add and alg; stage 2 also geo.
    sft1 = averages.filter(method="sft", stage=1).row(0, named=True)
    assert sft1["avg_acc_seen"] == pytest.approx((0.60 + 0.50) / 2)
    assert sft1["avg_forgetting"] == pytest.approx((0.25 + 0.0) / 2)  # add forgot a quarter; geo unchanged
    assert averages.filter(method="sft", stage=2)["avg_acc_seen"].item() == pytest.approx((0.2 + 0.1 + 0.7) / 3)


def test_a_stage_given_twice_or_two_domains_for_a_stage_are_refused(inputs):
    models, base = inputs
    with pytest.raises(ValueError, match="given twice"):
        continual_table([*models, models[0]], base)
    clash = [*models[:2], {**models[2], "domain": "other"}, models[3]]
    with pytest.raises(ValueError, match="trains on"):
        stage_averages(continual_table(clash, base))


def test_write_continual_and_the_figures(inputs, tmp_path):
    models, base = inputs
    out = tmp_path / "out"
    table, averages = write_continual(models, base, out / "continual.parquet", out / "averages.parquet")
    assert pl.read_parquet(out / "continual.parquet").equals(table)
    assert pl.read_parquet(out / "averages.parquet").equals(averages)
    assert sorted(p.name for p in out.iterdir()) == ["averages.parquet", "continual.parquet"]  # no temporaries
    plot_accuracy(table, out / "accuracy.png")
    plot_heatmaps(table, out / "heatmaps.png")
    for name in ("accuracy.png", "heatmaps.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    # Metrics written before intervals existed: null bounds, still plotted.
    bare = table.with_columns(pl.lit(None, pl.Float64).alias("acc_lo"), pl.lit(None, pl.Float64).alias("acc_hi"))
    plot_accuracy(bare, out / "bare.png")
    assert (out / "bare.png").stat().st_size > 10_000
