import re
import threading

import math_verify
import pytest
from math_verify.errors import TimeoutException

from graftlab import tasks
from graftlab.errors import GraftlabError
from graftlab.sampling import SamplingConfig
from graftlab.tasks import EMPTY_THINK, TASKS, arith, chat_completion, find_task, get_task
from graftlab.tasks.math import MATH_INSTRUCTION, last_boxed, math_grade, math_reference


def turn(final: str, thinking: str = "let me think") -> str:
    return chat_completion(thinking, final)


@pytest.mark.parametrize(
    ("text", "content"),
    [
        (r"so \boxed{\frac{1}{\sqrt{2}}} it is", r"\frac{1}{\sqrt{2}}"),
        (r"first \boxed{3}, then \boxed{\frac{2}{3}}.", r"\frac{2}{3}"),
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),
        (r"\boxed {x^{2}}", "x^{2}"),
        (r"\boxed{\left(3, \frac{\pi}{2}\right)}", r"\left(3, \frac{\pi}{2}\right)"),
    ],
)
def test_last_boxed_takes_the_last_box_whole(text, content):
    assert last_boxed(text) == content


@pytest.mark.parametrize("text", ["no box at all", r"\boxed{1} and then \boxed{\frac{2}{3}", r"\boxed{x} \boxed{"])
def test_last_boxed_is_none_without_a_closed_final_box(text):
    # A truncated last box is no answer: falling back to the box before it would grade a draft.
    assert last_boxed(text) is None


@pytest.mark.parametrize(
    ("predicted", "reference"),
    [
        (r"\frac{1}{2}", "0.5"),
        ("0.5", r"\frac{1}{2}"),
        ("2.0", "2"),
        (r"\dfrac{\sqrt{2}}{2}", r"\frac{1}{\sqrt{2}}"),
        ("(1,2]", r"(1, 2]"),
        ("x=3", "3"),
    ],
)
def test_math_grade_accepts_equivalent_answers(predicted, reference):
    assert math_grade(turn(rf"The answer is \boxed{{{predicted}}}."), reference)


@pytest.mark.parametrize(
    ("predicted", "reference"),
    [("3", "2"), (r"\frac{1}{3}", "0.33"), ("0.51", r"\frac{1}{2}"), ("(1,2)", "(1,2]"), ("-2", "2")],
)
def test_math_grade_rejects_wrong_answers(predicted, reference):
    assert not math_grade(turn(rf"\boxed{{{predicted}}}"), reference)


def test_math_grade_reads_only_the_last_box_after_the_thinking():
    completion = turn(r"Maybe \boxed{3}; no, it is \boxed{2}.", thinking=r"guess \boxed{5}")
    assert math_grade(completion, "2")
    assert not math_grade(completion, "3")
    # The box inside the thinking is never the answer.
    assert not math_grade(completion, "5")
    assert not math_grade(turn("It is 2.", thinking=r"\boxed{2}"), "2")


def test_math_grade_needs_the_thinking_closed():
    assert not math_grade(r"<think>so \boxed{2}", "2")
    assert not math_grade(r"The answer is \boxed{2}", "2")


def test_math_grade_reads_a_worked_solution_as_reference():
    assert math_grade(turn(r"\boxed{0.75}"), r"Adding gives $\frac{3}{4}$, so the answer is $\boxed{\frac{3}{4}}$.")


@pytest.mark.parametrize("predicted", [r"\frac{1}{", "???", "", r"\sqrt"])
def test_math_grade_scores_garbage_wrong_without_raising(predicted):
    assert not math_grade(turn(rf"\boxed{{{predicted}}}"), r"\frac{1}{2}")


def test_math_grade_counts_a_math_verify_timeout_or_error_as_wrong(monkeypatch):
    def timing_out(*args, **kwargs):
        raise TimeoutException("too slow")

    monkeypatch.setattr(math_verify, "verify", timing_out)
    assert not math_grade(turn(r"\boxed{2}"), "2")
    monkeypatch.setattr(math_verify, "verify", lambda *a, **k: 1 / 0)
    assert not math_grade(turn(r"\boxed{2}"), "2")


def test_math_grade_passes_gold_first(monkeypatch):
    calls = []
    real = math_verify.verify
    monkeypatch.setattr(
        math_verify, "verify", lambda gold, target, **kw: calls.append((gold, target)) or real(gold, target, **kw)
    )
    assert math_grade(turn(r"\boxed{\sqrt{2}/2}"), r"\frac{1}{\sqrt{2}}")
    gold, target = calls[0]
    assert r"\frac{1}{\sqrt{2}}" in gold and r"\sqrt{2}/2" in target


def test_math_grade_works_off_the_main_thread():
    # math-verify's signal-based timeouts raise ValueError in a worker thread unless they are switched off.
    results, errors = [], []

    def grade():
        try:
            results.append(math_grade(turn(r"\boxed{\frac{2}{4}}"), "0.5"))
            results.append(math_grade(turn(r"\boxed{3}"), "0.5"))
        except Exception as e:  # noqa: BLE001 - surfaced below
            errors.append(e)

    worker = threading.Thread(target=grade)
    worker.start()
    worker.join()
    assert errors == [] and results == [True, False]


