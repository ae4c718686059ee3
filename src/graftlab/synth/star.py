"""STaR (rejection sampling): the model's own verified traces on the mined training problems.

Up to K attempts per problem (paper: K = 32), stopping at the first completion whose answer equals the
reference; one trace kept per solved problem. Sampling runs in rounds over the problems still unsolved,
`attempts_per_round` samples each, so one sampler call serves every open problem at once. A problem's
attempts used is the position of its first verified sample; samples drawn after it in the same round are
wasted compute and counted apart (`samples_drawn`).

Rationalization (optional): a problem still unsolved after K attempts is asked again with its answer as a
hint (`HINT_TEMPLATE`, a line after the prompt). "Never leaks the hint" means two checks on what is
stored: the stored prompt is the problem's original prompt, never the hinted one; and a rationalized
completion is kept only if it verifies and does not mention the hint (no `HINT_MARKER`, case-insensitive)
— the answer itself necessarily appears, as in any correct completion. A rationalized trace's `attempts`
counts its hinted attempts.
"""

from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import polars as pl

from graftlab.errors import GraftlabError
from graftlab.io.atomic import write_table_with_stats
from graftlab.io.tables import PROBLEM_COLUMNS, read_table, require_columns
from graftlab.sampling import SamplingConfig
from graftlab.schema import schema_default
from graftlab.streams import stream_seed
from graftlab.tasks import chat_prompt, is_correct

Grader = Callable[[str, str], bool]  # (completion, answer) -> correct
HINT_MARKER = "Hint"
HINT_TEMPLATE = "{prompt}\nHint: the answer is {answer}."


@dataclass(frozen=True)
class StarConfig:
    """Defaults are the schema's `star` section (`graftlab.schema`); `top_p` and `seed` are not in it."""

    attempts: int = schema_default("star", "attempts")  # K
    attempts_per_round: int = schema_default("star", "attempts_per_round")
    temperature: float = schema_default("star", "temperature")
    top_p: float = 1.0
    max_new_tokens: int = schema_default("star", "max_new_tokens")
    rationalize: bool = schema_default("star", "rationalize")
    rationalize_attempts: int = schema_default("star", "rationalize_attempts")  # with the hint, after K
    seed: int = 0

    def __post_init__(self):
        if self.attempts < 1 or self.attempts_per_round < 1 or self.rationalize_attempts < 1:
            raise GraftlabError("star: attempts, attempts_per_round and rationalize_attempts must be >= 1")
        if self.temperature <= 0:
            raise GraftlabError(
                f"star.temperature must be > 0 (got {self.temperature}): greedy repeats one attempt K times"
            )


@dataclass(frozen=True)
class Found:
    """The first verified sample of a problem: its completion and its 1-based attempt number."""

    completion: str
    attempt: int


