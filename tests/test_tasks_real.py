"""The instruct tasks of the second paper's continual chain: multiple choice, tool use and code."""

import json
import time

import pytest

from graftlab.errors import GraftlabError
from graftlab.tasks import EMPTY_THINK, TASKS, find_task, get_task
from graftlab.tasks.code import CODE_PROMPT, last_code_block, parse_tests, run_tests
from graftlab.tasks.mcq import MCQ_INSTRUCTION
from graftlab.tasks.tooluse import TOOLUSE_FORMAT, TOOLUSE_TEMPLATE, parse_calls

NEW = ["mcq_instruct", "tooluse_instruct", "code_instruct"]


def said(text: str) -> str:
    """The whole assistant turn of an instruct model: the pre-filled empty think block, then its answer."""
    return EMPTY_THINK + text + "<|im_end|>"


@pytest.mark.parametrize("name", NEW)
def test_the_instruct_tasks_are_registered_and_posed_without_thinking(name):
    task = get_task(name)
    assert task is TASKS[name] is find_task(name) and task.name == name
    assert not task.thinking and not task.greedy
    # With thinking off, grading reads the turn with the empty think block in front (`Task.turn`).
    assert task.turn("x") == EMPTY_THINK + "x"


# --- mcq_instruct -----------------------------------------------------------------------------------------

MCQ = get_task("mcq_instruct")


def test_mcq_prompt_puts_the_papers_instruction_before_the_question():
    problem = "Which is a noble gas?\n\nA: Ne\nB: Na\nPlease reason step by step."
    prompt = MCQ.prompt(problem + "\n")
    assert prompt == MCQ_INSTRUCTION + "\n\n" + problem
    assert prompt.startswith("Given a question and four options") and "<answer>\nA\n</answer>" in prompt


@pytest.mark.parametrize(
    ("raw", "letter"),
    [("B", "B"), (" b ", "B"), ("(C)", "C"), ("D)", "D"), ("A.", "A"), ("[E]", "E"), ("c:", "C")],
)
def test_mcq_reference_reads_one_letter_however_it_is_wrapped(raw, letter):
    assert MCQ.reference(raw) == letter


@pytest.mark.parametrize("raw", ["", "AB", "Answer: B", "A) Neon", "12", "(A) or (B)"])
def test_mcq_reference_is_none_for_anything_but_one_letter(raw):
    assert MCQ.reference(raw) is None


def test_mcq_grade_reads_the_last_answer_tag():
    right = "<reasoning>\nNeon has a full shell.\n</reasoning>\n<answer>\nA\n</answer>"
    assert MCQ.grade(said(right), "A")
    assert not MCQ.grade(said(right), "B")
    # A first guess is overruled by the last tag.
    assert MCQ.grade(said("<answer>B</answer> no, wait: <answer> A </answer>"), "A")


@pytest.mark.parametrize(
    "text",
    [
        "The answer is A.",  # no tag
        "<answer>\nA",  # the last tag never closed (truncated): no answer, not an earlier one
        "<answer>B</answer> ... <answer>\nA",
        "<answer>(A)</answer>",  # only the letter counts, as upstream compares it
        "<answer>a</answer>",
        "<answer>A: Ne</answer>",
        "\\boxed{A}",  # upstream's MCQ grader takes no boxed letter
    ],
)
def test_mcq_grade_rejects_malformed_answers(text):
    assert not MCQ.grade(said(text), "A")


def test_mcq_grade_reads_only_after_the_thinking():
    assert not MCQ.grade("<think><answer>A</answer>", "A")
    assert not MCQ.grade("<think>\n<answer>A</answer>\n</think>\n\nI pick the first.", "A")


# --- tooluse_instruct --------------------------------------------------------------------------------------

TOOL = get_task("tooluse_instruct")
TOOLS = "Name: Axolotl\nDescription: Axolotl facts\nDocumentation:\ngetAxolotlFacts: Facts.\nParameters: {}"


def test_tooluse_prompt_is_the_papers_template_as_the_data_holds_it():
    prompt = TOOLUSE_TEMPLATE.format(tools=TOOLS, question="Tell me a fact.")
    assert TOOL.prompt(prompt + "\n") == prompt
    assert prompt.startswith("Your task is to answer the user's question using available tools. \n")
    assert TOOLUSE_FORMAT in prompt and prompt.endswith("\n\nBegin!\nQuestion: Tell me a fact.")


