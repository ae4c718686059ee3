"""Takeover: which task's procedure a tiny-world answer follows, and the share of old-task answers written
in the new task's, per evaluated run."""

import random

import polars as pl
import pytest

from graftlab.analysis.takeover import form_shares, takeover_table
from graftlab.errors import GraftlabError
from graftlab.tasks import chat_completion, extract_thinking
from graftlab.tasks.arith import NEW_TASKS, OLD_TASKS, operands, problem, step_facts, thinking_form


@pytest.mark.parametrize("task", OLD_TASKS + NEW_TASKS)
def test_every_expert_trace_is_read_as_its_own_procedure(task):
    rng = random.Random(0)
    want = "mul" if task == "times" else task  # times thinks as mul does
    forms = set()
    for _ in range(200):
        a, b = operands(task, rng)
        if task == "compare" and a == b:
            continue  # "4=4": equal numbers leave no operator in the step
        forms.add(thinking_form(problem(task, a, b)["thinking"]))
    assert forms == {want}


def test_the_majority_of_steps_decides_and_a_tie_or_no_operator_decides_nothing():
    assert thinking_form("4*2=8+0=8;1+2+0=3;3*2=6+0=6") == "mul"
    assert thinking_form("9+3=3;4-5=9") is None
    assert thinking_form("\n12\n") is None and thinking_form("") is None


def test_thinking_runs_to_the_last_close_or_to_the_end():
    assert extract_thinking("<think>\n1+2+0=3\n</think>\n\n3<|im_end|>") == "\n1+2+0=3\n"
    assert extract_thinking("<think>\n1*2=2+0=2;3*2=") == "\n1*2=2+0=2;3*2="
    assert extract_thinking("42<|im_end|>") is None


def test_shares_count_new_form_own_form_and_neither():
    completions = [
        chat_completion("9*3=27+0=27", "27"),
        chat_completion("9+3+0=12", "12"),
        chat_completion("9+3+0=12;1+1+1=3", "312"),
        "no thinking",
        chat_completion("9-3=6", "6"),
    ]
    assert form_shares(completions, own="add", new="mul") == (pytest.approx(1 / 5), pytest.approx(2 / 5))
    with pytest.raises(GraftlabError, match="no completions"):
        form_shares([], "add", "mul")


@pytest.mark.parametrize("task", OLD_TASKS + NEW_TASKS)
def test_every_expert_trace_holds_all_its_facts(task):
    rng = random.Random(1)
    for _ in range(100):
        thinking = problem(task, *operands(task, rng))["thinking"]
        held, written = step_facts(thinking)
        # Each step is one equality, a mul step two ("7*8=56+5=61"), a compare trace one comparison.
        per_step = {"mul": 2, "times": 2, "compare": 1}.get(task, 1)
        assert held == written == per_step * len(thinking.split(";")), thinking


def test_wrong_facts_are_counted_one_equality_at_a_time():
    assert step_facts("4*3=10+0=10;2*6=12+1=13") == (3, 4)  # 4*3 is not 10; the rest hold
    assert step_facts("4+2+0=5;9+9+0=18") == (1, 2)
    assert step_facts("13-5=7;7<3;5=5") == (1, 3)
    # Nothing checkable: a family's long division, a cut-off step, prose.
    assert step_facts("84/4=21r0;3*2=;hello") == (0, 0)


def _write_eval(root, run, per_bench):
    for bench, completions in per_bench.items():
        (root / run).mkdir(parents=True, exist_ok=True)
        pl.DataFrame({"completion": completions}).write_parquet(root / run / f"{bench}.parquet")


def test_table_has_one_row_per_run_with_ids_and_the_mean_over_old_benchmarks(tmp_path):
    mul, add, sub = (
        chat_completion("7*8=56+0=56", "56"),
        chat_completion("7+8+0=15", "15"),
        chat_completion("8-7=1", "1"),
    )
    sft = "sft/post/lr~1e-3/epoch~1"
    _write_eval(tmp_path, "post", {"add": [add, add], "sub": [sub, sub], "times": [add, sub, mul, "<think>\n12", mul]})
    _write_eval(tmp_path, sft, {"add": [mul, add], "sub": [mul, mul, mul, sub], "times": [mul]})
    table = takeover_table(tmp_path, ["post", sft], ["add", "sub"], "times")
    assert table["run"].to_list() == ["post", sft]
    assert table["misrouted"].to_list() == [pytest.approx(2 / 5), 0]  # new-task answers in add's or sub's form
    row = table.row(1, named=True)
    assert (row["method"], row["lr"], row["epoch"]) == ("sft", "1e-3", "1")
    assert (row["takeover_add"], row["takeover_sub"]) == (0.5, 0.75)
    assert row["takeover"] == pytest.approx(0.625) and row["own_form"] == pytest.approx((0.5 + 0.25) / 2)
    assert table.row(0, named=True)["takeover"] == 0 and table.row(0, named=True)["own_form"] == 1
    # Facts: every equality written above holds.
    assert (row["facts_add"], row["facts_old"], row["facts_new"]) == (1.0, 1.0, 1.0)
    wrong = chat_completion("7*8=54+0=54", "54")  # one of two equalities wrong
    merge = "graft/post/lr~1e-3/epoch~2/lam~0.5/mask~none/rho~0"
    _write_eval(tmp_path, merge, {"add": [add, wrong], "sub": ["no thinking"], "times": [wrong, mul]})
    row = takeover_table(tmp_path, [merge], ["add", "sub"], "times").row(0, named=True)
    # add: 1 + 1 of 1 + 2 written; sub: none written (None, left out of the mean); times: 1 + 2 of 4.
    assert (row["facts_add"], row["facts_sub"], row["facts_old"]) == (pytest.approx(2 / 3), None, pytest.approx(2 / 3))
    assert row["facts_new"] == pytest.approx(3 / 4)


def test_a_donor_as_it_is_is_a_run_of_its_own(tmp_path):
    add = chat_completion("7+8+0=15", "15")
    _write_eval(tmp_path, "donor/step~300", {"add": [add], "mul": [add, "42<|im_end|>"]})
    row = takeover_table(tmp_path, ["donor/step~300"], ["add"], "mul").row(0, named=True)
    assert (row["method"], row["donor"], row["misrouted"], row["own_form"]) == ("donor", "step~300", 0.5, 1)


def test_a_missing_benchmark_file_or_a_task_outside_the_tiny_world_is_named(tmp_path):
    _write_eval(tmp_path, "post", {"add": [chat_completion("1+1+0=2", "2")]})
    with pytest.raises(GraftlabError, match=r"no completions for sub: .*post/sub.parquet"):
        takeover_table(tmp_path, ["post"], ["add", "sub"], "mul")
    with pytest.raises(GraftlabError, match="gsm8k"):
        takeover_table(tmp_path, ["post"], ["gsm8k"], "mul")
    with pytest.raises(GraftlabError, match="knowledge"):
        takeover_table(tmp_path, ["post"], ["add"], "knowledge")
