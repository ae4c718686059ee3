"""World variants for issue 19 (docs/fidelity.md): the new task shown solved in pretraining
(`world.corpus.new_task_share`) and task families seen only in pretraining (`world.corpus.families`)."""

import hashlib
import re
from pathlib import Path

import polars as pl
import pytest

from graftlab.planning.config import ConfigError, resolve
from graftlab.streams import stream
from graftlab.tasks import arith, extract_thinking, is_correct
from graftlab.world.build import exposure_problems, make_candidates, make_corpus
from graftlab.world.tokenizer import CHARS

TURN = re.compile(r"<\|im_start\|>user\n(.*?)<\|im_end\|>\n<\|im_start\|>assistant\n(.*?<\|im_end\|>)", re.S)
OLD = ["add", "sub", "compare"]
TASKS = OLD + ["mul"]


@pytest.mark.parametrize("family", sorted(arith.FAMILIES))
def test_families_solve_correctly_think_in_a_form_of_no_task_and_need_no_unknown_character(family):
    problems = [arith.problem(family, *arith.operands(family, stream("test", i))) for i in range(300)]
    for p in problems:
        a, b = map(int, re.findall(r"\d+", p["prompt"]))
        cols = list(zip(str(a).zfill(2), str(b).zfill(2)))
        if family == "div":
            expected = f"{a // b}r{a % b}"
        elif family == "maxd":
            expected = "".join(max(x, y) for x, y in cols)
        else:
            expected = "".join(str(abs(int(x) - int(y))) for x, y in cols)
        assert p["answer"] == expected, p
        # Never read as an old task's procedure nor the new task's: misrouted and takeover count none.
        assert arith.thinking_form(p["thinking"]) is None, p
        assert set(p["prompt"] + p["thinking"] + p["answer"]) <= set(CHARS), p
    assert family not in arith.SOLVERS  # no benchmark, candidate or chain stage can draw it
    prompts = {p["prompt"] for p in problems}
    assert not prompts & {arith.problem(t, *arith.operands(t, stream("test", 0)))["prompt"] for t in TASKS}


def test_division_thinks_left_to_right_carrying_the_remainder():
    p = arith.problem("div", 97, 4)
    assert (p["prompt"], p["thinking"], p["answer"]) == ("97/4=", "9/4=2r1;17/4=4r1", "24r1")


def test_exposure_problems_lie_outside_the_candidates_and_are_fixed_by_the_seed(tmp_path):
    make_candidates("mul", 680, 0, tmp_path / "candidates.parquet")
    candidates = set(pl.read_parquet(tmp_path / "candidates.parquet")["id"])
    pool = exposure_problems("mul", 40, 0, tmp_path / "candidates.parquet")
    ids = {p["id"] for p in pool}
    assert len(ids) == 40 and not ids & candidates  # so no SFT or held-out (benchmark) problem either
    assert pool == exposure_problems("mul", 40, 0, tmp_path / "candidates.parquet")
    make_candidates("mul", 680, 1, tmp_path / "other.parquet")
    assert exposure_problems("mul", 40, 1, tmp_path / "other.parquet") != pool
    with pytest.raises(ValueError, match="new_task_problems 41 exceeds the 40 mul problems outside the 680"):
        exposure_problems("mul", 41, 0, tmp_path / "candidates.parquet")


def _documents(path) -> list[str]:
    return pl.read_parquet(path)["text"].to_list()


