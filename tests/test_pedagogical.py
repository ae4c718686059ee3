"""Pedagogical RL's reward against hand computations on a pico world model: surprise gaps from a plain
forward pass, the soft maximum from its formula, correctness gating the reward, GRPO advantages, and the
teacher trained by TRL's GRPOTrainer with its reward components logged per step; and the guard that
gives a near-empty trace no reward however correct and predictable it is."""

import json
import math
import re
import statistics

import polars as pl
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graftlab.errors import GraftlabError
from graftlab.synth import pedagogical as ped
from graftlab.synth.star import StarConfig
from graftlab.tasks import arith, chat_completion, chat_prompt
from graftlab.world import build
from graftlab.world.tokenizer import build_tokenizer

TOK = build_tokenizer()
ARCH = dict(hidden_size=16, intermediate_size=32, layers=1, heads=2, kv_heads=1, max_positions=128)
PROBLEMS = arith.sample_problems("mul", 4, "test", 0)


@pytest.fixture(scope="module")
def student():
    model = build.init_model(TOK, ARCH, seed=0)
    with torch.no_grad():
        # Larger weights than the initialisation's: peaked distributions, so the gaps spread widely.
        for p in model.parameters():
            p.add_(0.5 * torch.randn_like(p))
    return model.eval()


def pairs() -> tuple[list[str], list[str], list[str]]:
    """Problems, answers and completions of different lengths, two correct and two wrong; the second
    correct one thinks nothing, so it is not well formed."""
    prompts = [p["prompt"] for p in PROBLEMS]
    answers = [p["answer"] for p in PROBLEMS]
    completions = [
        chat_completion(PROBLEMS[0]["thinking"], PROBLEMS[0]["answer"]),
        chat_completion("", PROBLEMS[1]["answer"]),
        chat_completion(PROBLEMS[2]["thinking"], "7"),
        "no thinking at all",
    ]
    return prompts, answers, completions