def first_verified(
    sampler,
    prompts: list[str],
    accept: Callable[[int, str], bool],
    attempts: int,
    per_round: int,
    scfg: SamplingConfig,
    purpose: str,
) -> tuple[dict[int, Found], int]:
    """Sample the chat-formatted `prompts` in rounds until each has a completion `accept(i, completion)`
    takes or has used `attempts`; returns ({prompt index: Found}, samples drawn in all). Round r samples
    with the seed of stream (`purpose`, `scfg.seed`, r)."""
    found: dict[int, Found] = {}
    used, drawn = 0, 0
    for round_no in range((attempts + per_round - 1) // per_round):
        open_ = [i for i in range(len(prompts)) if i not in found]
        n = min(per_round, attempts - used)
        if not open_ or n <= 0:
            break
        # A fresh seed per round: the same seed would redraw the same samples for the same prompts.
        seed = stream_seed(purpose, scfg.seed, round_no)
        outs = sampler([prompts[i] for i in open_], replace(scfg, n=n, seed=seed))
        if len(outs) != len(open_) or any(len(cs) != n for cs in outs):
            got = [len(cs) for cs in outs]
            raise GraftlabError(f"sampler returned {got} completions for {len(open_)} prompts x {n}")
        drawn += n * len(open_)
        for i, completions in zip(open_, outs):
            hit = next((k for k, c in enumerate(completions) if accept(i, c)), None)
            if hit is not None:
                found[i] = Found(completions[hit], used + hit + 1)
        used += n
    return found, drawn


def require_problems(problems: pl.DataFrame, stage: str) -> list[dict]:
    """The problems as rows; a clear error when there are none or a required column is missing."""
    return require_columns(problems, PROBLEM_COLUMNS, f"{stage} problems").to_dicts()


def hint_prompt(prompt: str, answer: str) -> str:
    return HINT_TEMPLATE.format(prompt=prompt, answer=answer)


def mentions_hint(completion: str) -> bool:
    return HINT_MARKER.lower() in completion.lower()


def star_traces(
    sampler, tokenizer, problems: pl.DataFrame, cfg: StarConfig, grade: Grader = is_correct
) -> tuple[pl.DataFrame, dict]:
    """(traces, stats): one verified trace per solved problem, with the problem's original prompt;
    `grade(completion, answer)` verifies (the tiny world's exact match by default)."""
    rows = require_problems(problems, "star")
    answers = [str(r["answer"]) for r in rows]
    scfg = SamplingConfig(1, cfg.temperature, cfg.top_p, cfg.max_new_tokens, cfg.seed)
    prompts = [chat_prompt(tokenizer, r["prompt"]) for r in rows]
    found, drawn = first_verified(
        sampler, prompts, lambda i, c: grade(c, answers[i]), cfg.attempts, cfg.attempts_per_round, scfg, "star"
    )
    rationalized, r_drawn = (
        _rationalize(sampler, tokenizer, rows, found, cfg, scfg, grade) if cfg.rationalize else ({}, 0)
    )
    traces = [
        {
            "id": r["id"],
            "task": r.get("task"),
            "prompt": r["prompt"],
            "completion": f.completion,
            "attempts": f.attempt,
            "rationalized": i in rationalized,
        }
        for i, r in enumerate(rows)
        if (f := found.get(i) or rationalized.get(i)) is not None
    ]
    stats = star_stats(len(rows), found, rationalized, drawn, r_drawn, cfg)
    if not traces:
        raise GraftlabError(
            f"star solved none of {len(rows)} problems in {cfg.attempts} attempts"
            f"{' nor by rationalization' if cfg.rationalize else ''}: no traces to train on"
        )
    return pl.DataFrame(traces), stats


def _rationalize(
    sampler, tokenizer, rows, found, cfg: StarConfig, scfg: SamplingConfig, grade: Grader
) -> tuple[dict, int]:
    """The unsolved problems asked again with the answer as a hint; keyed by index into `rows`."""
    unsolved = [i for i in range(len(rows)) if i not in found]
    prompts = [chat_prompt(tokenizer, hint_prompt(rows[i]["prompt"], str(rows[i]["answer"]))) for i in unsolved]

    def accept(j: int, completion: str) -> bool:
        return grade(completion, str(rows[unsolved[j]]["answer"])) and not mentions_hint(completion)

    # A stream of its own, so the hinted rounds draw fresh noise.
    hits, drawn = first_verified(
        sampler, prompts, accept, cfg.rationalize_attempts, cfg.attempts_per_round, scfg, "star-rationalize"
    )
    return {unsolved[j]: f for j, f in hits.items()}, drawn


def star_stats(problems: int, found: dict, rationalized: dict, drawn: int, r_drawn: int, cfg: StarConfig) -> dict:
    attempts = [f.attempt for f in found.values()]
    solved = len(found) + len(rationalized)
    return {
        "problems": problems,
        "solved": solved,
        "solve_rate": solved / problems,
        "traces": solved,  # the keys every data stage reports (data/sft.json): problems, traces, skipped
        "skipped": problems - solved,
        "solved_by_sampling": len(found),
        "solved_by_rationalization": len(rationalized),
        "unsolved": problems - solved,
        "attempts_mean": sum(attempts) / len(attempts) if attempts else None,
        "attempts_histogram": {str(k): v for k, v in sorted(Counter(attempts).items())},
        "samples_drawn": drawn,
        "rationalization_samples_drawn": r_drawn,
        "config": asdict(cfg),
    }


def write_star(
    model_dir, problems, cfg: StarConfig, out, stats_out, backend: str = "auto", task: str = "arith"
) -> dict:
    """Sample the model at `model_dir` on the training problems parquet, verifying with the grader of
    registry task `task`; write the stats JSON, then the traces parquet. Nothing is written when no
    problem is solved."""
    from transformers import AutoTokenizer

    from graftlab.sampling import load_sampler, sampling_record
    from graftlab.tasks import get_task

    sampler = load_sampler(model_dir, backend)
    traces, stats = star_traces(
        sampler,
        AutoTokenizer.from_pretrained(model_dir),
        read_table(problems, PROBLEM_COLUMNS, "star problems", text=("prompt",)),
        cfg,
        get_task(task).grade,
    )
    stats["sampling"] = sampling_record(sampler)
    print(
        f"star: solved {stats['solved']} of {stats['problems']} ({stats['solved_by_rationalization']} by "
        f"rationalization); mean attempts {stats['attempts_mean']}"
    )
    write_table_with_stats(traces, stats, out, stats_out)
    return stats
