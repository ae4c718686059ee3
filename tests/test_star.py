"""STaR on scripted samplers: only verified traces are stored, the hint never reaches a stored example,
sampling stops at a problem's first success, and K bounds the attempts."""

import json
import re
from collections import Counter

import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from graftlab.errors import GraftlabError
from graftlab.streams import stream_seed
from graftlab.synth import star
from graftlab.synth.star import StarConfig, star_traces
from graftlab.tasks import arith, chat_completion, is_correct
from graftlab.world.tokenizer import build_tokenizer

TOK = build_tokenizer()
PROBLEMS = pl.DataFrame(arith.sample_problems("mul", 6, "test", 0))
ANSWERS = dict(zip(PROBLEMS["prompt"], PROBLEMS["answer"]))


def user_turn(chat: str) -> str:
    return re.search(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", chat, re.S).group(1)


def right(user: str, thinking: str | None = None) -> str:
    problem = user.split("\n")[0]
    solved_thinking, answer = arith.solve("mul", problem)
    return chat_completion(thinking or solved_thinking, answer)


def wrong(user: str) -> str:
    return chat_completion("1*1=1", "0")  # no 2-digit x 1-digit product (operands >= 10 and >= 2) is 0


class Scripted:
    """A sampler whose k-th sample of a user turn is `policy(user_turn, k)`; it records every call."""

    def __init__(self, policy):
        self.policy, self.calls, self.seen = policy, [], Counter()

    def __call__(self, prompts, cfg):
        self.calls.append(([user_turn(p) for p in prompts], cfg))
        out = []
        for p in prompts:
            user, samples = user_turn(p), []
            for _ in range(cfg.n):
                samples.append(self.policy(user, self.seen[user]))
                self.seen[user] += 1
            out.append(samples)
        return out


# Problem i is first solved at attempt SOLVE_AT[i] (1-based); None: never.
SOLVE_AT = dict(zip(PROBLEMS["prompt"], [1, 3, 7, None, 2, None]))


def solves_at(user, k):
    at = SOLVE_AT[user]
    return right(user) if at is not None and k + 1 >= at else wrong(user)


def test_only_verified_traces_with_their_first_success_and_stats():
    sampler = Scripted(solves_at)
    traces, stats = star_traces(sampler, TOK, PROBLEMS, StarConfig(attempts=8, attempts_per_round=1))
    solved = {p: a for p, a in SOLVE_AT.items() if a is not None}
    assert dict(zip(traces["prompt"], traces["attempts"])) == solved
    assert all(is_correct(c, ANSWERS[p]) for p, c in zip(traces["prompt"], traces["completion"]))
    assert not traces["rationalized"].any()
    # Stopped at the first success: a solved problem was sampled exactly as often as its attempts;
    # an unsolved one exactly K times, never more.
    assert sampler.seen == Counter({p: a if a is not None else 8 for p, a in SOLVE_AT.items()})
    assert stats["solved"] == 4 and stats["solve_rate"] == pytest.approx(4 / 6)
    assert stats["attempts_mean"] == pytest.approx((1 + 3 + 7 + 2) / 4)
    assert stats["attempts_histogram"] == {"1": 1, "2": 1, "3": 1, "7": 1}
    assert stats["samples_drawn"] == sum(sampler.seen.values())


def test_a_task_grader_decides_what_is_verified():
    from graftlab.tasks import get_task

    boxed = {"What is 1/2 + 1/4?": "<think>\nquarters\n</think>\n\n\\boxed{0.75}<|im_end|>"}
    problems = pl.DataFrame({"id": ["m"], "prompt": list(boxed), "answer": ["\\frac{3}{4}"]})
    sampler = lambda prompts, cfg: [[boxed["What is 1/2 + 1/4?"]] * cfg.n for _ in prompts]  # noqa: E731
    with pytest.raises(GraftlabError, match="solved none"):  # exact match: 0.75 is not \frac{3}{4}
        star_traces(sampler, TOK, problems, StarConfig(attempts=2, attempts_per_round=2))
    traces, _ = star_traces(
        sampler, TOK, problems, StarConfig(attempts=2, attempts_per_round=2), get_task("math").grade
    )
    assert traces["attempts"].to_list() == [1]


def test_rounds_sample_only_open_problems_with_fresh_seeds_and_respect_k():
    sampler = Scripted(solves_at)
    _, stats = star_traces(sampler, TOK, PROBLEMS, StarConfig(attempts=5, attempts_per_round=2, seed=10))
    assert [cfg.n for _, cfg in sampler.calls] == [2, 2, 1]  # 5 attempts, never 6
    assert [cfg.seed for _, cfg in sampler.calls] == [stream_seed("star", 10, r) for r in range(3)]
    assert len(sampler.calls[0][0]) == 6
    # After round 1 the problems solved at attempts 1 and 2 are gone; after round 2, the one at 3.
    assert sorted(sampler.calls[1][0]) == sorted(p for p, a in SOLVE_AT.items() if a not in (1, 2))
    assert sorted(sampler.calls[2][0]) == sorted(p for p, a in SOLVE_AT.items() if a in (7, None))
    assert max(sampler.seen.values()) == 5
    # The problem solved at attempt 3 inside a round of 2 used 3 attempts though 4 were drawn.
    assert stats["attempts_histogram"] == {"1": 1, "2": 1, "3": 1}
    assert stats["samples_drawn"] == 6 * 2 + 4 * 2 + 3 * 1


def hint_only(user, k):
    return right(user) if "Hint" in user else wrong(user)


def test_nothing_solved_is_an_error_not_an_empty_file(tmp_path, monkeypatch):
    monkeypatch.setattr("graftlab.sampling.load_sampler", lambda *_: Scripted(hint_only))
    TOK.save_pretrained(tmp_path / "model")
    PROBLEMS.write_parquet(tmp_path / "train.parquet")
    out, stats_out = tmp_path / "star.parquet", tmp_path / "star.json"
    with pytest.raises(GraftlabError, match="solved none of 6 problems in 4 attempts"):
        star.write_star(tmp_path / "model", tmp_path / "train.parquet", StarConfig(attempts=4), out, stats_out)
    assert not out.exists() and not stats_out.exists()


def test_rationalization_stores_the_original_prompt_and_no_hint(tmp_path, monkeypatch):
    sampler = Scripted(hint_only)
    monkeypatch.setattr("graftlab.sampling.load_sampler", lambda *_: sampler)
    TOK.save_pretrained(tmp_path / "model")
    PROBLEMS.write_parquet(tmp_path / "train.parquet")
    cfg = StarConfig(attempts=3, attempts_per_round=2, rationalize=True)
    out, stats_out = tmp_path / "t.parquet", tmp_path / "t.json"
    stats = star.write_star(tmp_path / "model", tmp_path / "train.parquet", cfg, out, stats_out)
    traces = pl.read_parquet(out)
    assert traces["prompt"].to_list() == PROBLEMS["prompt"].to_list()
    assert traces["rationalized"].all()
    assert not any("hint" in c.lower() for c in traces["completion"])
    assert all(is_correct(c, ANSWERS[p]) for p, c in zip(traces["prompt"], traces["completion"]))
    # The hinted prompt was what the sampler saw, with the answer on its hint line.
    hinted = sampler.calls[-1][0]
    assert all(h == star.hint_prompt(p, ANSWERS[p]) for h, p in zip(hinted, PROBLEMS["prompt"]))
    assert json.loads(stats_out.read_text()) == stats
    assert stats["solved_by_rationalization"] == 6 and stats["solved_by_sampling"] == 0


def test_a_completion_that_mentions_the_hint_is_never_kept():
    # Under the hint, the first sample is correct but echoes the hint; the second is clean.
    def leaky_then_clean(user, k):
        if "Hint" not in user:
            return wrong(user)
        leak = user.split("\n")[1]  # "Hint: the answer is N."
        return right(user, thinking=leak) if k == 0 else right(user)  # k counts hinted samples

    sampler = Scripted(leaky_then_clean)
    traces, stats = star_traces(sampler, TOK, PROBLEMS, StarConfig(attempts=3, attempts_per_round=1, rationalize=True))
    assert traces.height == 6 and traces["attempts"].to_list() == [2] * 6
    assert not any("hint" in c.lower() for c in traces["completion"])
    assert stats["rationalization_samples_drawn"] == 12


def test_a_hint_echo_alone_is_never_kept():
    def always_leaks(user, k):
        return right(user, thinking=user.split("\n")[1]) if "Hint" in user else wrong(user)

    with pytest.raises(GraftlabError, match="nor by rationalization"):
        cfg = StarConfig(attempts=2, rationalize=True, rationalize_attempts=3)
        star_traces(Scripted(always_leaks), TOK, PROBLEMS, cfg)


def test_sampling_and_mixed_rationalization_count_apart():
    sampler = Scripted(lambda u, k: right(u) if "Hint" in u or SOLVE_AT[u] == 1 else wrong(u))
    traces, stats = star_traces(sampler, TOK, PROBLEMS, StarConfig(attempts=2, attempts_per_round=1, rationalize=True))
    by_prompt = dict(zip(traces["prompt"], traces["rationalized"]))
    assert by_prompt == {p: SOLVE_AT[p] != 1 for p in PROBLEMS["prompt"]}
    assert (stats["solved_by_sampling"], stats["solved_by_rationalization"], stats["unsolved"]) == (1, 5, 0)


def test_bad_config_and_bad_sampler_are_clear_errors():
    with pytest.raises(GraftlabError, match="temperature must be > 0"):
        StarConfig(temperature=0)
    with pytest.raises(GraftlabError, match="must be >= 1"):
        StarConfig(attempts=0)
    with pytest.raises(GraftlabError, match="sampler returned"):
        star_traces(lambda prompts, cfg: [[]] * len(prompts), TOK, PROBLEMS, StarConfig(attempts=2))
    with pytest.raises(GraftlabError, match="star problems holds no rows"):
        star_traces(Scripted(solves_at), TOK, PROBLEMS.clear(), StarConfig())
    with pytest.raises(GraftlabError, match=r"star problems lacks columns \[.answer.\]"):
        star_traces(Scripted(solves_at), TOK, PROBLEMS.drop("answer"), StarConfig())


def test_a_round_keeps_its_first_verified_sample_not_its_first_sample():
    """Rounds of 4: a problem's first verified sample may sit anywhere in a round, after wrong ones and
    before other verified ones; that one is kept, with its position as the attempts used."""
    first_right = dict(zip(PROBLEMS["prompt"], [0, 1, 2, 3, 5, None]))  # 0-based sample of the first success

    def policy(user, k):
        at = first_right[user]
        if at is None or k < at:
            return wrong(user)
        # Every sample from the first success on verifies; each says which sample it was.
        return right(user, thinking=f"sample {k}")

    traces, stats = star_traces(Scripted(policy), TOK, PROBLEMS, StarConfig(attempts=8, attempts_per_round=4))
    solved = {p: at for p, at in first_right.items() if at is not None}
    got = dict(zip(traces["prompt"], zip(traces["completion"], traces["attempts"])))
    assert got == {p: (right(p, thinking=f"sample {at}"), at + 1) for p, at in solved.items()}
    assert stats["attempts_histogram"] == {"1": 1, "2": 1, "3": 1, "4": 1, "6": 1}


OUTCOMES = st.lists(st.sampled_from(["right", "wrong", "leak"]), min_size=1, max_size=4)


@given(plans=st.lists(OUTCOMES, min_size=len(PROBLEMS), max_size=len(PROBLEMS)), per_round=st.integers(1, 3))
@settings(max_examples=40, deadline=None)
def test_rationalization_keeps_a_problems_first_hinted_sample_that_verifies_and_never_leaks(plans, per_round):
    """Whatever the hinted samples are (right, wrong, or right but echoing the hint), a problem's kept
    completion is its first right one and its attempts count the hinted samples up to it; a problem with
    none stays unsolved. Unhinted samples are all wrong here, so every trace is rationalized."""
    plan = dict(zip(PROBLEMS["prompt"], plans))

    def policy(user, k):
        if "Hint" not in user:
            return wrong(user)
        problem = user.split("\n")[0]
        outcome = plan[problem][k] if k < len(plan[problem]) else "wrong"
        return {"right": right(user), "wrong": wrong(user), "leak": right(user, thinking=user.split("\n")[1])}[outcome]

    rounds = max(map(len, plans))
    cfg = StarConfig(attempts=1, attempts_per_round=per_round, rationalize=True, rationalize_attempts=rounds)
    first = {p: outcomes.index("right") for p, outcomes in plan.items() if "right" in outcomes}
    if not first:
        with pytest.raises(GraftlabError, match="nor by rationalization"):
            star_traces(Scripted(policy), TOK, PROBLEMS, cfg)
        return
    traces, stats = star_traces(Scripted(policy), TOK, PROBLEMS, cfg)
    assert sorted(traces["prompt"]) == sorted(first) and traces["rationalized"].all()
    for p, c, attempts in zip(traces["prompt"], traces["completion"], traces["attempts"]):
        assert c == right(star.hint_prompt(p, ANSWERS[p])) and attempts == first[p] + 1
    assert stats["solved_by_rationalization"] == len(first) and stats["unsolved"] == len(plan) - len(first)