def hand_gaps(student, prompt: str, completion: str) -> list[float]:
    """d_t from one unpadded forward pass, token by token."""
    p = TOK(chat_prompt(TOK, prompt), add_special_tokens=False)["input_ids"]
    c = TOK(completion, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logits = student(input_ids=torch.tensor([p + c])).logits[0].double()
    gaps = []
    for t, y in enumerate(c):
        z = logits[len(p) - 1 + t].tolist()
        log_norm = math.log(sum(math.exp(v) for v in z))
        gaps.append((max(z) - log_norm) - (z[y] - log_norm))
    return gaps


def hand_soft_gap(d: list[float], beta: float) -> float:
    return math.log(sum(math.exp(beta * x) for x in d) / len(d)) / beta


def test_batched_gaps_equal_a_plain_forward_pass_per_pair(student):
    prompts, _, completions = pairs()
    gaps = ped.surprise_gaps(student, TOK, prompts, completions, batch_size=3)
    for d, p, c in zip(gaps, prompts, completions):
        expected = hand_gaps(student, p, c)
        assert len(d) == len(TOK(c, add_special_tokens=False)["input_ids"])
        assert d.tolist() == pytest.approx(expected, abs=1e-5)
    assert all((d >= 0).all() for d in gaps) and any((d > 0.1).any() for d in gaps)


def test_reward_equals_the_hand_computation(student):
    prompts, answers, completions = pairs()
    cfg = ped.RewardConfig(beta=2.0, strength=0.7)
    rows = ped.pedagogical_reward(student, TOK, prompts, answers, completions, cfg)
    assert [r["correct"] for r in rows] == [True, True, False, False]
    assert [r["well_formed"] for r in rows] == [True, False, True, False]
    for r, p, c in zip(rows, prompts, completions):
        d = hand_gaps(student, p, c)
        soft = hand_soft_gap(d, 2.0)
        assert r["gap_mean"] == pytest.approx(sum(d) / len(d), abs=1e-5)
        assert r["gap_max"] == pytest.approx(max(d), abs=1e-5)
        assert r["soft_gap"] == pytest.approx(soft, abs=1e-5)
        assert r["learnability"] == pytest.approx(math.exp(-0.7 * soft), rel=1e-5)
        assert r["reward"] == (r["learnability"] if r["correct"] and r["well_formed"] else 0.0)
    assert set(rows[0]) == set(ped.COMPONENTS)


def test_soft_gap_moves_from_the_mean_to_the_largest_gap_as_beta_grows(student):
    prompts, _, completions = pairs()
    d = ped.surprise_gaps(student, TOK, prompts[:1], completions[:1])[0]
    mean, largest = d.double().mean().item(), d.max().item()
    assert mean < largest - 0.1
    assert ped.soft_max_gap(d, 0.0) == mean  # beta = 0 is the mean, exactly
    assert ped.soft_max_gap(d, 1e-6) == pytest.approx(mean, abs=1e-5)
    betas = [0.0, 0.01, 0.1, 0.5, 1.0, 2.0, 5.0, 20.0, 100.0, 1e4]
    soft = [ped.soft_max_gap(d, b) for b in betas]
    assert all(a < b for a, b in zip(soft, soft[1:]))
    # log(mean exp) lies within log(T)/beta below the maximum; 1e4 * d overflows a plain exp, not logsumexp.
    assert largest - math.log(len(d)) / 1e4 <= soft[-1] <= largest + 1e-9
    assert ped.soft_max_gap(d, math.inf) == largest
    learn = [ped.learnability(s, 1.0) for s in soft]
    assert all(a > b for a, b in zip(learn, learn[1:]))


def test_wrong_answers_get_zero_reward_whatever_their_learnability():
    gaps = [torch.zeros(5), torch.tensor([0.0, 3.0])]
    texts = [chat_completion("3*4=12", "12")] * 2
    rows = ped.reward_components(gaps, [False, True], ped.RewardConfig(1.0, 1.0, min_tokens=2), completions=texts)
    assert rows[0]["learnability"] == 1.0 and rows[0]["reward"] == 0.0
    assert rows[1]["reward"] == pytest.approx(math.exp(-math.log((1 + math.exp(3.0)) / 2)))
    empty = ped.reward_components([torch.zeros(0)], [False], ped.RewardConfig(), completions=[""])
    assert empty[0]["reward"] == 0.0
    with pytest.raises(GraftlabError, match="beta >= 0"):
        ped.RewardConfig(beta=-1.0)


def test_a_short_correct_trace_earns_nothing_and_a_genuine_one_is_untouched(student):
    p = PROBLEMS[0]
    genuine = chat_completion(p["thinking"], p["answer"])
    # `<think>\n\n</think>\n\n{answer}<|im_end|>`: the hack; then one character of thinking.
    completions = [chat_completion("", p["answer"]), chat_completion("x", p["answer"]), genuine]
    cfg = ped.RewardConfig(beta=2.0, strength=0.7, min_tokens=20)
    rows = ped.pedagogical_reward(student, TOK, [p["prompt"]] * 3, [p["answer"]] * 3, completions, cfg)
    assert [r["correct"] for r in rows] == [True, True, True]
    # Empty thinking fails whatever the count; one character of thinking passes that check but not 20 tokens.
    assert [r["well_formed"] for r in rows] == [False, False, True]
    assert rows[0]["reward"] == rows[1]["reward"] == 0.0
    assert rows[0]["learnability"] > 0 and rows[1]["tokens"] < 20 <= rows[2]["tokens"]
    soft = hand_soft_gap(hand_gaps(student, p["prompt"], genuine), 2.0)
    assert rows[2]["reward"] == pytest.approx(math.exp(-0.7 * soft), rel=1e-5)
    # The default never rejects a genuine trace of the world: the shortest (compare) is 11 tokens.
    shortest = chat_completion(*arith.solve("compare", "compare 00 00"))
    assert len(TOK(shortest, add_special_tokens=False)["input_ids"]) == 11 >= ped.RewardConfig().min_tokens
    with pytest.raises(GraftlabError, match="min_tokens >= 0"):
        ped.RewardConfig(min_tokens=-1)


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("<think>\n3*4=12\n</think>\n\n12<|im_end|>", True),
        ("<think>\n \n</think>\n\n12<|im_end|>", False),  # whitespace is not thinking
        ("<think></think><think>\n</think>12", False),  # nor are think tags
        ("<think>\n3*4=12\n\n12<|im_end|>", False),  # never closed: no answer either
        ("3*4=12\n</think>\n\n12", False),  # never opened
        ("12", False),
    ],
)
def test_well_formed_needs_a_thinking_block_with_something_in_it(completion, expected):
    assert ped.well_formed(completion, tokens=100, min_tokens=8) is expected
    assert ped.well_formed(completion, tokens=7, min_tokens=8) is False