def test_tooluse_prompt_refuses_a_question_without_the_format():
    with pytest.raises(GraftlabError, match="lacks 'Action Input:'"):
        TOOL.prompt("Tell me a fact about axolotls.")


def calls(*pairs) -> str:
    return json.dumps([{"Action": a, "Action_Input": i} for a, i in pairs])


@pytest.mark.parametrize(
    "raw",
    [
        calls(("getFacts", '{"category": "habitat", "limit": 5}')),  # inputs as JSON strings (upstream)
        calls(("getFacts", {"limit": 5, "category": "habitat"})),  # inputs as objects
        ' [{"Action_Input": "{\\"limit\\": 5, \\"category\\": \\"habitat\\"}", "Action": "getFacts"}] ',
    ],
)
def test_tooluse_reference_is_canonical_json(raw):
    canonical = '[{"Action": "getFacts", "Action_Input": {"category": "habitat", "limit": 5}}]'
    assert TOOL.reference(raw) == canonical
    assert TOOL.reference(canonical) == canonical


@pytest.mark.parametrize(
    "raw",
    [
        "getFacts",  # not JSON
        "[]",
        '{"Action": "getFacts", "Action_Input": "{}"}',  # not a list
        '[{"Action": "getFacts"}]',
        calls(("getFacts", "not json")),
        calls(("getFacts", "[1, 2]")),  # an input that is not an object
        calls(("[Optional]updateUser", "{}")),  # a name `Action:\s*(\w+)` can never read
    ],
)
def test_tooluse_reference_is_none_when_unparsable(raw):
    assert TOOL.reference(raw) is None


def test_parse_calls_reads_every_pair_and_nested_inputs_whole():
    text = (
        'Thought: first the user\nAction: getUser\nAction Input: {"id": 7, "profile": {"name": "Ana"}}\n'
        'Observation: ...\nThought: then the posts\nAction: getPosts\nAction Input: {"id": 8, "page": 2}\n'
        "Action: ping\nAction Input: none\n"
    )
    names, merged = parse_calls(text)
    assert names == ["getUser", "getPosts", "ping"]
    # Merged in order with dict.update, as upstream merges; the unparsable input is skipped.
    assert merged == {"id": 8, "profile": {"name": "Ana"}, "page": 2}


def test_tooluse_grade_compares_names_as_a_multiset_and_merged_inputs():
    answer = TOOL.reference(calls(("getA", '{"x": 1}'), ("getB", '{"y": {"z": [1, 2]}}'), ("getA", "{}")))
    right = 'Action: getB\nAction Input: {"y": {"z": [1, 2]}}\nAction: getA\nAction Input: {"x": 1.0}\nAction: getA\n'
    assert TOOL.grade(said(right), answer)
    # One call missing, one too many, a wrong value, a name misspelt: each is wrong.
    assert not TOOL.grade(said('Action: getB\nAction Input: {"y": {"z": [1, 2]}, "x": 1}\nAction: getA'), answer)
    assert not TOOL.grade(said(right + "Action: getA\n"), answer)
    assert not TOOL.grade(said(right.replace("[1, 2]", "[2, 1]")), answer)
    assert not TOOL.grade(said(right.replace("getB", "getb")), answer)


@pytest.mark.parametrize(
    "text",
    [
        "I would call getA with x=1.",  # no Action lines at all
        "Action: getA\nAction Input: x=1",  # input not JSON: skipped, so the merged inputs differ
        'Action: getA\nAction Input: {"x": 1',  # truncated JSON
        "",
    ],
)
def test_tooluse_grade_rejects_malformed_calls(text):
    answer = TOOL.reference(calls(("getA", '{"x": 1}')))
    assert not TOOL.grade(said(text), answer)


def test_tooluse_grade_reads_only_after_the_thinking():
    answer = TOOL.reference(calls(("getA", "{}")))
    assert TOOL.grade(said("Thought: easy\nAction: getA\nAction Input: {}"), answer)
    assert not TOOL.grade("<think>\nAction: getA\nAction Input: {}\n</think>\n\nDone.", answer)
    assert not TOOL.grade("<think>\nAction: getA\nAction Input: {}", answer)


# --- code_instruct -----------------------------------------------------------------------------------------

