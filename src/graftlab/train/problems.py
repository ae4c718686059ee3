"""The problems the on-policy RL trainers (GRPO, SDPO) roll out: a setting's SFT data, one entry per distinct
prompt, each with the reference its task's verifier grades against.

The SFT data (`results/{exp}/data/sft.parquet`: `task`, `prompt`, `completion`, and for knowledge `answer`)
holds verified traces; a row without an `answer` takes the reference from its trace's final answer, read
as its task reads a data set's answer cell. STaR may keep several traces of one problem: the first stands.
"""

from __future__ import annotations

from graftlab.errors import GraftlabError
from graftlab.tasks import extract_answer, get_task


def rl_problems(frame) -> list[dict]:
    """[{prompt, answer, task}] from an SFT data frame, distinct prompts in first-seen order."""
    missing = [c for c in ("task", "prompt", "completion") if c not in frame.columns]
    if missing:
        raise GraftlabError(f"RL problems: the SFT data lacks column(s) {missing}")
    out: dict[str, dict] = {}
    for i, row in enumerate(frame.iter_rows(named=True)):
        if row["prompt"] in out:
            continue
        task = get_task(row["task"])
        raw = row.get("answer") or extract_answer(row["completion"] or "")
        answer = task.reference(raw) if raw else None
        if answer is None:
            raise GraftlabError(f"RL problems: row {i} ({row.get('id', row['prompt'])!r}) has no gradable answer")
        out[row["prompt"]] = {"prompt": row["prompt"], "answer": answer, "task": row["task"]}
    if not out:
        raise GraftlabError("RL problems: the SFT data has no rows")
    return list(out.values())