def test_group_advantages_normalise_within_each_group():
    rewards = [0.0, 1.0, 0.5, 0.5, 0.2, 0.2, 0.2, 0.2]
    adv = ped.group_advantages(rewards, group_size=4).tolist()
    first = rewards[:4]
    mu, sd = statistics.mean(first), statistics.stdev(first)
    assert adv[:4] == pytest.approx([(r - mu) / (sd + 1e-4) for r in first])
    assert adv[4:] == [0.0] * 4  # a group that all scored alike teaches nothing
    with pytest.raises(GraftlabError, match="groups of >= 2"):
        ped.group_advantages(rewards, group_size=3)


def test_teacher_prompt_shows_the_solution_not_the_thinking_in_tokenizer_characters():
    p = dict(PROBLEMS[0])
    text = ped.teacher_prompt(p["prompt"], ped.reference_solution(p))
    assert p["prompt"] in text and p["answer"] in text and p["thinking"] not in text
    assert "yourself" in text
    assert TOK.decode(TOK(text, add_special_tokens=False)["input_ids"]) == text  # no unknown characters
    assert ped.reference_solution({**p, "solution": "8*7=56; 5*7=35+5=40"}) == "8*7=56; 5*7=35+5=40"


@settings(max_examples=40, deadline=None)
@given(*[st.text(max_size=30)] * 3, st.sampled_from(["both", "problem", "solution"]))
def test_a_teacher_template_is_taken_with_both_placeholders_and_refused_by_name_without(head, mid, tail, holds):
    """Any text around the placeholders, braces included: with both the prompt is the template with the
    problem and the solution in their places; without one, the config names the key and what it lacks."""
    from graftlab.planning.config import ConfigError, resolve

    problem, solution = "{problem}", "{solution}"
    parts = {"both": (problem, solution), "problem": (problem, ""), "solution": ("", solution)}[holds]
    template = head + parts[0] + mid + parts[1] + tail
    config = {"experiments": {"x": {"data": "pedagogical", "pedagogical": {"template": template}}}}
    lacks = [p for p in ("{problem}", "{solution}") if p not in template]
    if lacks:
        with pytest.raises(ConfigError, match=r"experiments\.x\.pedagogical\.template: lacks the placeholder"):
            resolve(config)
        return
    assert resolve(config)["experiments"]["x"]["pedagogical"]["template"] == template
    # Values with braces of their own, as LaTeX problems hold: each placeholder filled in one pass.
    values = {"{problem}": "x^{2} = {solution}?", "{solution}": "\\boxed{5}"}
    expected = re.sub(r"\{problem\}|\{solution\}", lambda m: values[m.group()], template)
    assert ped.teacher_prompt(values["{problem}"], values["{solution}"], template) == expected


def test_the_teacher_is_trained_and_sampled_on_the_configured_template():
    template = "Answer: {solution}\n{problem}"
    rows = ped.teacher_dataset(TOK, pl.DataFrame(PROBLEMS), template).to_list()
    wanted = [chat_prompt(TOK, f"Answer: {p['answer']}\n{p['prompt']}") for p in PROBLEMS]
    assert [r["prompt"] for r in rows] == wanted
    seen = []

    def sampler(prompts, cfg):  # the expert's trace of the problem, the user turn's last line
        seen.extend(prompts)
        problems = [p.split("<|im_end|>")[0].split("\n")[-1] for p in prompts]
        return [[chat_completion(*arith.solve("mul", problem))] * cfg.n for problem in problems]

    traces, _ = ped.teacher_traces(sampler, TOK, pl.DataFrame(PROBLEMS), StarConfig(attempts=1), template=template)
    assert seen == wanted and traces["prompt"].to_list() == [p["prompt"] for p in PROBLEMS]


