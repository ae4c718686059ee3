"""The tiny world's tasks: three old arithmetic skills and a hard new one, each with a programmatic solver
that writes the step-by-step thinking an expert would.

Operands are written with two digits ("06+39="), so a digit's column is a fixed position in the prompt:
a model of a few hundred thousand parameters then learns the column-wise traces within minutes.

A problem is a dict `{"id", "task", "prompt", "answer", "thinking"}`; `prompt` is the user turn,
`thinking` the expert trace that goes between `<think>` tags, `answer` the graded final text.
"""

import functools
import random
import re
from collections import Counter
from collections.abc import Callable

from graftlab.streams import stream

OLD_TASKS = ("add", "sub", "compare")
# `times` is `mul` in a format of its own ("product(47,8)?"), like no old task's: the fidelity study asks
# whether a new task that shares the old tasks' format is what routes its update into their machinery.
NEW_TASKS = ("mul", "times")
# Domains of the continual chain (issue 17), learnt after post-training like the new tasks. `order` is
# compare posed in a format of its own ("order 12 34"), a neighbour on compare's machinery that the post
# model already solves now and then (about 0.2 Acc@4 on the default world), so the RL methods see reward;
# `muln` is `mul` whose final answer is written in another format ("n=376"), so a stage can change the
# answer format as the second paper's tool-use stage did.
CHAIN_TASKS = ("order", "muln")


def _digits(n: int, width: int) -> list[int]:
    return [int(c) for c in str(n).zfill(width)][::-1]


def add(a: int, b: int) -> tuple[str, str, str]:
    steps, carry = [], 0
    da, db = _digits(a, 2), _digits(b, 2)
    for x, y in zip(da, db):
        s = x + y + carry
        steps.append(f"{x}+{y}+{carry}={s}")
        carry = s // 10
    return f"{a:02d}+{b:02d}=", ";".join(steps), str(a + b)


def sub(a: int, b: int) -> tuple[str, str, str]:
    a, b = max(a, b), min(a, b)
    steps, borrow = [], 0
    for x, y in zip(_digits(a, 2), _digits(b, 2)):
        top = x - borrow
        borrow = int(top < y)
        steps.append(f"{top + 10 * borrow}-{y}={top + 10 * borrow - y}")
    return f"{a:02d}-{b:02d}=", ";".join(steps), str(a - b)


def compare(a: int, b: int) -> tuple[str, str, str]:
    sign = "<" if a < b else ">" if a > b else "="
    ta, tb = str(a).zfill(2), str(b).zfill(2)
    first = next((i for i in range(2) if ta[i] != tb[i]), 1)
    return f"compare {ta} {tb}", f"{ta[first]}{sign}{tb[first]}", sign


def mul(a: int, b: int) -> tuple[str, str, str]:
    """2-digit times 1-digit: hard for the post model, learnable from traces. Each column is a table
    fact plus the carry ("7*8=56+5=61"), two pieces the pretraining corpus holds separately."""
    steps, carry = [], 0
    for x in _digits(a, 2):
        p = x * b
        steps.append(f"{x}*{b}={p}+{carry}={p + carry}")
        carry = (p + carry) // 10
    return f"{a}*{b}=", ";".join(steps), str(a * b)


def times(a: int, b: int) -> tuple[str, str, str]:
    """`mul` with its own prompt format; the same thinking and answer."""
    _, thinking, answer = mul(a, b)
    return f"product({a},{b})?", thinking, answer


def order(a: int, b: int) -> tuple[str, str, str]:
    """`compare` posed as "order 12 34": the same thinking and answer."""
    _, thinking, answer = compare(a, b)
    return f"order {a:02d} {b:02d}", thinking, answer


def muln(a: int, b: int) -> tuple[str, str, str]:
    """`mul` whose final answer has a prefix no other task writes ("n=376")."""
    prompt, thinking, answer = mul(a, b)
    return prompt.replace("=", "=?"), thinking, f"n={answer}"


def div(a: int, b: int) -> tuple[str, str, str]:
    """2-digit by 1-digit long division, left to right, the remainder carried into the next digit."""
    steps, rest = [], 0
    for d in _digits(a, 2)[::-1]:
        top = 10 * rest + d
        steps.append(f"{top}/{b}={top // b}r{top % b}")
        rest = top % b
    return f"{a}/{b}=", ";".join(steps), f"{a // b}r{a % b}"


