"""The tiny world: tokenizer, task solvers, corpus and problem sets."""

import random
import re

import pytest
from transformers import AutoTokenizer

from graftlab.tasks import arith, chat_completion, chat_prompt, extract_answer, is_correct
from graftlab.world.tokenizer import save_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    save_tokenizer(path)
    return AutoTokenizer.from_pretrained(path)


def test_tokenizer_is_one_token_per_character_and_round_trips(tokenizer):
    text = "compare 37 48\n12+34=46"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)
    assert tokenizer.decode(ids) == text


def test_chat_template_matches_qwen3_layout(tokenizer):
    prompt = chat_prompt(tokenizer, "12+34=")
    assert prompt == "<|im_start|>user\n12+34=<|im_end|>\n<|im_start|>assistant\n"
    full = prompt + chat_completion("4+2+0=6;1+3+0=4", "46")
    ids = tokenizer(full, add_special_tokens=False)["input_ids"]
    for special in ("<|im_start|>", "<|im_end|>", "<think>", "</think>"):
        assert tokenizer.convert_tokens_to_ids(special) in ids
    assert tokenizer.decode(ids) == full
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"


@pytest.mark.parametrize("task", ["add", "sub", "compare", "mul"])
def test_solvers_answer_correctly_and_every_thinking_step_is_true(task):
    for p in arith.sample_problems(task, 200, "test", 1):
        a, b = map(int, re.findall(r"\d+", p["prompt"]))
        expected = {"add": a + b, "sub": a - b, "mul": a * b}.get(task)
        if task == "compare":
            assert p["answer"] == ("<" if a < b else ">" if a > b else "=")
        else:
            assert p["answer"] == str(expected) and (task != "sub" or a >= b)
        for step in p["thinking"].split(";"):
            # "7*8=56+5=61": each expression equals the number that starts the next part.
            parts = step.split("=")
            for expr, after in zip(parts, parts[1:]):
                assert eval(expr) == int(re.match(r"\d+", after).group()), (p, step)  # noqa: S307


def test_sample_problems_is_deterministic_distinct_and_respects_exclusions():
    first = arith.sample_problems("add", 50, "test", 3)
    assert first == arith.sample_problems("add", 50, "test", 3)
    assert len({p["id"] for p in first}) == 50
    excluded = {p["id"] for p in first[:25]}
    assert not excluded & {p["id"] for p in arith.sample_problems("add", 50, "test", 3, exclude=excluded)}
    with pytest.raises(ValueError, match="fewer than"):
        arith.sample_problems("mul", 10_000, "test", 0)


def test_corpus_has_no_assembled_multiplication():
    rng = random.Random(0)
    lines = [arith.corpus_line("mul", rng) for _ in range(500)]
    assert all(re.fullmatch(r"\d\*\d=\d+", line) for line in lines)


def test_grading_reads_the_answer_after_thinking():
    assert is_correct("<think>\nx\n</think>\n\n46<|im_end|>", "46")
    assert not is_correct("<think>\n46", "46")  # thinking never closed
    assert extract_answer("no thinking at all") is None


def test_times_is_mul_in_its_own_format():
    for a, b in [(10, 2), (47, 8), (99, 9)]:
        p, q = arith.problem("times", a, b), arith.problem("mul", a, b)
        assert (p["thinking"], p["answer"]) == (q["thinking"], q["answer"]) and p["prompt"] == f"product({a},{b})?"
        assert arith.solve("times", p["prompt"]) == (p["thinking"], p["answer"])
    assert arith.distinct_problems("times") == arith.distinct_problems("mul") == 720
    assert all(re.fullmatch(r"\d\*\d=\d+", arith.corpus_line("times", random.Random(i))) for i in range(50))


def test_corpus_chat_share_mixes_in_solved_chat_turns_and_the_plain_corpus_has_none(tmp_path):
    import polars as pl

    from graftlab.world.build import make_corpus

    make_corpus(["add", "mul"], 400, 8, 0, tmp_path / "plain.parquet")
    make_corpus(["add", "mul"], 400, 8, 0, tmp_path / "chat.parquet", chat_share=0.25, chat_tasks=["add", "sub"])
    plain, chat = (pl.read_parquet(tmp_path / f)["text"].to_list() for f in ("plain.parquet", "chat.parquet"))
    chats = [d for d in chat if d.startswith("<|im_start|>user\n")]
    assert 60 <= len(chats) <= 140  # a quarter of 400, give or take the binomial spread
    for doc in chats:
        turns = re.findall(
            r"<\|im_start\|>user\n(.*?)<\|im_end\|>\n<\|im_start\|>assistant\n(.*?<\|im_end\|>)", doc, re.S
        )
        assert len(turns) == 2  # 8 lines // 4 solved problems a document
        for prompt, completion in turns:
            a, op, b = re.fullmatch(r"(\d\d)([+-])(\d\d)=", prompt).groups()
            assert is_correct(completion, str(int(a) + int(b) if op == "+" else int(a) - int(b)))
    assert all("<|im_start|>" not in d for d in plain)
    with pytest.raises(ValueError, match="chat_share"):
        make_corpus(["add"], 4, 4, 0, tmp_path / "bad.parquet", chat_share=0.5)


