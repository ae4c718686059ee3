"""The `tooluse_instruct` task: ToolAlpaca-style tool calls for an instruct model, answered as
`Action:` / `Action Input:` lines, as in SDPO-CL (github.com/Moenupa/SDPO-CL).

What the data set must hold:
- prompt column: the whole prompt, that is the paper's template (`TOOLUSE_TEMPLATE`) with the available
  tools (name, description, and each function's parameters and output) and the user's question filled
  in. SDPO-CL's `datasets/tooluse/{train,test}.json` store prompts in exactly this form. The tools
  differ per problem and sit in the middle of the template, so the task cannot add them: it poses the
  column as written. It refuses a prompt without the `Action Input:` format line, because the model
  would then never be told the format the grader reads;
- answer column: a JSON list of the reference calls, `[{"Action": name, "Action_Input": input}, ...]`,
  where each input is a JSON object or a JSON string that holds one (upstream stores strings).

Grading (`tooluse_grade`) reads the text after the thinking, as SDPO-CL's grader
(`verl/utils/reward_score/feedback/tooluse.py`) does:
- action names: every `Action:\\s*(\\w+)` in the text. They must equal the reference names as a multiset
  (order and position free);
- inputs: every JSON object that follows an `Action Input:` is parsed and merged with `dict.update`, in
  order. A value that is not valid JSON, or not an object, is skipped, as upstream skips it. The merged
  object must equal the merged reference inputs as JSON values.

Both must match. There is one deliberate difference: the inputs are parsed with `json.JSONDecoder.
raw_decode`, which reads nested objects whole. Upstream's non-greedy `{.*?}` cuts them, so it can never
reward a correct nested input. A reference whose action name is not a `\\w+` word (ToolAlpaca has
`[Optional]updateUserProfile`) can never match any completion, so `tooluse_reference` returns None for
it and the row is skipped as unparsable.
"""

import json
import re

from graftlab.errors import GraftlabError
from graftlab.tasks.chat import extract_answer

# SDPO-CL's tool-use prompt, as its tooluse files store it (one header and format block for every row).
TOOLUSE_FORMAT = (
    "Use the following format:\n"
    "Thought: you should always think about what to do\n"
    "Action: the action to take, should be one of the tool names.\n"
    "Action Input: the input to the action, must be in JSON format. All of the action input must be "
    "realistic and from the user."
)
TOOLUSE_TEMPLATE = (
    "Your task is to answer the user's question using available tools. \n"
    "You have access to the following tools:\n{tools}\n\n" + TOOLUSE_FORMAT + "\n\nBegin!\nQuestion: {question}"
)

ACTION = re.compile(r"Action:\s*(\w+)")
ACTION_INPUT = re.compile(r"Action Input:\s*")
_NAME = re.compile(r"\w+")
_DECODER = json.JSONDecoder()


def tooluse_prompt(problem: str) -> str:
    """The user turn: the data set's prompt as written, which must already hold the tools and the format."""
    text = problem.strip()
    if "Action Input:" not in text:
        raise GraftlabError(
            "task tooluse_instruct: the prompt column must hold the whole tool-use prompt (the tools and the "
            f"'Action:' / 'Action Input:' format, as in TOOLUSE_TEMPLATE); this one lacks 'Action Input:': "
            f"{text[:120]!r}"
        )
    return text


def parse_calls(text: str) -> tuple[list[str], dict]:
    """The action names of `text` in order, and its action inputs merged into one object: each JSON
    object after an `Action Input:` updates the merge in turn; a value that is not one is skipped."""
    names = ACTION.findall(text)
    merged: dict = {}
    for match in ACTION_INPUT.finditer(text):
        try:
            value, _ = _DECODER.raw_decode(text, match.end())
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict):
            merged.update(value)
    return names, merged


def _reference_call(item) -> dict:
    """One reference call as `{"Action": name, "Action_Input": object}`; ValueError naming the defect."""
    if not isinstance(item, dict) or not {"Action", "Action_Input"} <= set(item):
        raise ValueError(f"a call must be an object with Action and Action_Input, got {item!r}")
    name, given = item["Action"], item["Action_Input"]
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"action name {name!r} is not a word the grader's `Action:\\s*(\\w+)` can read")
    value = json.loads(given) if isinstance(given, str) else given
    if not isinstance(value, dict):
        raise ValueError(f"the input of {name} is not a JSON object: {given!r}")
    return {"Action": name, "Action_Input": value}


def reference_calls(raw: str) -> list[dict]:
    """The reference calls of an answer cell (a JSON list of calls, inputs as objects or JSON strings),
    each input parsed; GraftlabError naming what is wrong with it."""
    try:
        calls = json.loads(raw)
        if not isinstance(calls, list) or not calls:
            raise ValueError(f"expected a non-empty JSON list of calls, got {type(calls).__name__}")
        return [_reference_call(item) for item in calls]
    except ValueError as e:  # json.JSONDecodeError is a ValueError
        raise GraftlabError(f"task tooluse_instruct: unusable reference calls ({e}): {raw[:200]!r}") from e


def tooluse_reference(raw: str) -> str | None:
    """The reference as canonical JSON (inputs as objects, keys sorted); None when it cannot be graded."""
    try:
        calls = reference_calls(raw)
    except GraftlabError:
        return None
    return json.dumps(calls, sort_keys=True, ensure_ascii=False)


def tooluse_grade(completion: str, answer: str) -> bool:
    """Correct when the completion's action names equal the reference's as a multiset and its merged
    action inputs equal the reference's merged inputs."""
    final = extract_answer(completion)
    if final is None:
        return False
    calls = reference_calls(answer)
    names, merged = parse_calls(final)
    expected: dict = {}
    for call in calls:
        expected.update(call["Action_Input"])
    return sorted(names) == sorted(c["Action"] for c in calls) and merged == expected
