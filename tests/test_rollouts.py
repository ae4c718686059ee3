"""Retention rollouts on a pico world model: fresh old-task prompts, the exact token ids the model sampled,
and a parquet the Fisher reads back."""

import json
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import polars as pl
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from graftlab.errors import GraftlabError
from graftlab.fisher.diag import ROLLOUT_COLUMNS, read_rollouts
from graftlab.fisher.rollouts import (
    RolloutConfig,
    problems_from_file,
    retention_problems,
    sample_rollouts,
    write_rollouts,
)
from graftlab.sampling import HfSampler, SamplingConfig, _vllm_completion_ids
from graftlab.tasks import arith, chat_completion, chat_prompt
from graftlab.world import build
from graftlab.world.tokenizer import build_tokenizer

ARCH = dict(hidden_size=16, intermediate_size=32, layers=1, heads=2, kv_heads=1, max_positions=128)
TASKS = ["add", "sub", "compare"]


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("rollout-world")
    tok = build_tokenizer()
    build.init_model(tok, ARCH, seed=0).save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    build.make_benchmarks(TASKS, 20, 0, root / "benchmarks")
    return root


def benchmarks(world: Path) -> list[Path]:
    return sorted((world / "benchmarks").glob("*.parquet"))


def test_prompts_are_fresh_spread_evenly_and_seeded(world, tmp_path):
    problems = retention_problems(TASKS, 10, 0, benchmarks(world))
    assert Counter(p["task"] for p in problems) == {"add": 4, "sub": 3, "compare": 3}
    assert len({p["id"] for p in problems}) == 10
    assert problems == retention_problems(TASKS, 10, 0, benchmarks(world))
    assert problems != retention_problems(TASKS, 10, 1, benchmarks(world))
    # A benchmark holding exactly the problems the stream would draw first: every one of them is skipped.
    first = retention_problems(TASKS, 30, 0, [])
    pl.DataFrame({"id": [p["id"] for p in first]}).write_parquet(tmp_path / "taken.parquet")
    fresh = retention_problems(TASKS, 30, 0, [tmp_path / "taken.parquet"])
    assert not {p["id"] for p in fresh} & {p["id"] for p in first}


def test_rollouts_hold_the_exact_ids_the_model_generated(world, tmp_path):
    out = tmp_path / "rollouts.parquet"
    # Greedy, so every completion token must be the model's argmax after the prompt and the tokens before it.
    stats = tmp_path / "rollouts.json"
    cfg = RolloutConfig(9, 0.0, 12)
    frame = write_rollouts(world / "model", benchmarks(world), TASKS, cfg, out, "transformers", stats_out=stats)
    stored = pl.read_parquet(out)
    assert stored.equals(frame) and set(ROLLOUT_COLUMNS) <= set(stored.columns)
    record = json.loads(stats.read_text())
    assert record["rollouts"] == 9 and record["sample_s"] > 0
    assert record["correct"] == pytest.approx(stored["correct"].mean())
    assert record["mean_completion_tokens"] == pytest.approx(stored["completion_ids"].list.len().mean())
    assert stored.schema["prompt_ids"] == pl.List(pl.Int64) and stored.height == 9
    tok = AutoTokenizer.from_pretrained(world / "model")
    model = AutoModelForCausalLM.from_pretrained(world / "model").eval()
    for row in stored.iter_rows(named=True):
        prompt, completion = row["prompt_ids"], row["completion_ids"]
        assert tok.decode(prompt, skip_special_tokens=False) == chat_prompt(tok, row["prompt"])  # no padding kept
        assert tok.decode(completion, skip_special_tokens=False) == row["completion"]
        assert 1 <= len(completion) <= 12 and tok.eos_token_id not in completion[:-1]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + completion])).logits[0]
        assert logits[len(prompt) - 1 : -1].argmax(-1).tolist() == completion
    assert read_rollouts(out) == list(zip(stored["prompt_ids"].to_list(), stored["completion_ids"].to_list()))


def test_sampled_rollouts_are_reproducible(world, tmp_path):
    cfg = RolloutConfig(6, 1.0, 8, seed=3)
    first = write_rollouts(world / "model", benchmarks(world), TASKS, cfg, tmp_path / "a.parquet", "transformers")
    again = write_rollouts(world / "model", benchmarks(world), TASKS, cfg, tmp_path / "b.parquet", "transformers")
    assert first.equals(again)


