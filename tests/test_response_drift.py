"""Response drift: responses embedded by the starting model (mean last hidden state over the response
tokens), the cosine of each run's response with the starting model's to the same prompt, its quantiles
and its figure."""

import subprocess
import sys

import numpy as np
import polars as pl
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from graftlab.analysis.response_drift import (
    embed_responses,
    plot_similarity,
    response_similarity,
    similarity_quantiles,
)
from graftlab.errors import GraftlabError
from graftlab.tasks import EMPTY_THINK, get_task

PROMPTS = ["12+7=", "3*3=", "9-4="]
TURNS = ["<think>\n2+7=9\n</think>\n\n19<|im_end|>", "<think>\n</think>\n\n9<|im_end|>", "5"]


def hand_embedding(model_dir, prompt: str, response: str, task: str) -> np.ndarray:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    head = tok(get_task(task).chat_prompt(tok, prompt), add_special_tokens=False)["input_ids"]
    tail = tok(response, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        hidden = model(torch.tensor([head + tail]), output_hidden_states=True).hidden_states[-1][0]
    return hidden[len(head) :].mean(0).numpy()


def test_an_embedding_is_the_mean_last_hidden_state_over_the_response(world_pico):
    # Different lengths in one batch: padding must not reach the positions pooled.
    emb = embed_responses(world_pico, PROMPTS, TURNS, "add", batch_size=3)
    assert emb.dtype == np.float32 and emb.shape == (3, 16)
    for i in range(3):
        np.testing.assert_allclose(emb[i], hand_embedding(world_pico, PROMPTS[i], TURNS[i], "add"), atol=1e-5)
    one_by_one = embed_responses(world_pico, PROMPTS, TURNS, "add", batch_size=1)
    np.testing.assert_allclose(emb, one_by_one, atol=1e-5)


def test_a_knowledge_turn_is_read_after_its_prompt_without_the_prefilled_think_block(world_pico):
    question, answer = "Which city is Taven Drumaveth from?", "Velmora<|im_end|>"
    emb = embed_responses(world_pico, [question], [EMPTY_THINK + answer], "knowledge")
    np.testing.assert_allclose(emb[0], hand_embedding(world_pico, question, answer, "knowledge"), atol=1e-5)
    np.testing.assert_allclose(emb, embed_responses(world_pico, [question], [answer], "knowledge"))


def test_empty_responses_and_mismatched_lists_are_refused(world_pico):
    with pytest.raises(GraftlabError, match=r"responses \[1\] are empty"):
        embed_responses(world_pico, PROMPTS[:2], ["19", ""], "add")
    with pytest.raises(GraftlabError, match="2 prompts but 1 responses"):
        embed_responses(world_pico, PROMPTS[:2], ["19"], "add")


def write_eval(directory, bench: str, completions: dict[str, list[str]]):
    """One evaluated model's records of `bench`: per problem id, its samples in order."""
    directory.mkdir(parents=True, exist_ok=True)
    rows = [
        {"problem_id": pid, "sample": i, "completion": c, "answer": None, "correct": False}
        for pid, samples in completions.items()
        for i, c in enumerate(samples)
    ]
    pl.DataFrame(rows, schema_overrides={"answer": pl.Utf8}).write_parquet(directory / f"{bench}.parquet")
    return directory


@pytest.fixture
def evals(tmp_path):
    """A benchmark of 3 problems; the starting model's records, a run that answers alike on sample 0 (and
    differently on sample 1), and one that answers otherwise."""
    path = tmp_path / "add.parquet"
    pl.DataFrame(
        {"id": ["q2", "q0", "q1"], "prompt": PROMPTS, "answer": ["19", "9", "5"], "task": "add"}
    ).write_parquet(path)
    start = write_eval(tmp_path / "start", "add", {"q0": [TURNS[1], "x"], "q1": [TURNS[2], "x"], "q2": [TURNS[0], "x"]})
    alike = write_eval(tmp_path / "alike", "add", {"q2": [TURNS[0], "y"], "q0": [TURNS[1], "y"], "q1": [TURNS[2], "y"]})
    other = write_eval(
        tmp_path / "other", "add", {"q2": ["<think>\n7\n</think>\n\n3<|im_end|>"], "q0": ["81"], "q1": ["0"]}
    )
    return [{"name": "add", "path": path, "task": "add"}], start, {"self": start, "alike": alike, "other": other}


def test_identical_responses_have_cosine_one_and_others_less(world_pico, evals):
    benchmarks, start, runs = evals
    frame = response_similarity(world_pico, benchmarks, start, runs, prompts_per_benchmark=2)
    assert frame.columns == ["run", "benchmark", "problem_id", "cosine"]
    # The first two problems in the benchmark's order, for every run.
    assert frame["problem_id"].to_list() == ["q2", "q0"] * 3 and frame["benchmark"].unique().to_list() == ["add"]
    cos = {run: frame.filter(pl.col("run") == run)["cosine"].to_list() for run in runs}
    assert cos["self"] == pytest.approx([1.0, 1.0], abs=1e-6) and cos["alike"] == pytest.approx([1.0, 1.0], abs=1e-6)
    assert max(cos["other"]) < 0.999
    expected = [
        float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))
        for a, b in zip(
            embed_responses(world_pico, PROMPTS[:2], TURNS[:2], "add"),
            embed_responses(world_pico, PROMPTS[:2], ["<think>\n7\n</think>\n\n3<|im_end|>", "81"], "add"),
        )
    ]
    assert cos["other"] == pytest.approx(expected, abs=1e-5)


