"""Stage functions on a pico model with the world's tokenizer: sampling, mining, traces, SFT, evaluation."""

import json
from pathlib import Path

import polars as pl
import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from graftlab.errors import GraftlabError
from graftlab.evaluate.run import Benchmark, evaluate
from graftlab.sampling import SamplingConfig, generate, generate_ids
from graftlab.synth.mining import MiningConfig, split_hard
from graftlab.synth.traces import expert_traces
from graftlab.tasks import arith, chat_prompt, get_task
from graftlab.train.sft import TrainConfig, encode_chat, sft_epochs
from graftlab.world import build
from graftlab.world.tokenizer import build_tokenizer

ARCH = dict(hidden_size=16, intermediate_size=32, layers=1, heads=2, kv_heads=1, max_positions=128)


@pytest.fixture(scope="module")
def world_model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("pico")
    tok = build_tokenizer()
    build.init_model(tok, ARCH, seed=0).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_generate_returns_n_decoded_completions_and_greedy_is_deterministic(world_model):
    tok = AutoTokenizer.from_pretrained(world_model)
    prompts = [chat_prompt(tok, p) for p in ("1+2=", "compare 3 4", "12*3=")]
    sampled = generate(world_model, prompts, SamplingConfig(3, 1.0, 1.0, 8), backend="transformers")
    assert [len(c) for c in sampled] == [3, 3, 3]
    # Decoding stops at the end of turn: nothing (no padding of finished rows) comes after it.
    assert all("<|im_end|>" not in c or c.endswith("<|im_end|>") for cs in sampled for c in cs)
    greedy = SamplingConfig(n=3, temperature=0, top_p=1.0, max_new_tokens=8)
    first = generate(world_model, prompts, greedy)
    assert first == generate(world_model, prompts, greedy)
    assert all(len(set(cs)) == 1 and len(cs) == 3 for cs in first)  # n greedy samples are one answer


def test_generate_ids_are_the_samples_generate_decodes(world_model):
    tok = AutoTokenizer.from_pretrained(world_model)
    prompts = [chat_prompt(tok, p) for p in ("1+2=", "compare 13 40")]  # unequal lengths: left padding
    cfg = SamplingConfig(2, 1.0, 1.0, 10, seed=5)
    texts, ids = generate(world_model, prompts, cfg), generate_ids(world_model, prompts, cfg)
    assert [[tok.decode(c, skip_special_tokens=False) for _, c in samples] for samples in ids] == texts
    assert [[tok.decode(p) for p, _ in samples] for samples in ids] == [[q, q] for q in prompts]


def test_unknown_backend_is_an_error(world_model):
    with pytest.raises(ValueError, match="unknown sampling backend 'tgi'"):
        generate(world_model, ["x"], SamplingConfig(1, 1.0, 1.0, 4), backend="tgi")


def test_split_hard_keeps_never_solved_problems_and_holds_out_disjointly():
    problems = arith.sample_problems("mul", 40, "test", 0)
    rates = [0.0] * 20 + [0.25] * 10 + [0.5] * 10
    train, heldout = split_hard(
        problems, rates, MiningConfig(8, max_pass_rate=0.25, heldout=10, temperature=1.0, max_new_tokens=8)
    )
    assert train.height == 20 and heldout.height == 10
    assert not set(train["id"]) & set(heldout["id"])
    assert set(pl.concat([train, heldout])["pass_rate"]) == {0.0, 0.25}
    with pytest.raises(GraftlabError, match="mining kept 30 of 40 problems"):
        split_hard(problems, rates, MiningConfig(8, max_pass_rate=0.25, heldout=30, temperature=1.0, max_new_tokens=8))


def test_expert_traces_verify_and_refuse_a_wrong_trace():
    problems = pl.DataFrame(arith.sample_problems("mul", 5, "test", 0))
    traces, stats = expert_traces(problems)
    assert traces.height == 5 and traces["completion"].str.ends_with("<|im_end|>").all()
    assert stats == {"problems": 5, "traces": 5, "skipped": 0, "skipped_ids": []}
    with pytest.raises(GraftlabError, match="does not verify"):
        expert_traces(problems.with_columns(answer=pl.lit("0")))


def test_expert_traces_of_a_data_set_are_its_written_solutions_and_skip_empty_ones_out_loud():
    problems = pl.DataFrame(
        {
            "id": ["a", "b", "c"],
            "task": ["math"] * 3,
            "prompt": ["1/2 + 1/2?", "2+2?", "3+3?"],
            "answer": ["1", "4", "6"],
            "solution": ["Halves make a whole.", "", "Three twice is six."],
        }
    )
    traces, stats = expert_traces(problems)
    assert traces["id"].to_list() == ["a", "c"]
    assert traces["completion"][0] == "<think>\nHalves make a whole.\n</think>\n\n\\boxed{1}<|im_end|>"
    assert get_task("math").grade(traces["completion"][1], "6")
    assert stats["skipped"] == 1 and stats["skipped_ids"] == ["b"]
    with pytest.raises(GraftlabError, match="columns.solution"):
        expert_traces(problems.drop("solution"))
    with pytest.raises(GraftlabError, match="none of 1 problems"):
        expert_traces(problems.filter(pl.col("id") == "b"))