def test_grpo_dataset_gives_the_teacher_the_solution_and_the_student_the_problem_alone():
    rows = ped.teacher_dataset(TOK, pl.DataFrame(PROBLEMS)).to_list()
    for row, p in zip(rows, PROBLEMS):
        assert row["prompt"] == chat_prompt(TOK, ped.teacher_prompt(p["prompt"], p["answer"]))
        assert row["student_prompt"] == chat_prompt(TOK, p["prompt"]) and row["answer"] == p["answer"]
        assert "Reference" not in row["student_prompt"]
    with pytest.raises(GraftlabError, match=r"pedagogical RL problems lacks columns \[.answer.\]"):
        ped.teacher_dataset(TOK, pl.DataFrame(PROBLEMS).drop("answer"))


def test_reward_func_for_trl_reads_exact_ids_and_logs_every_component(student):
    prompts, answers, completions = pairs()
    ids = [TOK(c, add_special_tokens=False)["input_ids"] for c in completions]
    logged = {}
    func = ped.make_reward_func(student, TOK, ped.RewardConfig())
    # TRL's own `completions` have the special tokens stripped; the reward must not grade those.
    stripped = TOK.batch_decode(ids, skip_special_tokens=True)
    rewards = func(
        prompts=None,
        completions=stripped,
        completion_ids=ids,
        answer=answers,
        student_prompt=[chat_prompt(TOK, p) for p in prompts],
        log_metric=logged.__setitem__,
    )
    expected = ped.pedagogical_reward(student, TOK, prompts, answers, completions, ped.RewardConfig())
    assert rewards == pytest.approx([r["reward"] for r in expected], abs=1e-6)
    assert rewards[0] > 0 and rewards[2] == 0.0
    assert set(logged) == {f"pedagogical/{k}" for k in ped.COMPONENTS}
    assert logged["pedagogical/correct"] == 0.5 and logged["pedagogical/well_formed"] == 0.5


