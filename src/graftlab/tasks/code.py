"""The `code_instruct` task: Python programs for an instruct model (Dolci-Think-RL code, LiveCodeBench),
graded by running them against unit tests, as in SDPO-CL (github.com/Moenupa/SDPO-CL).

What the data set must hold:
- prompt column: the problem statement (with the required signature, if any). The task puts SDPO-CL's
  `CODE_PROMPT` in front of it. Map the bare problem, not a column that already holds that prompt;
- answer column: the unit tests. `code_reference` stores them in one canonical form, a JSON list of
  tests, each one of:
    {"code": "assert add(1, 2) == 3"}               statements run after the program; pass = no exception
    {"stdin": "1 2\\n", "stdout": "3"}                the program run as __main__ on that input; pass = the
                                                    same output, newlines read as spaces and ends stripped
    {"fn": "add", "args": [1, 2], "expected": 3}    that function (or method of a `Solution` class) called on
                                                    args; pass = the result equals `expected` as JSON data
  The raw forms it accepts are:
  - a list of assert snippets (Dolci's `ground_truth`). The list may be JSON, or the Python repr that a
    hub list cell becomes once it is read as text;
  - a list of `{"input", "output"}` stdin cases;
  - the canonical list;
  - SDPO-CL's test object `{"inputs", "outputs", "testtype", "fn_name"}` (its LiveCodeBench and
    HumanEval+ format). A `functional` input there is one JSON argument per line. Its `time_limit` is
    not used.
  A `code` test with no `assert` statement would pass any program, so it is refused.

Grading (`code_grade`) takes the last fenced code block after the thinking: the last one tagged
python/py/python3, else the last untagged one. An unclosed last fence, as in a truncated completion,
counts as no code. The block runs in a fresh `python -I` subprocess (`code_harness.py`), in an empty
temporary directory, with a clean environment. Each test gets a fresh execution of the program, and the
whole problem gets `TIMEOUT_S` seconds of wall time. The address space is capped at `MEMORY_BYTES`, and
CPU time, core dumps and file size are capped too. The completion passes only when every test passes
(upstream's sparse reward). Code is never executed in graftlab's own process. This is not a sandbox:
network access, file access outside the directory and child processes are not prevented (there is no
portable way to do so without root), so grade only model output you would run yourself.

How this differs from upstream (`verl/utils/reward_score/feedback/code.py`):
- upstream runs the *longest* fenced block;
- it runs one process per test, with `time_limit + 1` seconds each;
- it restricts builtins and imports;
- it runs `code` tests with `__name__ == "__main__"`. Here they run as a module named `solution`, so a
  program's own `if __name__ == "__main__":` demo does not run under the asserts.
"""

import ast
import contextlib
import json
import logging
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from graftlab.errors import GraftlabError
from graftlab.tasks.chat import extract_answer

log = logging.getLogger(__name__)

# SDPO-CL's `data/format/prompts.py` CODE_PROMPT, word for word (its "1 second" is the model's target;
# the grader allows TIMEOUT_S for all of a problem's tests together).
CODE_PROMPT = (
    "You are a coding expert. You will be given a coding problem, and you need to write a correct Python "
    "program that matches the specification and passes all tests. The time limit is 1 second. You may start "
    "by outlining your thought process. In the end, please provide the complete code in a code block "
    "enclosed with ``` ```.\n\n{problem}"
)
TIMEOUT_S = 5.0  # wall-clock seconds for all of one problem's tests, interpreter start-up included
MEMORY_BYTES = 1 << 30  # address-space cap of the subprocess (upstream's 1 GiB)
HARNESS = Path(__file__).with_name("code_harness.py")
PYTHON_TAGS = {"python", "py", "python3"}

_FENCE = re.compile(r"```([^\n`]*)\n(.*?)```", re.DOTALL)
# Threads of numerical libraries reserve address space per thread; one thread keeps them under the cap.
_ENV = {"PATH": os.defpath, "LC_ALL": "C.UTF-8", "LANG": "C.UTF-8"} | dict.fromkeys(
    ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"), "1"
)


def code_prompt(problem: str) -> str:
    return CODE_PROMPT.format(problem=problem.strip())


def last_code_block(text: str) -> str | None:
    """The program of a completion: the last fenced block tagged python (else the last untagged one);
    None when there is none or the last fence is never closed."""
    if text.count("```") % 2:
        return None
    blocks = [(tag.strip().lower(), body) for tag, body in _FENCE.findall(text)]
    for wanted in (lambda tag: tag in PYTHON_TAGS, lambda tag: not tag):
        chosen = [body for tag, body in blocks if wanted(tag)]
        if chosen:
            return chosen[-1]
    return None


def _load(raw: str):
    """A test cell's value: JSON, else a Python literal (the repr of a hub list cell read as text)."""
    try:
        return json.loads(raw)
    except ValueError:
        pass
    try:
        return ast.literal_eval(raw)
    except (ValueError, SyntaxError, MemoryError, RecursionError) as e:
        raise ValueError("neither JSON nor a Python literal") from e


