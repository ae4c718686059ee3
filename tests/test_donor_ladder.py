"""The donor study's table (graftlab.analysis.donor_ladder) on a hand-built summary: each arm's run chosen on the
validation split, reported on the test split, and held to SFT of post, OPSD and the merge beyond the intervals."""

import polars as pl
import pytest

from graftlab.analysis.donor_ladder import chosen, donor_order, main, markdown
from graftlab.planning.layout import parse_run

HALF = 0.05  # every interval is the point +- this


def graft(donor: str, lam: str) -> str:
    return f"graft/{donor}/lr~1e-3/epoch~2/lam~{lam}/mask~none/rho~0"


MERGE = "graft/post/lr~1e-3/epoch~2/lam~0.5/mask~none/rho~0"
OPSD = "opsd/post/alpha~0.5/lr~1e-4/step~40"
# run: (test new, test old, validation new, validation old)
POINTS = {
    "post": (0.0, 0.9, 0.0, 0.9),
    "sft/post/lr~1e-3/epoch~1": (0.5, 0.2, 0.5, 0.2),
    "sft/post/lr~1e-3/epoch~2": (0.8, 0.05, 0.8, 0.05),
    "sft/step~100/lr~1e-3/epoch~2": (0.6, 0.1, 0.6, 0.1),  # an ingredient: in no arm
    OPSD: (0.0, 0.4, 0.0, 0.4),
    MERGE: (0.3, 0.6, 0.3, 0.6),
    # Validation prefers lam 0.5 (mean 0.475 against 0.45); the test split would prefer lam 1.
    graft("step~100", "1"): (0.4, 0.6, 0.3, 0.6),
    graft("step~100", "0.5"): (0.1, 0.8, 0.15, 0.8),
    graft("post~450", "1"): (0.5, 0.7, 0.5, 0.7),
}


def summary(points=POINTS) -> pl.DataFrame:
    rows = []
    for run, (new, old, new_val, old_val) in points.items():
        scores = {"new": new, "old": old, "new_val": new_val, "old_val": old_val}
        for role, x in list(scores.items()):
            scores |= {f"{role}_lo": x - HALF, f"{role}_hi": x + HALF}
        rows.append({"exp": "ladder-s0", "run": run} | parse_run(run) | scores)
    return pl.DataFrame(rows)


def test_each_arm_is_chosen_on_validation_and_held_to_the_baselines():
    table = chosen(summary())
    assert table["arm"].to_list() == ["post", "SFT of post", "OPSD", "merge", "step~100", "post~450"]
    runs = dict(zip(table["arm"], table["run"]))
    assert runs["step~100"] == graft("step~100", "0.5")  # validation's choice, not the test split's
    assert runs["SFT of post"] == "sft/post/lr~1e-3/epoch~2"  # mean 0.425 against epoch 1's 0.35
    row = {r["arm"]: r for r in table.iter_rows(named=True)}
    late = row["post~450"]
    # post~450 at new 0.5 keeps old_lo 0.65. SFT's points of new <= 0.5: epoch 1, old_hi 0.25. OPSD: old_hi
    # 0.45. The merge: old_hi 0.65, so a margin of 0, not beyond it.
    assert late["margin_sft"] == pytest.approx(0.4) and late["beats_sft"]
    assert late["margin_opsd"] == pytest.approx(0.2) and late["beats_opsd"]
    assert late["margin_merge"] == pytest.approx(0.0) and not late["beats_merge"]
    assert (late["beats_sft_val"], late["beats_opsd_val"], late["beats_merge_val"]) == (True, True, False)
    # step~100's choice learned nothing beyond the post model (new_lo 0.05 <= post's new_hi 0.05): no win,
    # though its old-task margins are positive.
    early = row["step~100"]
    assert early["margin_opsd"] == pytest.approx(0.75 - 0.45) and not early["beats_opsd"]
    assert early["margin_merge"] is None and not early["beats_merge"]  # no merge point learned as little
    # The merge is held to SFT and OPSD, not to itself; the baselines themselves are held to nothing.
    assert row["merge"]["margin_merge"] is None and row["merge"]["beats_sft"] is not None
    assert all(row[a]["beats_sft"] is None for a in ("post", "SFT of post", "OPSD"))
    text = markdown(table)
    assert "| ladder-s0 | post~450 | `" + graft("post~450", "1") + "` | 0.50 / 0.70 |" in text
    assert text.count("\n") == 2 + table.height and "| yes / yes / no | yes / yes / no |" in text


def test_donors_run_along_training():
    names = ["qwen", "post~900", "step~400", "post~150", "step~100"]
    assert sorted(names, key=donor_order) == ["step~100", "step~400", "post~150", "post~900", "qwen"]


def test_the_command_writes_its_table_and_figure_and_refuses_a_summary_without_validation(tmp_path, capsys):
    path = tmp_path / "summary.parquet"
    summary().write_parquet(path)
    assert main([str(path), "--out", str(tmp_path / "out")]) == 0
    assert pl.read_parquet(tmp_path / "out/donor_ladder.parquet").height == 6
    assert (tmp_path / "out/donor_ladder.png").stat().st_size > 10_000
    assert capsys.readouterr().out.startswith("| seed | arm |")
    summary().drop("old_val").write_parquet(bad := tmp_path / "bad.parquet")
    assert main([str(bad), "--out", str(tmp_path / "bad")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("donor_ladder: summary of 'ladder-s0' lacks ['old_val']") and err.count("\n") == 1
    assert not (tmp_path / "bad").exists()
    with pytest.raises(SystemExit) as exit_:
        main([str(tmp_path / "absent.parquet")])
    assert exit_.value.code == 2