def test_a_run_missing_a_problem_or_benchmark_is_named(world_pico, evals, tmp_path):
    benchmarks, start, runs = evals
    short = write_eval(tmp_path / "short", "add", {"q2": [TURNS[0]]})
    with pytest.raises(GraftlabError, match=r"run short, benchmark add .*short/add\.parquet.*\['q0'\]"):
        response_similarity(world_pico, benchmarks, start, {"short": short}, prompts_per_benchmark=2)
    with pytest.raises(GraftlabError, match=r"run none, benchmark add .*cannot read"):
        response_similarity(world_pico, benchmarks, start, {"none": tmp_path / "none"})


def similarity_frame() -> pl.DataFrame:
    rng = np.random.default_rng(0)
    rows = [
        {"run": run, "benchmark": bench, "problem_id": f"q{i}", "cosine": 1.0 if run == "post" else float(c)}
        for run in ("sft", "post")
        for bench in ("add", "mul")
        for i, c in enumerate(rng.uniform(0.2, 1.0, 20))
    ]
    return pl.DataFrame(rows)


def test_quantiles_per_run_and_benchmark_and_pooled():
    frame = similarity_frame()
    table = similarity_quantiles(frame)
    assert table.columns == ["run", "benchmark", "n", "mean", "q05", "q10"]
    assert table.select("run", "benchmark").rows() == [
        ("sft", "add"),
        ("sft", "mul"),
        ("sft", "all"),
        ("post", "add"),
        ("post", "mul"),
        ("post", "all"),
    ]
    for run, bench, n, mean, q05, q10 in table.rows():
        part = frame.filter(pl.col("run") == run)
        values = (part if bench == "all" else part.filter(pl.col("benchmark") == bench))["cosine"].to_numpy()
        assert n == len(values) == (40 if bench == "all" else 20)
        assert (mean, q05, q10) == pytest.approx((values.mean(), *np.quantile(values, [0.05, 0.10])))


def test_the_figure_is_written_with_a_run_that_never_moved(tmp_path):
    frame = similarity_frame()
    plot_similarity(frame, tmp_path / "drift.png", order=["post", "sft"])
    plot_similarity(frame.filter(pl.col("benchmark") == "add"), tmp_path / "one.png")
    assert (tmp_path / "drift.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "one.png").stat().st_size > 0
    with pytest.raises(GraftlabError, match=r"runs \['grpo'\]"):
        plot_similarity(frame, tmp_path / "bad.png", order=["grpo", "sft"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drift.png", "one.png"]


def test_importing_the_module_leaves_torch_and_matplotlib_out():
    heavy = "{'torch', 'transformers', 'matplotlib'}"
    code = f"import sys, graftlab.analysis.response_drift; print(sorted({heavy} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