def _from_upstream(spec: dict) -> list:
    """SDPO-CL's `{"inputs", "outputs", "testtype", "fn_name"}` as a list of canonical tests."""
    kind, pairs = spec.get("testtype"), list(zip(spec["inputs"], spec["outputs"], strict=True))
    if kind == "code":
        return [{"code": test} for test, _ in pairs]
    if kind == "stdin":
        return [{"stdin": given, "stdout": want} for given, want in pairs]
    if kind == "functional":
        name = spec.get("fn_name")
        return [
            {
                "fn": name,
                "args": [json.loads(line) for line in given.splitlines() if line.strip()],
                "expected": json.loads(want),
            }
            for given, want in pairs
        ]
    raise ValueError(f"unknown testtype {kind!r} (expected code, stdin or functional)")


def _check_code(code) -> None:
    if not isinstance(code, str):
        raise ValueError(f"code must be a string, got {type(code).__name__}")
    try:
        tree = ast.parse(code)
    except SyntaxError as e:
        raise ValueError(f"code does not parse: {e}") from e
    if not any(isinstance(node, ast.Assert) for node in ast.walk(tree)):
        raise ValueError("code has no assert statement, so it would pass any program")


def _canonical_test(item) -> dict:
    """One test in canonical form (see the module docstring); ValueError naming what is wrong."""
    if isinstance(item, str):
        item = {"code": item}
    elif isinstance(item, dict) and set(item) == {"input", "output"}:
        item = {"stdin": item["input"], "stdout": item["output"]}
    if not isinstance(item, dict):
        raise ValueError(f"a test must be a string or an object, got {type(item).__name__}")
    if set(item) == {"code"}:
        _check_code(item["code"])
    elif set(item) == {"stdin", "stdout"}:
        if not all(isinstance(v, str) for v in item.values()):
            raise ValueError("stdin and stdout must be strings")
    elif set(item) == {"fn", "args", "expected"}:
        if not isinstance(item["fn"], str) or not item["fn"].isidentifier() or not isinstance(item["args"], list):
            raise ValueError("fn must be a Python name and args a list")
    else:
        raise ValueError(f"keys {sorted(item)} are none of code | stdin, stdout | fn, args, expected")
    return item


def parse_tests(raw: str) -> list[dict]:
    """The tests of an answer cell in canonical form; GraftlabError naming what is wrong with it."""
    try:
        value = _load(raw)
        if isinstance(value, dict) and {"inputs", "outputs"} <= set(value):
            value = _from_upstream(value)
        if not isinstance(value, list) or not value:
            raise ValueError("expected a non-empty list of tests or an object with inputs and outputs")
        tests = []
        for i, item in enumerate(value, 1):
            try:
                tests.append(_canonical_test(item))
            except ValueError as e:
                raise ValueError(f"test {i}: {e}") from e
        return tests
    except (ValueError, KeyError, TypeError) as e:
        raise GraftlabError(f"task code_instruct: unusable tests ({e}): {raw[:200]!r}") from e


def code_reference(raw: str) -> str | None:
    """The tests as canonical JSON (keys sorted); None when they cannot be used."""
    try:
        tests = parse_tests(raw)
    except GraftlabError as e:
        log.debug("%s", e)
        return None
    return json.dumps(tests, sort_keys=True, ensure_ascii=False)


def run_tests(code: str, tests: list[dict], timeout: float = TIMEOUT_S) -> tuple[bool, str]:
    """Run `code` against canonical `tests` in a fresh `python -I` subprocess (`code_harness.py`):
    whether every test passed, and what failed ("" when all passed)."""
    token = secrets.token_hex(16)
    payload = json.dumps({"code": code, "tests": tests, "token": token})
    cpu = str(int(timeout) + 1)
    with tempfile.TemporaryDirectory(prefix="graftlab-code-") as cwd:
        proc = subprocess.Popen(
            [sys.executable, "-I", str(HARNESS), str(MEMORY_BYTES), cpu],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=cwd,
            env=_ENV | {"HOME": cwd},
            start_new_session=True,
            encoding="utf-8",
            errors="replace",
        )
        try:
            out, err = proc.communicate(payload, timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the whole group: whatever the program started too
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.communicate(timeout=1)  # a child that left the group may still hold the pipe
            return False, f"timed out after {timeout} s"
    lines = out.splitlines()
    try:
        verdict = json.loads(lines[-1])
    except (IndexError, ValueError):
        return False, f"the harness gave no verdict (exit status {proc.returncode}): {err[-300:]!r}"
    if verdict.get("token") != token:
        return False, "the verdict does not carry this run's token"
    return bool(verdict["passed"]), verdict["detail"]


def code_grade(completion: str, answer: str, timeout: float = TIMEOUT_S) -> bool:
    """Correct when the last code block after `</think>` passes every test of the reference."""
    final = extract_answer(completion)
    program = last_code_block(final) if final is not None else None
    if not program:
        return False
    passed, detail = run_tests(program, parse_tests(answer), timeout)
    if not passed:
        log.debug("code_instruct: %s", detail)
    return passed
