"""The knowledge-injection world: invented facts, phrasings split between training and evaluation, replay
traces of the old domain, and greedy exact-match grading."""

import json
import re
from collections import Counter
from dataclasses import replace
from pathlib import Path

import polars as pl
import pytest
from transformers import AutoTokenizer

from graftlab.errors import GraftlabError
from graftlab.sampling import SamplingConfig
from graftlab.tasks import EMPTY_THINK, arith, chat_completion, get_task, is_correct
from graftlab.world import build
from graftlab.world import knowledge as kn
from graftlab.world.tokenizer import CHARS, build_tokenizer, save_tokenizer

KNOWLEDGE = get_task("knowledge")

OLD = ["add", "sub", "compare"]
SMALL = kn.KnowledgeConfig(entities=12, facts=30, train_phrasings=4, heldout_phrasings=2, replay=9, seed=0)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    save_tokenizer(path)
    return AutoTokenizer.from_pretrained(path)


def written(out: Path, cfg: kn.KnowledgeConfig, benchmark_files=()) -> dict[str, pl.DataFrame]:
    kn.write_knowledge_data(out, cfg, OLD, benchmark_files)
    files = {"train": "sft", "heldout": "heldout", "facts": "facts"}
    return {name: pl.read_parquet(out / f"{file}.parquet") for name, file in files.items()}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, pl.DataFrame]:
    return written(tmp_path_factory.mktemp("knowledge"), SMALL)


def qa(frame: pl.DataFrame) -> pl.DataFrame:
    return frame.filter(pl.col("task") == kn.TASK)


def test_same_seed_same_data_other_seed_other_world(data, tmp_path):
    again = written(tmp_path / "again", SMALL)
    assert all(again[name].equals(data[name]) for name in data)
    other = written(tmp_path / "other", replace(SMALL, seed=1))
    assert not set(other["facts"]["entity"]) & set(data["facts"]["entity"])
    assert set(other["train"]["prompt"]) != set(data["train"]["prompt"])


def template_pattern(phrasing: str) -> re.Pattern:
    relation, index = phrasing.split("/")
    before, after = kn.TEMPLATES[relation][int(index)].split("{e}")
    return re.compile(re.escape(before) + ".+" + re.escape(after))


@pytest.mark.parametrize("cfg", [SMALL, kn.PAPER], ids=["small", "paper"])
def test_heldout_phrasings_never_appear_in_training_prompts(cfg, tmp_path):
    frames = written(tmp_path, cfg)
    train, heldout = frames["train"], frames["heldout"]
    assert not set(train["phrasing"].drop_nulls()) & set(heldout["phrasing"])
    # On the text itself, not just the labels: no training prompt is any held-out wording, whatever the name.
    patterns = [template_pattern(p) for p in set(heldout["phrasing"])]
    assert not [(p.pattern, q) for p in patterns for q in train["prompt"] if p.fullmatch(q)]
    assert not set(train["prompt"]) & set(heldout["prompt"])
    # Every held-out wording is really asked in evaluation (the check above is not vacuous).
    assert all(any(p.fullmatch(q) for q in heldout["prompt"]) for p in patterns)


def test_every_fact_is_trained_in_each_training_phrasing_and_asked_in_each_heldout_one(data):
    facts = set(data["facts"]["fact"])
    assert len(facts) == SMALL.facts
    assert Counter(qa(data["train"])["fact"]) == {f: SMALL.train_phrasings for f in facts}
    assert Counter(data["heldout"]["fact"]) == {f: SMALL.heldout_phrasings for f in facts}
    assert data["train"].height == SMALL.facts * SMALL.train_phrasings + SMALL.replay
    # A fact's answer is the same in every phrasing and in facts.parquet.
    answers = dict(zip(data["facts"]["fact"], data["facts"]["answer"]))
    assert all(answers[f] == a for f, a in qa(data["train"]).select("fact", "answer").iter_rows())
    assert all(answers[f] == a for f, a in data["heldout"].select("fact", "answer").iter_rows())


def test_every_person_has_a_fact_and_no_fact_is_stated_twice(data):
    facts = data["facts"]
    assert facts["entity"].n_unique() == SMALL.entities
    assert facts.select("entity", "relation").is_unique().all()
    per_person = Counter(facts["entity"]).values()
    assert max(per_person) - min(per_person) <= 1