def maxd(a: int, b: int) -> tuple[str, str, str]:
    """The larger digit of each column ("7!2=7"), ones first."""
    pairs = list(zip(_digits(a, 2), _digits(b, 2)))
    steps = [f"{x}!{y}={max(x, y)}" for x, y in pairs]
    return f"{a:02d}!{b:02d}=", ";".join(steps), "".join(str(max(x, y)) for x, y in pairs[::-1])


def absd(a: int, b: int) -> tuple[str, str, str]:
    """The distance of each column's digits ("7:2=5"), ones first."""
    pairs = list(zip(_digits(a, 2), _digits(b, 2)))
    steps = [f"{x}:{y}={abs(x - y)}" for x, y in pairs]
    return f"{a:02d}:{b:02d}=", ";".join(steps), "".join(str(abs(x - y)) for x, y in pairs[::-1])


# Task families seen only in pretraining (`world.corpus.families`), as chat-format solved problems. Each is
# posed like the old tasks ("84/4=") and thinks in columns written with an operator of its own (a character
# of the tokenizer's) that no task's `STEP_OPERATORS` holds. A corpus with several of them teaches that the
# prompt's operator picks the procedure, before post-training narrows the model to the old tasks. No
# benchmark, candidate or chain stage draws them, so they are kept out of `SOLVERS`.
FAMILIES: dict[str, Callable[[int, int], tuple[str, str, str]]] = {"div": div, "maxd": maxd, "absd": absd}


SOLVERS: dict[str, Callable[[int, int], tuple[str, str, str]]] = {
    "add": add,
    "sub": sub,
    "compare": compare,
    "mul": mul,
    "times": times,
    "order": order,
    "muln": muln,
}


# The operator a task's thinking steps are written with ("7+8+1=16", "13-5=8", "7<8", "7*8=56+5=61");
# mul first, since its steps hold a "+" too. `times` thinks exactly as mul does.
STEP_OPERATORS = {"mul": "*", "sub": "-", "compare": "<>", "add": "+"}
THINKING_FORM = {"times": "mul", "order": "compare", "muln": "mul"}


def thinking_form(thinking: str) -> str | None:
    """The task whose procedure a piece of thinking follows: the form most of its `;`-separated steps
    are written in. None when no step has an operator or two forms tie."""
    steps = thinking.replace("\n", ";").split(";")
    forms = [next((t for t, ops in STEP_OPERATORS.items() if any(o in step for o in ops)), None) for step in steps]
    ranked = Counter(f for f in forms if f).most_common(2)
    if not ranked or (len(ranked) == 2 and ranked[0][1] == ranked[1][1]):
        return None
    return ranked[0][0]


_TERM = re.compile(r"\d+(?:[+*-]\d+)*")  # "7*8", "56+5", "13-5", "61": one side of a step's "="
_COMPARISON = re.compile(r"(\d)([<>=])(\d)")


def _value(term: str) -> int:
    """A term's value, left to right: a step uses one operator, or "p+c" after a product."""
    numbers, ops = re.split(r"[+*-]", term), re.findall(r"[+*-]", term)
    value = int(numbers[0])
    for op, n in zip(ops, numbers[1:]):
        value = value * int(n) if op == "*" else value + int(n) if op == "+" else value - int(n)
    return value


def step_facts(thinking: str) -> tuple[int, int]:
    """(equalities that hold, equalities written) in a piece of thinking, step by step: "7*8=56+5=61" holds
    two ("7*8" is 56, "56+5" is 61), "4*3=10+0=10" one of two; a comparison "7<8" is one. Whether a model
    still knows the single-digit facts its procedure uses, apart from which procedure it writes
    (`thinking_form`). A step in no task's arithmetic (a family's "84/4=21r0", a broken one) counts in
    neither."""
    held = written = 0
    for step in thinking.replace("\n", ";").split(";"):
        step = step.strip()
        if m := _COMPARISON.fullmatch(step):
            a, sign, b = int(m[1]), m[2], int(m[3])
            held += (a < b) if sign == "<" else (a > b) if sign == ">" else (a == b)
            written += 1
            continue
        sides = step.split("=")
        if len(sides) < 2 or not all(_TERM.fullmatch(side) for side in sides):
            continue
        for left, right in zip(sides, sides[1:]):
            # The next side starts with the value claimed for this one ("56" of "56+5").
            held += _value(left) == int(re.match(r"\d+", right)[0])
            written += 1
    return held, written