def test_encode_chat_puts_loss_on_completion_tokens_only():
    tok = build_tokenizer()
    row = encode_chat(tok, "<|im_start|>user\n1+2=<|im_end|>\n", "<think>\n</think>\n\n3<|im_end|>")
    assert len(row["input_ids"]) == len(row["completion_mask"])
    assert row["completion_mask"] == [0] * 12 + [1] * 7  # 1 + 4 + 1 + 4 + 1 + 1 prompt tokens; 7 completion tokens


def test_sft_writes_one_loadable_checkpoint_per_epoch_that_moved(world_model, tmp_path):
    data = tmp_path / "sft.parquet"
    expert_traces(pl.DataFrame(arith.sample_problems("mul", 32, "test", 0)))[0].write_parquet(data)
    sft_epochs(world_model, data, TrainConfig(lr=1e-2, batch_size=8, epochs=2), tmp_path / "run")
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["epoch~1", "epoch~2", "steps.jsonl", "training.png"]
    steps = [json.loads(line) for line in (tmp_path / "run" / "steps.jsonl").open()]
    assert [s["step"] for s in steps] == list(range(1, 9))  # 32 traces / 8 a batch x 2 epochs
    assert [s["epoch"] for s in steps] == [1] * 4 + [2] * 4
    assert all(s["update_s"] > 0 and s["sample_s"] == 0 for s in steps)
    before = AutoModelForCausalLM.from_pretrained(world_model).state_dict()
    after = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "epoch~2").state_dict()
    assert any(not before[k].equal(after[k]) for k in before)
    assert AutoTokenizer.from_pretrained(tmp_path / "run" / "epoch~1").eos_token == "<|im_end|>"


def test_sft_refuses_data_without_columns(world_model, tmp_path):
    pl.DataFrame({"prompt": ["1+1="]}).write_parquet(tmp_path / "bad.parquet")
    with pytest.raises(GraftlabError, match="SFT data .* lacks columns \\['completion'\\]"):
        sft_epochs(world_model, tmp_path / "bad.parquet", TrainConfig(lr=1e-3, batch_size=2, epochs=1), tmp_path / "o")


def test_evaluate_writes_records_and_metrics(world_model, tmp_path):
    benches = []
    for task, role in (("add", "old"), ("sub", "old"), ("mul", "new")):
        pl.DataFrame(arith.sample_problems(task, 6, "test", 0)).write_parquet(tmp_path / f"{task}.parquet")
        benches.append(Benchmark(task, tmp_path / f"{task}.parquet", role))
    metrics = evaluate(world_model, benches, SamplingConfig(4, 1.0, 1.0, 6), tmp_path / "eval", "post")
    records = pl.read_parquet(tmp_path / "eval" / "add.parquet")
    assert records.height == 6 * 4 and records["correct"].dtype == pl.Boolean
    assert json.loads((tmp_path / "eval" / "metrics.json").read_text()) == metrics
    assert set(metrics["benchmarks"]["mul"]) >= {"acc@n", "pass@1", "pass@4"}


def test_vllm_is_optional_and_its_absence_is_explained(world_model):
    import importlib.util

    import graftlab.sampling as sampling

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    assert not sampling.vllm_available()
    with pytest.raises(RuntimeError, match="needs vLLM: install the GPU stack of envs/gpu.lock.txt"):
        generate(world_model, ["x"], SamplingConfig(1, 1.0, 1.0, 4), backend="vllm")


def test_pass_rates_count_correct_samples_per_problem_in_order():
    from graftlab.synth.mining import pass_rates

    problems = arith.sample_problems("mul", 5, "test", 0)
    answers = {p["prompt"]: p["answer"] for p in problems}

    def sampler(prompts, cfg):  # problem i gets i % 3 correct samples of cfg.n
        out = []
        for i, prompt in enumerate(prompts):
            answer = next(a for q, a in answers.items() if q in prompt)
            right, wrong = f"<think>\n</think>\n\n{answer}", "<think>\n</think>\n\nx"
            out.append([right] * (i % 3) + [wrong] * (cfg.n - i % 3))
        return out

    cfg = MiningConfig(4, max_pass_rate=0.25, heldout=1, temperature=1.0, max_new_tokens=8)
    assert pass_rates(sampler, build_tokenizer(), problems, cfg) == [0.0, 0.25, 0.5, 0.0, 0.25]