@pytest.mark.parametrize(
    "scale, line",
    [
        ({}, "batch: 4 = 4 x 1 accumulated"),
        # A step's 4 completions as 2 micro-batches of 2, each layer recomputed in the backward pass.
        ({"micro_batch_size": 2, "gradient_checkpointing": True}, "batch: 4 = 2 x 2 accumulated"),
    ],
    ids=["one-pass", "micro-batches"],
)
def test_train_teacher_with_trl_grpo_logs_components_per_step(student, tmp_path, monkeypatch, capfd, scale, line):
    # A random pico model is never correct nor well formed, so every reward would be 0 and GRPO would not
    # move: pass both checks, leaving learnability to vary within groups and drive the update.
    import graftlab.tasks as tasks

    always = tasks.Task("always", prompt=str, grade=lambda completion, answer: True, reference=str)
    monkeypatch.setattr(tasks, "get_task", lambda name: always)
    monkeypatch.setattr(ped, "well_formed", lambda completion, tokens, min_tokens: True)
    student.save_pretrained(tmp_path / "post")
    TOK.save_pretrained(tmp_path / "post")
    pl.DataFrame(PROBLEMS).write_parquet(tmp_path / "train.parquet")
    cfg = ped.TeacherConfig(group_size=2, prompts_per_step=2, steps=2, lr=1e-3, max_new_tokens=8, **scale)
    ped.train_teacher(tmp_path / "post", tmp_path / "train.parquet", cfg, tmp_path / "teacher", tmp_path / "log.jsonl")
    assert line in capfd.readouterr().out
    steps = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    assert all(f"pedagogical/{k}" in s for s in steps for k in ped.COMPONENTS)
    assert all(s["pedagogical/correct"] == 1.0 and 0 < s["pedagogical/reward"] <= 1 for s in steps)
    files = {f.name for f in (tmp_path / "teacher").iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", "graftlab.json"} <= files
    assert not any(name.startswith(".") for name in files)
    assert json.loads((tmp_path / "teacher/graftlab.json").read_text())["save_dtype"] == "float32"
    before = student.state_dict()["model.layers.0.mlp.down_proj.weight"]
    from transformers import AutoModelForCausalLM

    teacher = AutoModelForCausalLM.from_pretrained(tmp_path / "teacher")
    after = teacher.state_dict()["model.layers.0.mlp.down_proj.weight"]
    assert not torch.equal(before, after)  # GRPO moved the teacher away from the post model


def test_teacher_traces_keep_the_problem_prompt_and_drop_reference_mentions():
    problems = pl.DataFrame(PROBLEMS)

    def sampler(prompts, cfg):
        out = []
        for p in prompts:
            problem = p.split("user\n")[1].split("\n")[0]
            thinking, answer = arith.solve("mul", problem)
            leak = chat_completion("the reference says " + answer, answer)
            empty = chat_completion("", answer)  # correct, but no thought: the reward hack, never data
            out.append([leak, empty, chat_completion(thinking, answer)][: cfg.n])
        return out

    traces, stats = ped.teacher_traces(sampler, TOK, problems, StarConfig(attempts=3, attempts_per_round=3))
    assert traces["prompt"].to_list() == problems["prompt"].to_list()
    assert not any("reference" in c.lower() for c in traces["completion"])
    assert traces["attempts"].to_list() == [3] * 4 and stats["solve_rate"] == 1.0
    with pytest.raises(GraftlabError, match="verified none"):
        ped.teacher_traces(sampler, TOK, problems, StarConfig(attempts=2, attempts_per_round=2))


@given(
    plans=st.lists(
        st.lists(st.sampled_from(["right", "wrong", "leak", "empty"]), min_size=1, max_size=4),
        min_size=len(PROBLEMS),
        max_size=len(PROBLEMS),
    ),
    per_round=st.integers(1, 3),
)
@settings(max_examples=40, deadline=None)
def test_the_teacher_keeps_a_problems_first_sample_that_verifies_thinks_and_never_names_the_reference(plans, per_round):
    """Whatever the teacher samples (right; wrong; right but naming the reference; right with an empty
    thought), a problem's trace is its first right sample and its attempts count up to it; a problem with
    none has no trace, and a run with none at all is an error."""
    problems = pl.DataFrame(PROBLEMS)
    plan = dict(zip(problems["prompt"], plans))
    seen: dict[str, int] = {}

    def sampler(prompts, cfg):
        out = []
        for p in prompts:
            problem = p.split("user\n")[1].split("\n")[0]
            thinking, answer = arith.solve("mul", problem)
            samples = []
            for _ in range(cfg.n):
                k = seen[problem] = seen.get(problem, -1) + 1
                outcome = plan[problem][k] if k < len(plan[problem]) else "wrong"
                samples.append(
                    {
                        "right": chat_completion(thinking, answer),
                        "wrong": chat_completion(thinking, "0"),
                        "leak": chat_completion("the reference says " + answer, answer),
                        "empty": chat_completion("", answer),
                    }[outcome]
                )
            out.append(samples)
        return out

    cfg = StarConfig(attempts=max(map(len, plans)), attempts_per_round=per_round)
    first = {p: outcomes.index("right") for p, outcomes in plan.items() if "right" in outcomes}
    if not first:
        with pytest.raises(GraftlabError, match="verified none"):
            ped.teacher_traces(sampler, TOK, problems, cfg)
        return
    traces, stats = ped.teacher_traces(sampler, TOK, problems, cfg)
    assert sorted(traces["prompt"]) == sorted(first)
    for p, c, attempts in zip(traces["prompt"], traces["completion"], traces["attempts"]):
        thinking, answer = arith.solve("mul", p)
        assert c == chat_completion(thinking, answer) and attempts == first[p] + 1
    assert stats["solve_rate"] == len(first) / len(plan)
