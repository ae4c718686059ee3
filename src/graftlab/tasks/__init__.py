"""Tasks: how a problem becomes a chat prompt, how its answers are drawn, and how they are graded.

Every stage that samples or grades (evaluation, mining, trace synthesis, rollouts) asks the problem's
task, `get_task(name)`, and never tests its name. A problem is a dict or row with `id`, `task`, `prompt`
(the user turn) and `answer` (plus `thinking` where an expert trace is known). Every task grades only
the text after the last `</think>`: a completion that never closes its thinking has no final answer.

- `arith`: the tiny world's arithmetic, exact match; the world's operations (`add`, `sub`, `compare`,
  `mul`, `times`) name it too, so its problem files grade by their own task column;
- `knowledge`: the knowledge world's QA, answered once, greedily, after a pre-filled empty think block
  (as knowledge training wrote its examples), exact match up to case, spacing and a final full stop;
- `math`: the last `\\boxed{...}`, compared with the reference by math-verify (`graftlab.tasks.math`);
- `math_instruct`: the same for an instruct model that writes no think block (posed with thinking off).

The instruct tasks of the second paper's continual chain (SDPO-CL), all posed with thinking off:
- `mcq_instruct`: multiple choice, the letter in the last `<answer>...</answer>` (`graftlab.tasks.mcq`);
- `tooluse_instruct`: tool calls as `Action:` / `Action Input:` lines, the action names compared as a
  multiset and the merged inputs as JSON (`graftlab.tasks.tooluse`);
- `code_instruct`: the last fenced Python block, run against the problem's unit tests in a subprocess
  (`graftlab.tasks.code`).
`mcq`, `tooluse` and `code` grade the same for a thinking model (Qwen3-4B-Thinking-2507), its own think
block before the answer.

Light to import (no torch, no polars at import time): the workflow parse imports the registry.
"""

from collections.abc import Callable
from dataclasses import dataclass, replace

from graftlab.errors import GraftlabError
from graftlab.tasks.arith import CHAIN_TASKS, NEW_TASKS, OLD_TASKS
from graftlab.tasks.chat import (
    EMPTY_THINK,
    THINK_CLOSE,
    THINK_OPEN,
    chat_completion,
    chat_prompt,
    extract_answer,
    extract_thinking,
)
from graftlab.tasks.code import code_grade, code_prompt, code_reference
from graftlab.tasks.exact import is_correct, knowledge_grade, plain_reference
from graftlab.tasks.math import math_grade, math_prompt, math_reference
from graftlab.tasks.mcq import mcq_grade, mcq_prompt, mcq_reference
from graftlab.tasks.tooluse import tooluse_grade, tooluse_prompt, tooluse_reference

__all__ = [
    "EMPTY_THINK",
    "THINK_CLOSE",
    "THINK_OPEN",
    "TASKS",
    "Task",
    "chat_completion",
    "chat_prompt",
    "extract_answer",
    "extract_thinking",
    "find_task",
    "get_task",
    "is_correct",
]