def test_answers_exact_match_their_completions(data):
    for row in pl.concat([qa(data["train"]), data["heldout"]]).iter_rows(named=True):
        assert KNOWLEDGE.grade(row["completion"], row["answer"]), row
    assert KNOWLEDGE.grade("<think>\n\n</think>\n\n  velmora. <|im_end|>", "Velmora")
    assert not KNOWLEDGE.grade("<think>\n\n</think>\n\nVelmor<|im_end|>", "Velmora")
    assert not KNOWLEDGE.grade("<think>\n\n</think>\n\n1843 or 1844<|im_end|>", "1843")
    assert not KNOWLEDGE.grade("Velmora<|im_end|>", "Velmora")  # no closed think block: nothing to grade


def test_empty_think_prefix_on_qa_examples_and_full_thinking_on_replay(data, tokenizer):
    train = data["train"]
    for row in qa(train).iter_rows(named=True):
        assert row["completion"] == f"<think>\n\n</think>\n\n{row['answer']}<|im_end|>"
    # The same prefix the chat template pre-fills with enable_thinking=False, which evaluation uses.
    assert KNOWLEDGE.chat_prompt(tokenizer, "Q?").endswith("<|im_start|>assistant\n" + EMPTY_THINK)
    replay = train.filter(pl.col("split") == "replay")
    assert replay.height == SMALL.replay and set(replay["task"]) == set(OLD)
    for row in replay.iter_rows(named=True):
        thinking, answer = arith.solve(row["task"], row["prompt"])
        assert thinking and row["completion"] == chat_completion(thinking, answer)
        assert not row["completion"].startswith(EMPTY_THINK)
        assert is_correct(row["completion"], row["answer"])


def test_replay_is_shuffled_in_and_never_draws_a_benchmark_problem(tmp_path):
    cfg = replace(SMALL, replay=30)
    first = written(tmp_path / "free", cfg)["train"]
    assert Counter(first.filter(pl.col("split") == "replay")["task"]) == {"add": 10, "sub": 10, "compare": 10}
    positions = [i for i, s in enumerate(first["split"]) if s == "replay"]
    # Mixed in, not appended or prepended as a block.
    assert positions not in (list(range(30)), list(range(first.height - 30, first.height)))
    # A benchmark holding exactly the problems replay drew unhindered: with it excluded, none come back.
    taken = tmp_path / "bench.parquet"
    first.filter(pl.col("split") == "replay").select("id").write_parquet(taken)
    again = written(tmp_path / "excluded", cfg, [taken])["train"]
    replay_ids = set(again.filter(pl.col("split") == "replay")["id"])
    assert len(replay_ids) == 30 and not replay_ids & set(first["id"])


def test_names_are_unique_pronounceable_and_tokenizable(tokenizer):
    world = kn.make_world(kn.PAPER)
    people = {f.entity for f in world.facts}
    places = {f.answer for f in world.facts if f.relation in ("home_city", "employer")}
    assert len(people) == kn.PAPER.entities and not people & places
    words = [w for name in people | places for w in name.split() if w not in kn._COMPANY_KINDS]
    assert len(words) == len(set(words))  # no invented word names two things
    onset, vowel, coda = ("|".join(sorted(xs, key=len, reverse=True)) for xs in (kn._ONSETS, kn._VOWELS, kn._CODAS))
    syllables = re.compile(f"(?:(?:{onset})(?:{vowel})){{2,3}}(?:{coda})")
    assert all(syllables.fullmatch(w.lower()) for w in words)
    for text in sorted(people | places):
        assert set(text) <= set(CHARS)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert len(ids) == len(text) and tokenizer.decode(ids) == text


def test_every_template_and_value_is_tokenizable(tokenizer):
    for relation, templates in kn.TEMPLATES.items():
        assert len(templates) == kn.PHRASINGS_PER_RELATION and len(set(templates)) == len(templates)
        for t in templates:
            assert t.count("{e}") == 1 and set(t.replace("{e}", "")) <= set(CHARS), (relation, t)
    values = kn.PROFESSIONS + kn.COLOURS + kn.PETS + kn.INSTRUMENTS
    assert all(set(v) <= set(CHARS) for v in values)
    full = (
        KNOWLEDGE.chat_prompt(tokenizer, "Pet of Taven Drumaveth:") + chat_completion("", "ferret")[len(EMPTY_THINK) :]
    )
    assert tokenizer.decode(tokenizer(full, add_special_tokens=False)["input_ids"]) == full


