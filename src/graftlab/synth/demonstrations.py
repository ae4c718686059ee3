"""OPSD's examples: each problem with the demonstration its teacher reads before the student's response
(docs/methods.md#opsd). A trace is its own problem's demonstration; a knowledge question's is the article of
its person, so the teacher reads the fact, not the answer drilled in one phrasing."""

from graftlab.errors import GraftlabError
from graftlab.tasks import THINK_CLOSE, THINK_OPEN


def demonstration(completion: str) -> str:
    """A trace as plain text for a user turn: the thinking, then the final answer; the chat markers
    (special tokens of the trace's own turn) dropped."""
    text = completion.replace("<|im_end|>", "")
    if THINK_CLOSE in text:
        thinking, answer = text.rsplit(THINK_CLOSE, 1)
        text = f"{thinking.replace(THINK_OPEN, '').strip()}\nAnswer: {answer.strip()}"
    return text.strip()


def opsd_examples(traces, facts=None) -> list[dict]:
    """OPSD's problems and demonstrations from a setting's SFT data (`prompt`, `completion`): each
    trace is its problem's demonstration; a knowledge question's is instead the wiki-style article of
    its person (`facts`: the knowledge world's facts frame), so the teacher reads the fact, not the answer
    drilled in one phrasing."""
    from graftlab.world.knowledge import TASK, articles

    pages = articles(facts) if facts is not None else {}
    entity_of = dict(zip(facts["fact"], facts["entity"])) if facts is not None else {}
    out = []
    for row in traces.iter_rows(named=True):
        if row.get("task") == TASK:
            if row.get("fact") not in entity_of:
                raise GraftlabError(f"OPSD: knowledge question {row['id']} names no fact of the facts file")
            demo = pages[entity_of[row["fact"]]]
        else:
            demo = demonstration(row["completion"])
        out.append({"prompt": row["prompt"], "demonstration": demo})
    return out