@pytest.mark.parametrize(
    ("raw", "reference"),
    [
        ("204", "204"),
        (r" \frac{3}{4} ", r"\frac{3}{4}"),
        (r"Thus $\boxed{\frac{3}{4}}$.", r"\frac{3}{4}"),
        ("???", None),
        ("", None),
        (r"so \boxed{\frac{3}{4}", None),
        (r"\frac{1}{", None),
    ],
)
def test_math_reference_keeps_only_answers_math_verify_reads(raw, reference):
    assert math_reference(raw) == reference


def test_math_prompt_asks_for_a_boxed_answer():
    prompt = get_task("math").prompt("  What is 1+1?\n")
    assert prompt.startswith("What is 1+1?") and prompt.endswith(MATH_INSTRUCTION)


def test_arith_task_grades_as_tasks_is_correct():
    task = get_task("arith")
    problems = arith.sample_problems("add", 5, "test", 0) + arith.sample_problems("mul", 5, "test", 0)
    for p in problems:
        right = chat_completion(p["thinking"], p["answer"])
        wrong = chat_completion(p["thinking"], p["answer"] + "1")
        for completion in (right, wrong, p["answer"], f"<think>\n{p['answer']}"):
            assert task.grade(completion, p["answer"]) == tasks.is_correct(completion, p["answer"])
        assert task.grade(right, p["answer"]) and not task.grade(wrong, p["answer"])
    assert task.prompt(problems[0]["prompt"]) == problems[0]["prompt"]


def test_knowledge_task_forgives_only_case_spacing_and_a_final_full_stop():
    task = get_task("knowledge")
    cases = [
        ("Paris.", "paris", True),
        ("  New   York ", "New York", True),
        ("Lyon", "Paris", False),
        ("", "Paris", False),
        ("Paris!", "Paris", False),
        ("Pa ris", "Paris", False),
    ]
    for said, answer, right in cases:
        assert task.grade(EMPTY_THINK + said + "<|im_end|>", answer) == right, (said, answer)
    assert not task.grade("Paris", "Paris")  # no closed thinking: no answer


def test_unknown_task_names_the_known_ones():
    known = ["arith", "code", "code_instruct", "knowledge", "math", "math_instruct", "mcq", "mcq_instruct", "tooluse"]
    known += ["tooluse_instruct"]
    with pytest.raises(GraftlabError, match=r"unknown task 'maths'.*" + re.escape(str(known))):
        get_task("maths")
    assert set(TASKS) == set(known)
    assert find_task("maths") is None


@pytest.mark.parametrize("operation", arith.OLD_TASKS + arith.NEW_TASKS)
def test_tiny_world_operations_are_graded_as_arith(operation):
    assert get_task(operation) is get_task("arith")


def test_sample_and_grade_grades_with_the_task_it_is_given():
    """Evaluation and mining grade real math with math-verify, not the tiny world's exact match."""
    import polars as pl

    from graftlab.world.tokenizer import build_tokenizer

    problems = pl.DataFrame({"id": ["p"], "prompt": ["What is 1/2?"], "answer": ["\\frac{1}{2}"]})
    sampler = lambda prompts, cfg: [[chat_completion("half", "\\boxed{0.5}")] for _ in prompts]  # noqa: E731
    cfg = SamplingConfig(n=1, temperature=1.0, top_p=1.0, max_new_tokens=16)
    exact = get_task("arith").sample_and_grade(sampler, build_tokenizer(), problems, cfg)
    graded = get_task("math").sample_and_grade(sampler, build_tokenizer(), problems, cfg)
    assert exact["correct"].to_list() == [False] and graded["correct"].to_list() == [True]


def test_knowledge_is_answered_once_greedily_after_a_prefilled_empty_think():
    """The task, not its caller, decides the decoding: evaluation asks the task, never tests its name."""
    import polars as pl

    from graftlab.world.tokenizer import build_tokenizer

    seen = []

    def sampler(prompts, cfg):
        seen.append((prompts, cfg))
        return [["Velmora<|im_end|>"] for _ in prompts]

    problems = pl.DataFrame({"id": ["q"], "prompt": ["Home city of Taven?"], "answer": ["velmora"]})
    cfg = SamplingConfig(n=4, temperature=1.0, top_p=0.9, max_new_tokens=16)
    records = get_task("knowledge").sample_and_grade(sampler, build_tokenizer(), problems, cfg)
    ((prompts, drawn),) = seen
    assert (drawn.n, drawn.temperature, drawn.top_p, drawn.max_new_tokens) == (1, 0.0, 1.0, 16)
    assert prompts[0].endswith("<|im_start|>assistant\n" + EMPTY_THINK)
    assert records["completion"].to_list() == [EMPTY_THINK + "Velmora<|im_end|>"]
    assert records["correct"].to_list() == [True] and records["answer"].to_list() == ["Velmora"]