def test_new_task_share_shows_the_pool_solved_in_the_chat_format(tmp_path):
    make_candidates("mul", 700, 0, tmp_path / "candidates.parquet")
    pool = exposure_problems("mul", 20, 0, tmp_path / "candidates.parquet")
    out = tmp_path / "corpus.parquet"
    make_corpus(TASKS, 1000, 8, 0, out, chat_share=0.25, chat_tasks=OLD, new_task_share=0.05, exposure=pool)
    docs = _documents(out)
    turns = [TURN.findall(d) for d in docs if d.startswith("<|im_start|>")]
    exposed = [t for t in turns if all(re.fullmatch(r"\d\d\*\d=", prompt) for prompt, _ in t)]
    assert 25 <= len(exposed) <= 80  # 5% of 1,000, give or take the binomial spread
    assert 170 <= len(turns) - len(exposed) <= 340  # the old tasks' quarter is kept
    by_prompt = {p["prompt"]: p for p in pool}
    candidates = set(pl.read_parquet(tmp_path / "candidates.parquet")["prompt"])
    for doc in exposed:
        assert len(doc) == 2  # 8 lines // 4 solved problems a document
        for prompt, completion in doc:
            assert prompt in by_prompt and prompt not in candidates
            assert is_correct(completion, by_prompt[prompt]["answer"])
            assert arith.thinking_form(extract_thinking(completion)) == "mul"  # the new task's own procedure
    # Deterministic by seed; another seed gives another corpus.
    make_corpus(TASKS, 1000, 8, 0, tmp_path / "again.parquet", 0.25, OLD, 0.05, pool)
    assert _documents(tmp_path / "again.parquet") == docs
    make_corpus(TASKS, 1000, 8, 1, tmp_path / "seed1.parquet", 0.25, OLD, 0.05, pool)
    assert _documents(tmp_path / "seed1.parquet") != docs


def test_new_task_share_needs_problems_and_room_beside_the_chat_share(tmp_path):
    pool = [arith.problem("mul", 47, 8)]
    with pytest.raises(ValueError, match="needs problems"):
        make_corpus(TASKS, 4, 4, 0, tmp_path / "c.parquet", new_task_share=0.1)
    with pytest.raises(ValueError, match="1 - chat_share"):
        make_corpus(TASKS, 4, 4, 0, tmp_path / "c.parquet", 0.95, OLD, new_task_share=0.1, exposure=pool)


PROMPTS = {
    "add": r"\d\d\+\d\d=",
    "sub": r"\d\d-\d\d=",
    "compare": r"compare \d\d \d\d",
    "div": r"\d\d/\d=",
    "maxd": r"\d\d!\d\d=",
    "absd": r"\d\d:\d\d=",
}


def test_families_join_the_old_tasks_in_the_chat_documents(tmp_path):
    out = tmp_path / "corpus.parquet"
    make_corpus(TASKS, 400, 16, 0, out, chat_share=0.5, chat_tasks=OLD, families=["div", "maxd", "absd"])
    prompts = [prompt for d in _documents(out) for prompt, _ in TURN.findall(d)]
    kinds = {next(k for k, pat in PROMPTS.items() if re.fullmatch(pat, p)) for p in prompts}
    assert kinds == {"add", "sub", "compare", "div", "maxd", "absd"}  # and never the new task


def test_worlds_built_before_the_options_keep_their_corpus(tmp_path):
    # The corpus of a world without new_task_share, as built before the option existed (checked against
    # that code when it was added): an existing world's results stay valid.
    make_corpus(TASKS, 60, 16, 0, tmp_path / "c.parquet", chat_share=0.25, chat_tasks=OLD)
    digest = hashlib.sha256("\x00".join(_documents(tmp_path / "c.parquet")).encode()).hexdigest()
    assert digest == "4b57765d35de89c3427bca65300e3faceef67ce471e30fd871f3042c22fc1b4b"


def test_families_need_chat_documents_and_the_config_knows_only_the_families():
    with pytest.raises(ValueError, match="need chat_share > 0"):
        make_corpus(TASKS, 4, 4, 0, Path("unused.parquet"), families=["div"])
    with pytest.raises(ConfigError, match="worlds.x.corpus.families.0"):
        resolve({"worlds": {"x": {"corpus": {"chat_share": 0.25, "families": ["mul"]}}}})
    corpus = resolve({})["world"]["corpus"]
    assert (corpus["new_task_share"], corpus["new_task_problems"], corpus["families"]) == (0, 40, [])
