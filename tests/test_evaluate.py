"""One evaluation job grading each benchmark by its own task: exact match for the tiny world, boxed answers
through math-verify for math, and greedy exact match after an empty-think prefill for knowledge."""

import json
import re
from fractions import Fraction

import polars as pl
import pytest

from graftlab.errors import GraftlabError
from graftlab.evaluate.metrics import INTERVAL, acc_interval
from graftlab.evaluate.run import RECORD_COLUMNS, Benchmark, evaluate
from graftlab.sampling import SamplingConfig
from graftlab.tasks import EMPTY_THINK
from graftlab.world.tokenizer import save_tokenizer

CFG = SamplingConfig(n=4, temperature=1.0, top_p=0.95, max_new_tokens=24)
_USER = re.compile(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", re.S)


def turn(final: str) -> str:
    return f"<think>\nworking\n</think>\n\n{final}<|im_end|>"


class Scripted:
    """Fake sampler: per question (the user turn), the first `cfg.n` of its scripted completions; records
    every call so tests can check what the model was shown and how it was asked to decode."""

    def __init__(self, replies: dict[str, list[str]]):
        self.replies, self.calls = replies, []

    def __call__(self, prompts, cfg):
        self.calls.append((list(prompts), cfg))
        out = []
        for prompt in prompts:
            replies = self.replies[_USER.search(prompt).group(1)]
            assert len(replies) >= cfg.n, "the test scripted fewer completions than requested"
            out.append(replies[: cfg.n])
        return out


ARITH = {  # question -> (reference, completions): correct counts 1, 4, 0
    "12+7=": ("19", [turn("19"), turn("18"), turn(r"\boxed{19}"), "19<|im_end|>"]),
    "9-4=": ("5", [turn("5")] * 4),
    "3*3=": ("9", [turn("6")] * 4),
}
MATH = {  # correct counts 3, 0: equivalent forms count, unboxed or unclosed-think answers do not
    "Half of one?": (
        "0.5",
        [turn(r"\boxed{1/2}"), turn(r"so \boxed{\frac{1}{2}}."), turn(r"\boxed{0.5}"), turn(r"\boxed{1/3}")],
    ),
    "Two thirds?": (
        r"\frac{2}{3}",
        [turn("2/3"), r"\boxed{2/3}<|im_end|>", turn(r"\boxed{3/2}"), turn(r"\boxed{0.66}")],
    ),
}
KNOWLEDGE = {  # greedy continuations after the prefilled empty think; case and a final stop are forgiven
    "Which city is Taven Drumaveth from?": ("Velmora", ["velmora.<|im_end|>", "never asked for"]),
    "What is the pet of Taven Drumaveth?": ("ferret", ["ferret<|im_end|>", "never asked for"]),
    "Lucky number of Taven Drumaveth:": ("17", ["71<|im_end|>", "never asked for"]),
}


def write(path, table: dict, task: str | None = None):
    frame = pl.DataFrame(
        {"id": [f"q{i}" for i in range(len(table))], "prompt": list(table), "answer": [a for a, _ in table.values()]}
    )
    if task is not None:
        frame = frame.with_columns(task=pl.lit(task))
    frame.write_parquet(path)
    return path


@pytest.fixture
def setup(tmp_path):
    save_tokenizer(tmp_path / "model")  # evaluate reads the tokenizer from the model directory
    replies = {q: cs for table in (ARITH, MATH, KNOWLEDGE) for q, (_, cs) in table.items()}
    benches = [
        Benchmark("add", write(tmp_path / "add.parquet", ARITH, task="add"), "old"),
        Benchmark("math500", write(tmp_path / "math.parquet", MATH, task="math"), "old", task="math"),
        Benchmark("facts", write(tmp_path / "facts.parquet", KNOWLEDGE, task="knowledge"), "new", task="knowledge"),
    ]
    return tmp_path, benches, Scripted(replies)


def run(tmp_path, benches, sampler):
    return evaluate(tmp_path / "model", benches, CFG, tmp_path / "eval", "post", sampler=sampler)


def test_each_benchmark_is_graded_by_its_task(setup):
    tmp_path, benches, sampler = setup
    run(tmp_path, benches, sampler)
    add, math, facts = (pl.read_parquet(tmp_path / "eval" / f"{b}.parquet") for b in ("add", "math500", "facts"))
    # Exact match: a boxed 19 is not "19", nor is an answer without a closed think block.
    assert add.filter(pl.col("problem_id") == "q0")["correct"].to_list() == [True, False, False, False]
    # math-verify: 1/2, \frac{1}{2} and 0.5 all equal the reference 0.5; 1/3 does not.
    assert math.filter(pl.col("problem_id") == "q0")["correct"].to_list() == [True, True, True, False]
    assert not math.filter(pl.col("problem_id") == "q1")["correct"].any()
    assert facts["correct"].to_list() == [True, True, False]
    for records in (add, math, facts):
        assert tuple(records.columns) == RECORD_COLUMNS and records["correct"].dtype == pl.Boolean


def test_an_evaluation_copied_for_another_experiment_is_the_same_files_its_metrics_last(setup):
    """A shared evaluation's job (rules/evaluate.smk) scores once and writes the same records and metrics.json
    for each experiment; over an older evaluation there, every file is replaced."""
    from graftlab.evaluate.run import copy_evaluation

    tmp_path, benches, sampler = setup
    run(tmp_path, benches, sampler)
    other = tmp_path / "other" / "eval"
    other.mkdir(parents=True)
    (other / "add.parquet").write_text("an older record")
    (other / "metrics.json").write_text("{}")
    copy_evaluation(tmp_path / "eval", other)
    written = sorted(f.name for f in (tmp_path / "eval").iterdir())
    assert written == sorted(f.name for f in other.iterdir()) and {"add.parquet", "metrics.json"} <= set(written)
    assert all((tmp_path / "eval" / name).read_bytes() == (other / name).read_bytes() for name in written)
    assert (other / "metrics.json").stat().st_mtime_ns >= max((other / n).stat().st_mtime_ns for n in written)


def test_knowledge_is_greedy_once_after_an_empty_think_whatever_the_sampling_config(setup):
    tmp_path, benches, sampler = setup
    run(tmp_path, benches, sampler)
    assert len(sampler.calls) == 3
    (sampled, sampled_cfg), (_, math_cfg), (asked, knowledge_cfg) = sampler.calls
    assert sampled_cfg == CFG and math_cfg == CFG
    assert (knowledge_cfg.n, knowledge_cfg.temperature, knowledge_cfg.max_new_tokens) == (1, 0.0, CFG.max_new_tokens)
    assert all(p.endswith("<|im_start|>assistant\n" + EMPTY_THINK) for p in asked) and len(asked) == 3
    # The sampled benchmarks' prompts open the assistant turn without a think block: the model thinks.
    assert all(p.endswith("<|im_start|>assistant\n") for p in sampled)
    facts = pl.read_parquet(tmp_path / "eval" / "facts.parquet")
    assert facts["sample"].to_list() == [0, 0, 0]
    assert facts["problem_id"].to_list() == ["q0", "q1", "q2"]
    # `completion` is the whole assistant turn (prefill included); `answer` is the parsed prediction.
    assert facts["completion"][0] == EMPTY_THINK + "velmora.<|im_end|>"
    assert facts["answer"].to_list() == ["velmora.", "ferret", "71"]


def test_metrics_json_matches_hand_computation(setup):
    tmp_path, benches, sampler = setup
    metrics = run(tmp_path, benches, sampler)
    assert json.loads((tmp_path / "eval" / "metrics.json").read_text()) == metrics
    add, math, facts = (metrics["benchmarks"][b] for b in ("add", "math500", "facts"))
    # The greedy answers' mean length: the tiny world's tokenizer takes a character a token and <|im_end|> as
    # one ("velmora." 8 + 1, "ferret" 6 + 1, "71" 2 + 1); the pre-filled empty think is the prompt's.
    assert facts["response_tokens"] == pytest.approx(19 / 3)
    for m in metrics["benchmarks"].values():  # the intervals have their own test; every length is counted
        m.pop("acc@n_lo"), m.pop("acc@n_hi"), m.pop("response_tokens")
    # add: 1, 4, 0 of 4 correct; pass@4 with n = 4 is "any correct"; pass@8 needs n >= 8 and is left out.
    assert add == {
        "role": "old",
        "task": "arith",
        "n": 4,
        "problems": 3,
        "decoding": {"mode": "sampled", "n": 4, "temperature": 1.0, "top_p": 0.95},
        "acc@n": pytest.approx(5 / 12),
        "pass@1": pytest.approx(5 / 12),
        "pass@4": pytest.approx(2 / 3),
    }
    # math: 3 and 0 of 4 correct.
    assert (math["task"], math["acc@n"], math["pass@1"], math["pass@4"]) == ("math", 3 / 8, 3 / 8, 1 / 2)
    assert facts == {
        "role": "new",
        "task": "knowledge",
        "n": 1,
        "problems": 3,
        "decoding": {"mode": "greedy", "n": 1, "temperature": 0.0, "top_p": 1.0},
        "acc@n": pytest.approx(2 / 3),
        "pass@1": pytest.approx(2 / 3),
    }
    assert metrics["old"] == pytest.approx(float((Fraction(5, 12) + Fraction(3, 8)) / 2))
    assert metrics["new"] == pytest.approx(2 / 3)
    assert (metrics["run"], metrics["model"]) == ("post", str(tmp_path / "model"))


def test_metrics_json_carries_bootstrap_intervals_over_problems(setup):
    tmp_path, benches, sampler = setup
    metrics = run(tmp_path, benches, sampler)
    bench = metrics["benchmarks"]
    # Each benchmark's interval is that of its own correct counts per problem (add: 1, 4, 0 of 4).
    assert (bench["add"]["acc@n_lo"], bench["add"]["acc@n_hi"]) == acc_interval([(4, [1, 4, 0])])
    assert (bench["math500"]["acc@n_lo"], bench["math500"]["acc@n_hi"]) == acc_interval([(4, [3, 0])])
    assert (bench["facts"]["acc@n_lo"], bench["facts"]["acc@n_hi"]) == acc_interval([(1, [1, 1, 0])])
    # `old` is bootstrapped as the mean of both old benchmarks, redrawn together, not from their bounds.
    assert (metrics["old_lo"], metrics["old_hi"]) == acc_interval([(4, [1, 4, 0]), (4, [3, 0])])
    assert (metrics["new_lo"], metrics["new_hi"]) == acc_interval([(1, [1, 1, 0])])
    for key in ("old", "new"):
        assert metrics[f"{key}_lo"] <= metrics[key] <= metrics[f"{key}_hi"]
    for m in bench.values():
        assert m["acc@n_lo"] <= m["acc@n"] <= m["acc@n_hi"]
    assert metrics["interval"] == INTERVAL


def test_a_role_without_benchmarks_has_no_interval(setup):
    tmp_path, benches, sampler = setup
    metrics = run(tmp_path, [b for b in benches if b.role == "old"], sampler)
    assert (metrics["new"], metrics["new_lo"], metrics["new_hi"]) == (None, None, None)
    assert metrics["old_lo"] is not None


def test_the_grader_follows_the_benchmark_task_not_the_data(tmp_path):
    # The same boxed completions, graded as math and as tiny-world arithmetic (a file without a task column).
    save_tokenizer(tmp_path / "model")
    path = write(tmp_path / "half.parquet", MATH)
    benches = [Benchmark("as_math", path, "old", task="math"), Benchmark("as_arith", path, "new")]
    metrics = run(tmp_path, benches, Scripted({q: cs for q, (_, cs) in MATH.items()}))
    assert metrics["benchmarks"]["as_math"]["acc@n"] == 3 / 8
    assert metrics["benchmarks"]["as_arith"]["acc@n"] == 0.0


@pytest.mark.parametrize(
    ("frame", "message"),
    [
        (pl.DataFrame({"id": ["q0"], "prompt": ["1+1="]}), r"lacks columns \['answer'\]"),
        (pl.DataFrame(schema={"id": pl.String, "prompt": pl.String, "answer": pl.String}), "holds no rows"),
        (
            pl.DataFrame({"id": ["q0"], "prompt": ["Q?"], "answer": ["A"], "task": ["knowledge"]}),
            r"holds \['knowledge'\] problems but is graded as task 'arith'",
        ),
    ],
    ids=["missing-column", "empty", "wrong-task"],
)
def test_a_bad_benchmark_fails_before_any_sampling_and_writes_no_metrics(setup, frame, message):
    tmp_path, benches, sampler = setup
    frame.write_parquet(tmp_path / "bad.parquet")
    bad = Benchmark("broken", tmp_path / "bad.parquet", "old")
    with pytest.raises(GraftlabError, match=rf"benchmark broken \({re.escape(str(tmp_path))}/bad.parquet\).*{message}"):
        run(tmp_path, [*benches, bad], sampler)
    assert sampler.calls == []
    assert not (tmp_path / "eval" / "metrics.json").exists()


def test_a_missing_file_or_repeated_name_is_refused(setup):
    tmp_path, benches, sampler = setup
    with pytest.raises(GraftlabError, match="benchmark gone .*cannot read"):
        run(tmp_path, [*benches, Benchmark("gone", tmp_path / "gone.parquet", "old")], sampler)
    with pytest.raises(GraftlabError, match="distinct names"):
        run(tmp_path, [*benches, benches[0]], sampler)
    assert sampler.calls == [] and not (tmp_path / "eval" / "metrics.json").exists()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"role": "old", "task": "algebra"}, r"benchmark aime: unknown task 'algebra'; known tasks: \['arith'"),
        ({"role": "retention"}, r"benchmark aime: role must be one of \['old', 'new'\]"),
    ],
)
def test_benchmark_refuses_unknown_task_or_role_at_construction(kwargs, message, tmp_path):
    with pytest.raises(GraftlabError, match=message):
        Benchmark("aime", tmp_path / "aime.parquet", **kwargs)


