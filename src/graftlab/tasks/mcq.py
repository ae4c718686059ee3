"""The `mcq_instruct` task: multiple choice (SciKnowEval chemistry L3, GPQA) for an instruct model, the
chosen letter written in `<answer>` tags, as in SDPO-CL (github.com/Moenupa/SDPO-CL).

What the data set must hold:
- prompt column: the question with its lettered options, one per line, as SDPO-CL's SciKnowEval files
  store it (`{question}\\n\\nA: {text}\\nB: {text}\\n...\\nPlease reason step by step.`). The task puts
  the paper's instruction in front of it (`MCQ_INSTRUCTION`). GPQA's hub rows hold the options in
  separate columns (`Correct Answer`, `Incorrect Answer 1..3`), so they need a preparation step that
  writes them in this form, with the options in a seeded order;
- answer column: the correct option's letter. `B`, `b`, `(B)`, `B)`, `B.`, `B:` and `[B]` all read as
  `B`; any other cell cannot be graded (`mcq_reference` returns None).

Grading (`mcq_grade`) reads the text after the thinking. The content of its last `<answer>...</answer>`,
stripped of surrounding whitespace, must equal the reference letter exactly. This is SDPO-CL's
SciKnowEval grader (`verl/utils/reward_score/feedback/mcq.py`) with two differences. A last `<answer>`
that is never closed counts as no answer, where upstream reads on to the end of the text. A completion
with no `<answer>` tag counts as wrong, where upstream compares the whole text. There is no fallback to
a boxed letter, because upstream's MCQ grader has none. Upstream grades GPQA differently: it uses its own
boxed prompt and takes the last A-D letter anywhere in the response. That is not reproduced here: GPQA
posed through this task gets this task's prompt and grader.
"""

import re

from graftlab.tasks.chat import extract_answer

# SDPO-CL sends this as a system message (`data/format/sciknoweval.py`, SYSTEM_PROMPT). It says "four
# options" and "A, B, C, or D" even for the two-option questions, as upstream does. graftlab's chat
# prompt is a single user turn with no system turn (`tasks/chat.py`), so the instruction goes at the
# start of the user turn, where a system message would be rendered.
MCQ_INSTRUCTION = (
    "Given a question and four options, please select the right answer. Respond in the following format:\n"
    "<reasoning>\n...\n</reasoning>\n<answer>\n...\n</answer>\n\n"
    "For the answer, only output the letter corresponding to the correct option (A, B, C, or D), and nothing "
    'else. Do not restate the answer text. For example, if the answer is "A", just output:\n'
    "<answer>\nA\n</answer>"
)

ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
# One option letter, optionally wrapped as data sets write it: (B), B), B., B:, [B].
_LETTER = re.compile(r"[(\[]?\s*([A-Za-z])\s*[)\].:]?")


def mcq_prompt(problem: str) -> str:
    """The user turn: the paper's answer-format instruction, then the question with its options."""
    return f"{MCQ_INSTRUCTION}\n\n{problem.strip()}"


def mcq_reference(raw: str) -> str | None:
    """The reference letter in upper case (`(b)` -> `B`); None when the cell is not a single letter."""
    match = _LETTER.fullmatch(raw.strip())
    return match.group(1).upper() if match else None


def last_tagged_answer(text: str) -> str | None:
    """The stripped content of the last `<answer>...</answer>` in `text`. None when there is no tag, or
    when the last one is never closed (a truncated answer is no answer, not the tag before it)."""
    start = text.rfind(ANSWER_OPEN)
    if start < 0:
        return None
    end = text.find(ANSWER_CLOSE, start)
    return None if end < 0 else text[start + len(ANSWER_OPEN) : end].strip()


def mcq_grade(completion: str, answer: str) -> bool:
    """Correct when the last closed `<answer>` after `</think>` holds exactly the reference letter."""
    final = extract_answer(completion)
    predicted = last_tagged_answer(final) if final is not None else None
    return predicted is not None and predicted == answer.strip()
