"""The chat format every task shares: the user turn, the assistant header, `<think>` tags and the final
answer after the last `</think>` (Qwen3's thinking mode)."""

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# The text Qwen3's template pre-fills with `enable_thinking=False`: an answer without thinking.
EMPTY_THINK = f"{THINK_OPEN}\n\n{THINK_CLOSE}\n\n"


def chat_prompt(tokenizer, prompt: str, thinking: bool = True) -> str:
    """The user turn plus the assistant header, ready for the model to continue; without `thinking`, with
    the empty think block pre-filled (which the completion then does not contain)."""
    options = {} if thinking else {"enable_thinking": False}
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True, **options
    )


def chat_completion(thinking: str, answer: str) -> str:
    """The assistant turn the model should produce for a solved problem, end-of-turn included."""
    return f"{THINK_OPEN}\n{thinking}\n{THINK_CLOSE}\n\n{answer}<|im_end|>"


def extract_answer(completion: str) -> str | None:
    """Final answer after the thinking; None when the model never closed its thinking."""
    if THINK_CLOSE not in completion:
        return None
    return completion.rsplit(THINK_CLOSE, 1)[1].replace("<|im_end|>", "").strip()


def extract_thinking(completion: str) -> str | None:
    """The thinking: text after the first `<think>`, up to the last `</think>` or to the end when the
    model never closed it (its procedure shows either way); None without a `<think>`."""
    start = completion.find(THINK_OPEN)
    if start < 0:
        return None
    end = completion.rfind(THINK_CLOSE)
    return completion[start + len(THINK_OPEN) : end if end > start else None]