# Tasks whose second operand is one digit.
ONE_DIGIT = ("mul", "times", "muln", "div")


def operands(task: str, rng: random.Random) -> tuple[int, int]:
    if task in ONE_DIGIT:
        return rng.randint(10, 99), rng.randint(2, 9)
    return rng.randint(0, 99), rng.randint(0, 99)


# Cached: it solves every operand pair (10,000 of them), and config validation asks it for each task of
# every experiment's world, so an uncached config of 30 experiments spent 8 s here at every snakemake start.
@functools.cache
def distinct_problems(task: str) -> int:
    """How many different problems `task` has (subtraction is canonicalised larger-first)."""
    a_range, b_range = (range(10, 100), range(2, 10)) if task in ONE_DIGIT else (range(100), range(100))
    return len({SOLVERS[task](a, b)[0] for a in a_range for b in b_range})


def problem(task: str, a: int, b: int) -> dict:
    """A problem of a task or of a pretraining family."""
    prompt, thinking, answer = (SOLVERS.get(task) or FAMILIES[task])(a, b)
    return {"id": f"{task}:{prompt}", "task": task, "prompt": prompt, "answer": answer, "thinking": thinking}


def per_task_counts(tasks: list[str], count: int) -> list[int]:
    """`count` split as evenly as possible over `tasks`, the first tasks taking the remainder."""
    return [count // len(tasks) + (i < count % len(tasks)) for i in range(len(tasks))]


def sample_problems(task: str, count: int, purpose: str, seed: int, exclude: set[str] = frozenset()) -> list[dict]:
    """`count` distinct problems of `task`, none of whose ids is in `exclude`, drawn from the stream of
    `purpose` (benchmark, posttrain, retention, replay, candidates, ...), `task` and `seed`."""
    if task not in SOLVERS:
        raise ValueError(f"unknown task {task!r}; known: {sorted(SOLVERS)}")
    if count > distinct_problems(task):  # at once, rather than after count * 200 draws
        raise ValueError(f"task {task!r} has {distinct_problems(task)} distinct problems, fewer than {count}")
    rng, seen, out = stream(purpose, task, seed), set(exclude), []
    for _ in range(count * 200):
        p = problem(task, *operands(task, rng))
        if p["id"] not in seen:
            seen.add(p["id"])
            out.append(p)
            if len(out) == count:
                return out
    raise ValueError(f"task {task!r} has fewer than {count} distinct problems outside the excluded set")


def step_fact(task: str, rng: random.Random) -> str:
    """One single-digit step of a task's thinking, as a bare fact ("7+8+1=16", "13-5=8", "7*8=56")."""
    x, y = rng.randint(0, 9), rng.randint(0, 9)
    if task == "add":
        c = rng.randint(0, 1)
        return f"{x}+{y}+{c}={x + y + c}"
    if task == "sub":
        top = x + 10 * rng.randint(0, 1)
        return f"{top}-{y}={top - y}" if top >= y else f"{y}-{x}={y - x}"
    if task in NEW_TASKS:
        return f"{x}*{y}={x * y}"
    return f"{x}{'<' if x < y else '>' if x > y else '='}{y}"


def corpus_line(task: str, rng: random.Random, step_share: float = 0.5) -> str:
    """One line of pretraining text: a bare fact, no chat markers and no thinking.

    Half the lines are single-digit steps of the tasks' thinking; multiplication appears only as its
    table, so the base model has the pieces of the new task but has never seen it assembled.
    """
    if task in NEW_TASKS or rng.random() < step_share:
        return step_fact(task, rng)
    prompt, _, answer = SOLVERS[task](*operands(task, rng))
    return f"{prompt} {answer}" if task == "compare" else f"{prompt}{answer}"


def solve(task: str, prompt: str) -> tuple[str, str]:
    """(thinking, answer) of the programmatic expert for a problem given only its prompt."""
    a, b = (int(x) for x in re.findall(r"\d+", prompt))
    _, thinking, answer = SOLVERS[task](a, b)
    return thinking, answer