@dataclass(frozen=True)
class Task:
    """One kind of problem. `prompt` turns a data set's problem text into the user turn; `grade(completion,
    answer)` judges a whole assistant turn against the reference; `reference(raw)` turns a data set's
    answer cell into the stored reference, or None when the task could never grade against it.
    `thinking=False` pre-fills an empty think block; `greedy` draws one greedy answer per problem."""

    name: str
    prompt: Callable[[str], str]
    grade: Callable[[str, str], bool]
    reference: Callable[[str], str | None]
    thinking: bool = True
    greedy: bool = False

    def chat_prompt(self, tokenizer, user_turn: str) -> str:
        """The text the model continues: the user turn, the assistant header and any pre-filled part."""
        return chat_prompt(tokenizer, user_turn, self.thinking)

    def decoding(self, cfg):
        """The sampling config (`graftlab.sampling.SamplingConfig`) the task's answers are drawn with:
        `cfg`, or for a greedy task one greedy answer within cfg's token budget."""
        return replace(cfg, n=1, temperature=0.0, top_p=1.0) if self.greedy else cfg

    def turn(self, completion: str) -> str:
        """The whole assistant turn of a completion, the pre-filled part in front, as grading reads it."""
        return completion if self.thinking else EMPTY_THINK + completion

    def draw(self, sampler, tokenizer, problems, cfg):
        """The sampler's answers to every problem's prompt, drawn as the task decodes (what a sampler
        sampling one part of a job's chunks fills its store with: `graftlab.sample_chunks.Part`)."""
        return sampler([self.chat_prompt(tokenizer, p) for p in problems["prompt"]], self.decoding(cfg))

    def sample_and_grade(self, sampler, tokenizer, problems, cfg):
        """Sample every problem (a frame with `id`, `prompt`, `answer`) as the task decodes, and grade each
        answer: one row per sample with `problem_id`, `sample`, the whole assistant turn `completion`,
        the parsed `answer`, `correct`, and `tokens`, the sampled text's length retokenized (what
        `graftlab plan` reads as a benchmark's measured response length)."""
        import polars as pl

        outputs = self.draw(sampler, tokenizer, problems, cfg)
        texts = [t for samples in outputs for t in samples]
        lengths = iter(map(len, tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []))
        rows = []
        for pid, ref, samples in zip(problems["id"], problems["answer"], outputs):
            for i, turn in enumerate(map(self.turn, samples)):
                row = {"problem_id": pid, "sample": i, "completion": turn, "answer": extract_answer(turn)}
                rows.append(row | {"correct": self.grade(turn, ref), "tokens": next(lengths)})
        return pl.DataFrame(rows, schema_overrides={"answer": pl.Utf8})


TASKS: dict[str, Task] = {
    "arith": Task("arith", prompt=str, grade=is_correct, reference=plain_reference),
    "knowledge": Task(
        "knowledge", prompt=str, grade=knowledge_grade, reference=plain_reference, thinking=False, greedy=True
    ),
    "math": Task("math", prompt=math_prompt, grade=math_grade, reference=math_reference),
    # An instruct model that never thinks (Qwen3-4B-Instruct-2507): posed with thinking off, its answer
    # graded after the empty think block it is taken to have (`Task.turn`).
    "math_instruct": Task(
        "math_instruct", prompt=math_prompt, grade=math_grade, reference=math_reference, thinking=False
    ),
    "mcq_instruct": Task("mcq_instruct", prompt=mcq_prompt, grade=mcq_grade, reference=mcq_reference, thinking=False),
    "tooluse_instruct": Task(
        "tooluse_instruct", prompt=tooluse_prompt, grade=tooluse_grade, reference=tooluse_reference, thinking=False
    ),
    "code_instruct": Task(
        "code_instruct", prompt=code_prompt, grade=code_grade, reference=code_reference, thinking=False
    ),
    # The same for a thinking model: every grader reads the text after the last </think> either way.
    "mcq": Task("mcq", prompt=mcq_prompt, grade=mcq_grade, reference=mcq_reference),
    "tooluse": Task("tooluse", prompt=tooluse_prompt, grade=tooluse_grade, reference=tooluse_reference),
    "code": Task("code", prompt=code_prompt, grade=code_grade, reference=code_reference),
}
# The tiny world's problems name their operation; each is graded as arithmetic.
ALIASES = dict.fromkeys(OLD_TASKS + NEW_TASKS + CHAIN_TASKS, "arith")


def find_task(name: str) -> Task | None:
    """The task of that name (or of a tiny-world operation), None when there is none."""
    return TASKS.get(ALIASES.get(name, name))


def get_task(name: str) -> Task:
    """The task of that name (or of a tiny-world operation); unknown names are an error listing them."""
    task = find_task(name)
    if task is None:
        raise GraftlabError(
            f"unknown task {name!r}; known tasks: {sorted(TASKS)} (tiny-world operations {sorted(ALIASES)})"
        )
    return task
