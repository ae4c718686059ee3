"""The `math` task: the final answer is the last `\\boxed{...}` of the text after the thinking, compared
with the reference by Hugging Face's math-verify (symbolic and numeric equivalence: `\\frac{1}{2}`
equals `0.5`). math-verify and sympy are imported where used: the registry is imported by the workflow.
"""

import logging
import re
import threading
from functools import lru_cache

from graftlab.tasks.chat import extract_answer

log = logging.getLogger(__name__)

# The instruction of Qwen's math evaluations: it asks for the boxed answer the grader looks for.
MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
# math-verify bounds each parse and each comparison with SIGALRM; sympy can hang on adversarial input
# (a model writing 10^{10^{10}}), so an unbounded grader could stall a whole evaluation job.
PARSE_TIMEOUT_S = 5
VERIFY_TIMEOUT_S = 5


_BOXED = re.compile(r"\\boxed\s*\{")


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` in `text`, nested braces included; None when there is none or
    the last one is never closed (a truncated answer is no answer, not the box before it)."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    depth, i = 1, starts[-1]
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            # `\{` and `\}` are literal braces in LaTeX (sets), not grouping: skip the escaped char.
            i += 2
            continue
        depth += (ch == "{") - (ch == "}")
        if depth == 0:
            return text[starts[-1] : i].strip()
        i += 1
    return None


def _timeout(seconds: int) -> int | None:
    """math-verify's timeouts use signal.alarm, which raises ValueError outside the main thread; there
    the bound is dropped (None) rather than failing every grade. Samplers call graders from the main
    thread, so in practice the bound holds."""
    return seconds if threading.current_thread() is threading.main_thread() else None


def _parse_boxed(content: str) -> list:
    """math-verify's parse of one boxed expression: sympy objects plus the string it matched; [] when it
    raised or timed out (its TimeoutException is a BaseException, so `Exception` alone misses it)."""
    from math_verify import parse
    from math_verify.errors import TimeoutException

    try:
        return parse(f"\\boxed{{{content}}}", parsing_timeout=_timeout(PARSE_TIMEOUT_S), raise_on_error=False)
    except (Exception, TimeoutException):
        log.debug("math-verify could not parse %r", content, exc_info=True)
        return []


@lru_cache(maxsize=4096)
def _parse_gold(reference: str) -> tuple:
    # Every problem is graded n times against the same reference: parse it once.
    return tuple(_parse_boxed(reference))


def _answer_content(raw: str) -> str | None:
    # Data sets store either the bare answer or a worked solution ending in a box (MATH's `solution`).
    text = raw.strip()
    return last_boxed(text) if "\\boxed" in text else text


def math_reference(raw: str) -> str | None:
    """The reference of a math problem: the last boxed expression of a worked solution, else the whole
    answer; None when math-verify reads no mathematical object in it (only its raw-string fallback)."""
    from sympy import Basic, MatrixBase

    content = _answer_content(raw)
    if not content:
        return None
    if not any(isinstance(p, (Basic, MatrixBase)) for p in _parse_gold(content)):
        return None
    return content


def math_grade(completion: str, answer: str) -> bool:
    """Correct when the last boxed expression after `</think>` is equivalent to the reference. Any
    failure of math-verify (error, timeout) grades the sample wrong, never the job."""
    from math_verify import verify
    from math_verify.errors import TimeoutException

    final = extract_answer(completion)
    predicted = last_boxed(final) if final is not None else None
    if not predicted:
        return False
    reference = _answer_content(answer)
    gold = _parse_gold(reference) if reference else ()
    target = _parse_boxed(predicted)
    if not gold or not target:
        return False
    try:
        # Gold first: math-verify is asymmetric (assignments like `x=3` are simplified on the gold side).
        return bool(verify(list(gold), target, timeout_seconds=_timeout(VERIFY_TIMEOUT_S), raise_on_error=False))
    except (Exception, TimeoutException):
        log.debug("math-verify failed comparing %r with %r", predicted, answer, exc_info=True)
        return False


def math_prompt(problem: str) -> str:
    return f"{problem.strip()}\n\n{MATH_INSTRUCTION}"
