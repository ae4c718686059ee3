"""Exact-match graders: the tiny world's arithmetic (the answer text as written) and the knowledge
world's QA (forgiving only case, spacing and a final full stop)."""

from graftlab.tasks.chat import extract_answer


def is_correct(completion: str, answer: str) -> bool:
    """The text after the thinking equals the reference exactly."""
    return extract_answer(completion) == answer.strip()


def normalise(text: str) -> str:
    """Exact match of knowledge answers forgives only surface form: case, spacing and a final full stop."""
    return " ".join(text.split()).removesuffix(".").strip().casefold()


def knowledge_grade(completion: str, answer: str) -> bool:
    """Exact match of the text after the thinking of a whole assistant turn (think block included)."""
    predicted = extract_answer(completion)
    return predicted is not None and normalise(predicted) == normalise(answer)


def plain_reference(raw: str) -> str | None:
    text = raw.strip()
    return text or None
