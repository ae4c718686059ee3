"""Problems, chat formatting and grading, shared by every stage that samples or trains.

A problem is a dict with `id`, `task`, `prompt` and `answer` (plus `thinking` where an expert trace is
known). Completions are graded on the text after the last `</think>`, as with Qwen3's thinking mode.
"""

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def chat_prompt(tokenizer, prompt: str) -> str:
    """The user turn plus the assistant header, ready for the model to continue."""
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )


def chat_completion(thinking: str, answer: str) -> str:
    """The assistant turn the model should produce for a solved problem, end-of-turn included."""
    return f"{THINK_OPEN}\n{thinking}\n{THINK_CLOSE}\n\n{answer}<|im_end|>"


def extract_answer(completion: str) -> str | None:
    """Final answer after the thinking; None when the model never closed its thinking."""
    if THINK_CLOSE not in completion:
        return None
    return completion.rsplit(THINK_CLOSE, 1)[1].replace("<|im_end|>", "").strip()


def is_correct(completion: str, answer: str) -> bool:
    return extract_answer(completion) == answer.strip()
