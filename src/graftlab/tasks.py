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


def extract_thinking(completion: str) -> str | None:
    """The thinking: text after the first `<think>`, up to the last `</think>` or to the end when the
    model never closed it (its procedure shows either way); None without a `<think>`."""
    start = completion.find(THINK_OPEN)
    if start < 0:
        return None
    end = completion.rfind(THINK_CLOSE)
    return completion[start + len(THINK_OPEN) : end if end > start else None]


def is_correct(completion: str, answer: str) -> bool:
    return extract_answer(completion) == answer.strip()


def sample_and_grade(sampler, tokenizer, problems, cfg, grade=None):
    """Sample every problem (a frame with `id`, `prompt`, `answer`) and grade each completion: one row
    per sample with `problem_id`, `sample`, `completion`, the parsed `answer` and `correct`. `grade`
    (completion, answer) -> bool defaults to the tiny world's exact match; real tasks pass theirs
    (`graftlab.tasks_registry.get_task(name).grade`)."""
    import polars as pl

    grade = grade or is_correct
    completions = sampler([chat_prompt(tokenizer, p) for p in problems["prompt"]], cfg)
    rows = [
        {"problem_id": pid, "sample": i, "completion": c, "answer": extract_answer(c), "correct": grade(c, ref)}
        for pid, ref, cs in zip(problems["id"], problems["answer"], completions)
        for i, c in enumerate(cs)
    ]
    return pl.DataFrame(rows, schema_overrides={"answer": pl.Utf8})