def test_too_many_rollouts_is_one_line_error_and_no_file(world, tmp_path):
    with pytest.raises(GraftlabError, match=r"^retention rollouts: task 'sub' has fewer than 5050 distinct problems"):
        write_rollouts(
            world / "model", benchmarks(world), ["sub"], RolloutConfig(5050), tmp_path / "r.parquet", "transformers"
        )
    assert list(tmp_path.iterdir()) == []


def test_completion_ids_end_at_the_end_of_turn_without_padding(world, monkeypatch):
    sampler = HfSampler(world / "model")
    eos, pad = sampler.tok.eos_token_id, sampler.tok.pad_token_id
    tails = torch.tensor([[5, eos, pad, pad], [6, 7, 8, 9]])  # one finished (then padded), one cut by the budget

    def generate(input_ids, **kwargs):
        return torch.cat([input_ids, tails], 1)

    monkeypatch.setattr(sampler.model, "generate", generate)
    prompts = [chat_prompt(sampler.tok, "1+2="), chat_prompt(sampler.tok, "compare 10 20")]
    samples = sampler.sample_ids(prompts, SamplingConfig(1, 1.0, 1.0, 4))
    assert [c for ((_, c),) in samples] == [[5, eos], [6, 7, 8, 9]]
    assert [p for ((p, _),) in samples] == [sampler.tok(q)["input_ids"] for q in prompts]  # left padding dropped
    assert sampler(prompts, SamplingConfig(1, 1.0, 1.0, 4))[0][0].endswith("<|im_end|>")


@pytest.mark.parametrize(
    "ids, finish, stop, expected",
    [
        ([4, 5, 2], "stop", None, [4, 5, 2]),  # the end of turn kept in token_ids
        ([4, 5], "stop", None, [4, 5, 2]),  # ended by the end of turn, left out: put back
        ([4, 5], "length", None, [4, 5]),  # cut by the budget
        ([4, 5], "stop", "</answer>", [4, 5]),  # ended by a stop string, not the end of turn
    ],
)
def test_vllm_completion_ids_agree_with_transformers_on_the_end_of_turn(ids, finish, stop, expected):
    completion = SimpleNamespace(token_ids=ids, finish_reason=finish, stop_reason=stop)
    assert _vllm_completion_ids(completion, eos=2) == expected


class ScriptedSampler:
    """Answers each prompt with a fixed completion, as the exact ids a real sampler returns."""

    def __init__(self, tokenizer, completions: dict[str, str]):
        self.tok, self.completions, self.prompts = tokenizer, completions, []

    def sample_ids(self, prompts, cfg):
        self.prompts += prompts
        ids = lambda text: self.tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
        return [[(ids(p), ids(self.completions[p]))] for p in prompts]


class CharTokenizer:
    """Every character one token, its code point: reads the backslashes and braces of math answers,
    which the tiny world's tokenizer does not have."""

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        return f"user: {messages[0]['content']}\nassistant: "

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens=False):
        return "".join(map(chr, ids))


def problems_file(path: Path, n: int) -> Path:
    pl.DataFrame(
        {
            "id": [f"p{i}" for i in range(n)],
            "task": ["math"] * n,
            "prompt": [f"What is {i} plus one?" for i in range(n)],
            "answer": [str(i + 1) for i in range(n)],
        }
    ).write_parquet(path)
    return path


