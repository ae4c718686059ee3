"""The real-data path end to end: models named in config (local directories standing in for hub ids),
new-task problems, old benchmarks and retention prompts from local files, math graded by math-verify.
Nothing of the tiny world is built."""

import json

import polars as pl
import pytest
import yaml
from conftest import WHOLE_RUN, build_pico_model, in_background

from graftlab.analysis.pareto import data_title
from graftlab.planning.config import resolve
from graftlab.planning.layout import Experiment

pytestmark = pytest.mark.workflow


def math_rows(prefix: str, count: int, start: int = 2) -> list[dict]:
    return [
        {
            "problem": f"What is {a} + {a}?",
            "answer": str(2 * a),
            "solution": f"{a} and {a} make {2 * a}.",
            "uid": f"{prefix}{a}",
        }
        for a in range(start, start + count)
    ]


def write_data(root):
    rows = math_rows("p", 14) + [{"problem": "What is nothing?", "answer": "", "solution": "", "uid": "p-empty"}]
    pl.DataFrame(rows).write_ndjson(root / "problems.jsonl")
    pl.DataFrame(math_rows("b", 4, start=40)).write_parquet(root / "bench.parquet")
    pl.DataFrame(math_rows("r", 10, start=60)).write_ndjson(root / "retention.jsonl")


def write_models(root):
    from graftlab.world.tokenizer import build_tokenizer

    tok = build_tokenizer()
    for name, seed in (("post", 0), ("donor", 1)):
        build_pico_model(root / name, seed=seed, vocab_size=len(tok), max_position_embeddings=256)
        tok.save_pretrained(root / name)


def real_config(root) -> dict:
    source = lambda f, **kw: {"source": str(root / f), "columns": {"prompt": "problem", "answer": "answer", **kw}}  # noqa: E731
    return {
        "models": {"pico": {"source": str(root / "post")}, "pico-early": {"source": str(root / "donor")}},
        "experiments": {
            "real": {
                "post": "pico",
                "donors": ["pico-early"],
                "data": "expert",
                "problems": source("problems.jsonl", solution="solution", id="uid"),
                "benchmarks": {"sums": source("bench.parquet")},
                "mining": {"samples": 2, "max_pass_rate": 1.0, "heldout": 4, "max_new_tokens": 16},
                "sft": {"lr": ["1e-3"], "epochs": 1, "batch_size": 4},
                "graft": {"lam": ["1"], "masks": {"kinds": ["diag"], "rho": ["0.1"]}},
                "merge": {"lam": ["0.5"]},
                "fisher": {
                    "rollouts": 6,
                    "max_new_tokens": 16,
                    "batch_size": 4,
                    "prompts": source("retention.jsonl", id="uid"),
                },
                "eval": {"samples": 2, "max_new_tokens": 16},
            }
        },
    }


@in_background("real", __file__)
def real_run(root):
    write_data(root)
    write_models(root)
    (root / "config.yaml").write_text(yaml.safe_dump(real_config(root)))
    return WHOLE_RUN, (root / "config.yaml",)


@pytest.fixture(scope="module")
def real(background):
    """The run above, started in the background when the session started."""
    return background.wait("real")


def test_real_models_and_data_run_every_stage_without_the_tiny_world(real):
    from transformers import AutoModelForCausalLM

    assert not (real / "results/world").exists()
    AutoModelForCausalLM.from_pretrained(real / "resources/models/pico")
    summary = pl.read_parquet(real / "results/real/summary.parquet")
    assert {"post", "sft", "donor_sft", "graft", "merge"} <= set(summary["method"])
    assert "graft/pico-early/lr~1e-3/epoch~1/lam~1/mask~diag/rho~0.1" in summary["run"].to_list()
    assert (real / "results/real/pareto.png").stat().st_size > 0


def test_the_skipped_data_row_is_counted_in_the_summary(real):
    summary = pl.read_parquet(real / "results/real/summary.parquet")
    problems = Experiment.of(resolve(real_config(real)), "real").candidates()  # its data set, as read
    stats = json.loads((real / problems).with_suffix(".json").read_text())
    assert stats["skipped"]["empty"] == 1 and stats["kept"] == 14
    # 14 problems: 4 held out, 10 trained on, each with its written solution as the trace.
    assert summary["data_rows_skipped"].unique().to_list() == [1]
    assert summary["data_traces"].unique().to_list() == [10]
    assert data_title("real", summary) == "real (expert): 10 traces of 10 problems (1 data rows skipped)"


def test_benchmarks_are_graded_as_math_and_rollouts_use_the_retention_prompts(real):
    metrics = json.loads((real / "results/real/eval/post/metrics.json").read_text())
    assert {b: m["task"] for b, m in metrics["benchmarks"].items()} == {"sums": "math", "heldout": "math"}
    assert metrics["benchmarks"]["sums"]["problems"] == 4
    (home,) = (real / "results/fisher").iterdir()  # one post model, one retention home
    assert home.name.startswith("pico-")  # named by the model it is of: `post: pico`, fetched to resources/models/
    rollouts = pl.read_parquet(home / "rollouts.parquet")
    assert rollouts.height == 6 and set(rollouts["problem_id"]) <= {f"r{a}" for a in range(60, 70)}