CODE = get_task("code_instruct")
ADD_TESTS = CODE.reference(json.dumps(["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]))
SUM_TESTS = CODE.reference(json.dumps([{"input": "1 2\n", "output": "3\n"}, {"input": "5 5\n", "output": "10"}]))


def block(code: str, tag: str = "python") -> str:
    return f"Let me write it.\n\n```{tag}\n{code}\n```\n"


def test_code_prompt_is_the_papers():
    prompt = CODE.prompt("Add two numbers.\n")
    assert prompt == CODE_PROMPT.format(problem="Add two numbers.")
    assert prompt.startswith("You are a coding expert.") and "enclosed with ``` ```.\n\nAdd two numbers." in prompt


def test_last_code_block_prefers_the_last_python_block():
    text = "```python\nx = 1\n```\nthen\n```py\nx = 2\n```\nexample:\n```\n>>> x\n```"
    assert last_code_block(text) == "x = 2\n"
    assert last_code_block("```\nx = 3\n```") == "x = 3\n"
    assert last_code_block("```text\nhello\n```") is None
    assert last_code_block("no code") is None
    # An unclosed last fence (a truncated answer) is no code, not the block before it.
    assert last_code_block("```python\nx = 1\n```\n```python\nx = 2") is None


@pytest.mark.parametrize(
    ("raw", "tests"),
    [
        (json.dumps(["assert f(1) == 2"]), [{"code": "assert f(1) == 2"}]),
        # A hub list cell read as text is its Python repr.
        (str(["assert f(1) == 2", "assert f(2) == 3"]), [{"code": "assert f(1) == 2"}, {"code": "assert f(2) == 3"}]),
        (json.dumps([{"input": "1\n", "output": "2\n"}]), [{"stdin": "1\n", "stdout": "2\n"}]),
        (json.dumps([{"fn": "f", "args": [1], "expected": 2}]), [{"fn": "f", "args": [1], "expected": 2}]),
        (
            json.dumps({"inputs": ["[1, 2]\n3"], "outputs": ["[1, 3]"], "testtype": "functional", "fn_name": "f"}),
            [{"fn": "f", "args": [[1, 2], 3], "expected": [1, 3]}],
        ),
        (
            json.dumps({"inputs": ["1 2\n"], "outputs": ["3\n"], "testtype": "stdin", "fn_name": "", "time_limit": 6}),
            [{"stdin": "1 2\n", "stdout": "3\n"}],
        ),
        (
            json.dumps(
                {"inputs": ["def check(c):\n    assert c(1) == 2\ncheck(f)"], "outputs": [""], "testtype": "code"}
            ),
            [{"code": "def check(c):\n    assert c(1) == 2\ncheck(f)"}],
        ),
    ],
)
def test_code_reference_reads_the_raw_forms_into_canonical_json(raw, tests):
    reference = CODE.reference(raw)
    assert json.loads(reference) == tests
    assert CODE.reference(reference) == reference  # canonical is a fixed point


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        ("assert f(1) == 2", "neither JSON nor a Python literal"),
        ("[]", "non-empty list"),
        ('["f(1) == 2"]', "test 1: code has no assert statement"),
        ('["assert f(1) == 2", "assert f(1 =="]', "test 2: code does not parse"),
        ('[{"input": "1"}]', "none of code"),
        ('[{"fn": "not a name", "args": [], "expected": 1}]', "fn must be a Python name"),
        ('{"inputs": ["1"], "outputs": ["2"], "testtype": "interactive"}', "unknown testtype 'interactive'"),
    ],
)
def test_code_reference_is_none_and_the_error_names_the_defect(raw, why):
    assert CODE.reference(raw) is None
    with pytest.raises(GraftlabError, match=why):
        parse_tests(raw)


def test_code_grade_passes_a_correct_solution_of_each_test_form():
    assert CODE.grade(said(block("def add(a, b):\n    return a + b")), ADD_TESTS)
    assert CODE.grade(said(block("a, b = map(int, input().split())\nprint(a + b)")), SUM_TESTS)
    # sys.stdin.buffer and open(0) see the input too; exit() after printing is a normal end.
    assert CODE.grade(said(block("print(sum(map(int, open(0).read().split())))\nexit()")), SUM_TESTS)
    fast_io = "import sys\nsys.stdout.buffer.write(str(sum(map(int, sys.stdin.buffer.read().split()))).encode())"
    assert CODE.grade(said(block(fast_io)), SUM_TESTS)
    functional = CODE.reference(json.dumps([{"fn": "pair", "args": [[4, 5], 1], "expected": [4, 1]}]))
    assert CODE.grade(said(block("class Solution:\n    def pair(self, xs, k):\n        return (xs[0], k)")), functional)


@pytest.mark.parametrize(
    "code",
    [
        "def add(a, b):\n    return a - b",  # wrong on the first test
        "def add(a, b):\n    return a + b if a > 0 else 5",  # wrong on the second test only
        "def add(a, b):\n    return a + b\nimport sys\nsys.exit(0)",  # exiting is not passing
        "def add(a, b):\n    return a + b\nimport os\nos._exit(0)",  # nor is leaving without a verdict
        "def add(a, b)\n    return a + b",  # syntax error
        "x = [0] * (10**9)\ndef add(a, b):\n    return a + b",  # over the 1 GiB address-space cap
    ],
)
def test_code_grade_fails_wrong_or_broken_solutions(code):
    assert not CODE.grade(said(block(code)), ADD_TESTS)


def test_code_grade_stops_an_infinite_loop_at_the_timeout():
    start = time.monotonic()
    passed, detail = run_tests("while True:\n    pass", parse_tests(ADD_TESTS), timeout=0.5)
    assert not passed and detail == "timed out after 0.5 s"
    assert time.monotonic() - start < 3


def test_code_grade_names_the_failing_test():
    assert run_tests("def add(a, b):\n    return a - b", parse_tests(ADD_TESTS)) == (
        False,
        "test 1 of 2: AssertionError: ",
    )
    assert run_tests("def add(a, b)\n    return a", parse_tests(ADD_TESTS))[1].startswith("test 1 of 2: SyntaxError")


@pytest.mark.parametrize(
    "text",
    [
        "def add(a, b):\n    return a + b",  # no code block
        "```python\ndef add(a, b):\n    return a + b",  # the block never closed
        "",
    ],
)
def test_code_grade_fails_without_a_closed_code_block(text):
    assert not CODE.grade(said(text), ADD_TESTS)


def test_code_grade_reads_only_after_the_thinking():
    good = block("def add(a, b):\n    return a + b")
    assert not CODE.grade(f"<think>\n{good}</think>\n\nDone.", ADD_TESTS)
    assert not CODE.grade(f"<think>\n{good}", ADD_TESTS)


def test_code_runs_in_a_fresh_isolated_interpreter():
    # Nothing of the grading process leaks in: not its modules (graftlab's tasks/ holds a math.py that
    # must not shadow the standard one), not its working directory.
    code = (
        "import math, os, sys\n"
        "assert math.pi > 3 and 'graftlab' not in sys.modules\n"
        "assert os.path.basename(os.getcwd()).startswith('graftlab-code-')\n"
        "def add(a, b):\n    return a + b"
    )
    assert run_tests(code, parse_tests(ADD_TESTS)) == (True, "")


def test_data_sets_in_the_papers_shapes_load_through_a_problem_source(tmp_path):
    """Rows shaped like SDPO-CL's SciKnowEval and tool-use files, and like Dolci (its tests a list column,
    which a problem source reads as the list's Python repr), become problems; ungradable rows are skipped."""
    import polars as pl

    from graftlab.tasks.sources import ProblemSource, load_problems

    tool_prompt = TOOLUSE_TEMPLATE.format(tools=TOOLS, question="A fact?")
    sets = {
        "mcq_instruct": [
            {"idx": 1, "prompt": "Q?\n\nA: x\nB: y", "answer": "B"},
            {"idx": 2, "prompt": "Q2?", "answer": "?"},
        ],
        "tooluse_instruct": [
            {"idx": 1, "prompt": tool_prompt, "answer": calls(("getAxolotlFacts", '{"limit": 1}'))},
            {"idx": 2, "prompt": tool_prompt, "answer": calls(("[Optional]getAxolotlFacts", "{}"))},
        ],
        "code_instruct": [
            {"idx": 1, "prompt": "Write add.", "answer": ["assert add(1, 2) == 3"]},
            {"idx": 2, "prompt": "Write sub.", "answer": ["sub(1, 2)"]},
        ],
    }
    for task, rows in sets.items():
        path = tmp_path / f"{task}.parquet"
        pl.DataFrame(rows).write_parquet(path)
        columns = {"prompt": "prompt", "answer": "answer", "id": "idx"}
        problems, stats = load_problems(ProblemSource(task, str(path), task=task, columns=columns))
        assert problems["id"].to_list() == ["1"] and stats["skipped"]["unparsable"] == 1, task
        assert problems["prompt"][0] == get_task(task).prompt(rows[0]["prompt"])
        raw = rows[0]["answer"]
        assert problems["answer"][0] == get_task(task).reference(json.dumps(raw) if isinstance(raw, list) else raw)