def test_pretraining_keeps_the_initialisation_beside_the_ladder(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from graftlab.world.build import init_model, make_corpus, pretrain

    save_tokenizer(tmp_path / "tok")
    make_corpus(["add"], 40, 4, 0, tmp_path / "corpus.parquet")
    arch = {"hidden_size": 16, "intermediate_size": 32, "layers": 1, "heads": 2, "kv_heads": 1, "max_positions": 64}
    cfg = {"steps": 2, "batch_size": 4, "lr": 1e-2, "ladder": [1, 2], "block": 32}
    pretrain(tmp_path / "tok", tmp_path / "corpus.parquet", arch, cfg, tmp_path / "ladder", tmp_path / "init", 3, 1)

    expected = init_model(AutoTokenizer.from_pretrained(tmp_path / "tok"), arch, 3).state_dict()
    init = AutoModelForCausalLM.from_pretrained(tmp_path / "init").state_dict()
    assert init.keys() == expected.keys() and all(torch.equal(init[k], expected[k]) for k in expected)
    assert AutoTokenizer.from_pretrained(tmp_path / "init").eos_token == "<|im_end|>"
    assert sorted(p.name for p in (tmp_path / "ladder").iterdir()) == ["step~1", "step~2"]
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "ladder" / "step~2").state_dict()
    assert not torch.equal(base["model.embed_tokens.weight"], init["model.embed_tokens.weight"])  # trained
    assert not list(tmp_path.glob(".*"))  # no temporary sibling left behind


def test_posttraining_keeps_its_ladder_without_changing_the_post_model(tmp_path):
    """Checkpoints kept along post-training (`post~N`, the §5.3 donors) leave the post model bit-identical
    to a run that keeps none, and lie on its trajectory: distinct from the post model and from each other."""
    import torch
    from transformers import AutoModelForCausalLM

    from graftlab.world.build import make_benchmarks, make_corpus, posttrain, pretrain

    save_tokenizer(tmp_path / "tok")
    make_corpus(["add"], 40, 4, 0, tmp_path / "corpus.parquet")
    make_benchmarks(["add"], 4, 0, tmp_path / "bench")
    arch = {"hidden_size": 16, "intermediate_size": 32, "layers": 1, "heads": 2, "kv_heads": 1, "max_positions": 64}
    pre = {"steps": 1, "batch_size": 4, "lr": 1e-2, "ladder": [1], "block": 32}
    pretrain(tmp_path / "tok", tmp_path / "corpus.parquet", arch, pre, tmp_path / "ladder", tmp_path / "init", 3, 1)
    base = tmp_path / "ladder" / "step~1"
    # 4 steps, the first of them warm-up at learning rate 0: the rungs are kept after steps 2 and 3.
    post = {"examples_per_task": 16, "epochs": 1, "batch_size": 4, "lr": 1e-2}

    def weights(path):
        return AutoModelForCausalLM.from_pretrained(path).state_dict()

    def same(a, b):
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    for name, ladder in (("plain", []), ("kept", [2, 3])):
        out = tmp_path / name
        posttrain(base, tmp_path / "bench", ["add"], post | {"ladder": ladder}, out / "post", out / "rungs", 0, 1)
        assert sorted(p.name for p in (out / "rungs").iterdir()) == [f"post~{s}" for s in ladder]
    final = weights(tmp_path / "plain" / "post")
    assert same(final, weights(tmp_path / "kept" / "post"))
    rungs = [weights(tmp_path / "kept" / "rungs" / f"post~{s}") for s in (2, 3)]
    assert not same(rungs[0], rungs[1]) and not same(rungs[1], final) and not same(rungs[0], weights(base))

    with pytest.raises(ValueError, match=r"posttrain.ladder: steps \[4\]"):
        posttrain(base, tmp_path / "bench", ["add"], post | {"ladder": [4]}, tmp_path / "x/p", tmp_path / "x/r", 0, 1)
    assert not (tmp_path / "x").exists()