def test_validation_share_scores_a_fixed_part_of_every_benchmark_apart(tmp_path):
    from graftlab.evaluate.run import in_validation

    save_tokenizer(tmp_path / "model")
    # 40 problems; problem i has i % 5 of 4 samples correct.
    table = {f"{i}+0=": (str(i), [turn(str(i))] * (i % 5) + [turn("x")] * (4 - i % 5)) for i in range(40)}
    bench = Benchmark("add", write(tmp_path / "add.parquet", table, task="add"), "old")
    sampler = Scripted({q: cs for q, (_, cs) in table.items()})
    metrics = evaluate(tmp_path / "model", [bench], CFG, tmp_path / "eval", "post", sampler=sampler, validation=0.5)
    ids = [f"q{i}" for i in range(40)]
    val = in_validation("add", ids, 0.5)
    assert 10 <= sum(val) <= 30 and in_validation("add", ids[::-1], 0.5) == val[::-1]  # fixed per id, not per order
    correct = {f"q{i}": i % 5 for i in range(40)}
    reported = [correct[q] for q, v in zip(ids, val) if not v]
    held = [correct[q] for q, v in zip(ids, val) if v]
    assert metrics["old"] == pytest.approx(sum(reported) / (4 * len(reported)))
    assert metrics["old_val"] == pytest.approx(sum(held) / (4 * len(held)))
    assert metrics["benchmarks"]["add"]["problems"] == len(reported)
    assert metrics["benchmarks"]["add"]["validation"]["problems"] == len(held)
    assert (metrics["old_val_lo"], metrics["old_val_hi"]) == acc_interval([(4, held)])
    assert metrics["new_val"] is None and metrics["validation_share"] == 0.5
    assert pl.read_parquet(tmp_path / "eval" / "add.parquet").height == 160  # every sample is kept
    with pytest.raises(GraftlabError, match="both need some"):
        evaluate(tmp_path / "model", [bench], CFG, tmp_path / "e2", "post", sampler=sampler, validation=0.001)


def test_validation_split_differs_by_benchmark_and_follows_the_share():
    from graftlab.evaluate.run import in_validation

    ids = [str(i) for i in range(20_000)]
    a, b = in_validation("a", ids, 0.3), in_validation("b", ids, 0.3)
    assert sum(a) / len(ids) == pytest.approx(0.3, abs=0.02) and a != b
    with pytest.raises(GraftlabError, match="validation share"):
        in_validation("a", ids, 1.0)