def test_prompts_from_a_file_are_seeded_and_never_a_benchmark_problem_by_id_or_text(tmp_path):
    problems = problems_file(tmp_path / "problems.parquet", 40)
    # One benchmark shares ids p0-p4; the other shares the text of p5-p9 (spaced differently), not the ids.
    pl.DataFrame({"id": [f"p{i}" for i in range(5)], "prompt": ["other"] * 5}).write_parquet(tmp_path / "b1.parquet")
    texts = [f"What is  {i} plus one?\n" for i in range(5, 10)]
    pl.DataFrame({"id": [f"b{i}" for i in range(5)], "prompt": texts}).write_parquet(tmp_path / "b2.parquet")
    bench = [tmp_path / "b1.parquet", tmp_path / "b2.parquet"]
    drawn = problems_from_file(problems, 30, 0, bench)
    assert sorted(p["id"] for p in drawn) == sorted(f"p{i}" for i in range(10, 40))
    assert [p["id"] for p in drawn] != [f"p{i}" for i in range(10, 40)]  # shuffled, not file order
    assert set(drawn[0]) == {"id", "task", "prompt", "answer"}
    assert problems_from_file(problems, 10, 0, bench) == drawn[:10]
    assert problems_from_file(problems, 10, 1, bench) != drawn[:10]
    # Excluding removes only the benchmark's problems from the seeded order: the rest keep their places.
    unfiltered = problems_from_file(problems, 40, 0, [])
    assert drawn == [p for p in unfiltered if p["id"] not in {f"p{i}" for i in range(10)}]
    with pytest.raises(GraftlabError, match=r"31 requested but only 30 of the 40 problems"):
        problems_from_file(problems, 31, 0, bench)
    pl.read_parquet(problems).drop("answer").write_parquet(tmp_path / "bad.parquet")
    with pytest.raises(GraftlabError, match=r"lacks columns \['answer'\]"):
        problems_from_file(tmp_path / "bad.parquet", 1, 0, [])


def test_each_rollout_is_graded_by_its_task():
    tok = CharTokenizer()
    problems = [
        {"id": "m1", "task": "math", "prompt": "Half of one?", "answer": "\\frac{1}{2}"},
        {"id": "m2", "task": "math", "prompt": "Half of two?", "answer": "1"},
        {"id": "a1", "task": "add", "prompt": "12+30=", "answer": "42"},
        {"id": "a2", "task": "add", "prompt": "1+1=", "answer": "2"},
    ]
    answers = ["So \\boxed{0.5}", "\\boxed{2}", "42", "\\boxed{2}"]  # math-verify equivalence; exact match
    completions = {chat_prompt(tok, p["prompt"]): chat_completion("work", a) for p, a in zip(problems, answers)}
    frame = sample_rollouts(ScriptedSampler(tok, completions), tok, problems, SamplingConfig(1, 1.0, 1.0, 64))
    assert frame["correct"].to_list() == [True, False, True, False]
    assert frame["completion"].to_list() == [completions[chat_prompt(tok, p["prompt"])] for p in problems]
    with pytest.raises(GraftlabError, match=r"unknown task 'maths'"):
        sample_rollouts(None, tok, [{**problems[0], "task": "maths"}], SamplingConfig(1, 1.0, 1.0, 64))


def test_write_rollouts_from_a_problems_file(world, tmp_path, monkeypatch):
    tok = AutoTokenizer.from_pretrained(world / "model")
    held = {p["id"] for f in benchmarks(world) for p in pl.read_parquet(f).to_dicts()}
    # 29 fresh problems and one benchmark problem, which is never drawn.
    pool = arith.sample_problems("add", 29, "test", 5) + pl.read_parquet(benchmarks(world)[0]).head(1).to_dicts()
    problems, out = tmp_path / "problems.parquet", tmp_path / "rollouts.parquet"
    pl.DataFrame(pool).select("id", "task", "prompt", "answer").write_parquet(problems)
    fresh = {p["id"] for p in pool} - held
    assert len(fresh) == 29
    completions = {chat_prompt(tok, p["prompt"]): chat_completion(p["thinking"], p["answer"]) for p in pool}
    monkeypatch.setattr("graftlab.sampling.load_sampler", lambda model, backend: ScriptedSampler(tok, completions))
    frame = write_rollouts(
        world / "model", benchmarks(world), [], RolloutConfig(29, seed=4), out, prompts_file=problems
    )
    assert pl.read_parquet(out).equals(frame)
    assert set(frame["problem_id"]) == fresh and frame["correct"].all()
    first_prompt = tok(chat_prompt(tok, frame["prompt"][0]), add_special_tokens=False)["input_ids"]
    assert read_rollouts(out)[0][0] == first_prompt
    with pytest.raises(GraftlabError, match=r"30 requested but only 29 of the 30"):
        write_rollouts(
            world / "model", benchmarks(world), [], RolloutConfig(30), tmp_path / "r.parquet", "auto", problems
        )
    assert not (tmp_path / "r.parquet").exists()