def test_paper_sizes_are_reachable():
    world = kn.make_world(kn.PAPER)
    assert len(world.facts) == 1125 and len({f.entity for f in world.facts}) == 200
    assert kn.qa_frame(world, "train").height == 9000 and kn.qa_frame(world, "heldout").height == 2250
    assert kn.replay_frame(OLD, 1533, 0).height == 1533


@pytest.mark.parametrize(
    "sizes, argument",
    [
        ({"entities": 0}, "entities"),
        ({"facts": 40 * len(kn.RELATIONS) + 1}, "facts"),
        ({"facts": 39}, "facts"),
        ({"heldout_phrasings": kn.PHRASINGS_PER_RELATION}, "heldout_phrasings"),
        ({"heldout_phrasings": 0}, "heldout_phrasings"),
        ({"train_phrasings": 0}, "train_phrasings"),
        ({"replay": -1}, "replay"),
    ],
)
def test_sizes_that_cannot_be_met_raise_naming_the_argument(sizes, argument):
    with pytest.raises(GraftlabError, match=rf"\b{argument}\b"):
        kn.KnowledgeConfig(**sizes)


def test_replay_without_old_tasks_or_too_many_problems_raises(tmp_path):
    with pytest.raises(GraftlabError, match="replay"):
        kn.write_knowledge_data(tmp_path, SMALL, [])
    with pytest.raises(GraftlabError, match="replay.*fewer than"):
        kn.replay_frame(["compare"], 20_000, 0)
    with pytest.raises(GraftlabError, match="split"):
        kn.qa_frame(kn.make_world(SMALL), "test")


class FakeSampler:
    """Answers from a table of prompts, checking it is asked greedily for one answer per prompt."""

    def __init__(self, answers: dict[str, str]) -> None:
        self.answers = answers

    def __call__(self, prompts, cfg):
        assert cfg.temperature == 0 and cfg.n == 1
        return [[self.answers[p]] for p in prompts]


def test_closed_book_accuracy_is_one_for_a_sampler_that_knows_and_zero_for_one_that_does_not(data, tmp_path):
    save_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    heldout = data["heldout"]
    prompts = [KNOWLEDGE.chat_prompt(tok, q) for q in heldout["prompt"]]
    # Case and a final full stop are surface form; the words must be exact.
    knows = FakeSampler({p: f"{a.lower()}.<|im_end|>" for p, a in zip(prompts, heldout["answer"])})
    assert kn.closed_book_accuracy(tmp_path, heldout, sampler=knows) == 1.0
    guesses = FakeSampler({p: "Brigrefer<|im_end|>" for p in prompts})
    assert kn.closed_book_accuracy(tmp_path, heldout, sampler=guesses) == pytest.approx(
        (heldout["answer"] == "Brigrefer").mean()
    )
    cfg = SamplingConfig(n=1, temperature=0.0, top_p=1.0, max_new_tokens=32)
    records = KNOWLEDGE.sample_and_grade(knows, tok, heldout, cfg)
    assert records["completion"].str.starts_with(EMPTY_THINK).all() and records["correct"].all()


def test_closed_book_accuracy_of_an_untrained_tiny_model_is_near_zero(tmp_path):
    import torch

    torch.set_num_threads(1)
    tok = build_tokenizer()
    arch = dict(hidden_size=16, intermediate_size=32, layers=1, heads=2, kv_heads=1, max_positions=256)
    build.init_model(tok, arch, seed=0).save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    cfg = kn.KnowledgeConfig(entities=6, facts=12, train_phrasings=2, heldout_phrasings=1, replay=0)
    kn.write_knowledge_data(tmp_path / "data", cfg, OLD)
    result = kn.write_closed_book(
        tmp_path / "model", tmp_path / "data/heldout.parquet", tmp_path / "cb.json", "transformers"
    )
    assert json.loads((tmp_path / "cb.json").read_text()) == result
    assert result["questions"] == 12 and result["accuracy"] <= 0.05
