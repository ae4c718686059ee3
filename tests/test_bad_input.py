"""The bad-input suite (issue 18): what a new user gets wrong, across the command line, the workflow config
and data sets. Each case must end in a non-zero exit (or a GraftlabError / ConfigError), one line that
names the offending file, key, tensor or row, no traceback, and no output that looks complete: the output
path stays absent, or unchanged when it existed.

Each case builds its bad input in a scratch directory from a shared trio of pico models, then runs one
`graftlab` command in-process (`graftlab.commands.cli.main`) or the library function the workflow calls. Two run
as real processes, to show what a user's terminal shows.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import polars as pl
import pytest
import torch
from conftest import build_pico_model, graft_args
from safetensors.torch import load_file, save_file

from graftlab.commands.cli import main
from graftlab.errors import GraftlabError
from graftlab.fisher import write_fisher
from graftlab.planning.config import ConfigError, resolve

WEIGHT = "model.layers.0.mlp.up_proj.weight"
VOCAB = 32  # the pico models' vocabulary
IDS = pl.List(pl.Int64)


@pytest.fixture(scope="module")
def models(tmp_path_factory, world_pico) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bad-input-models")
    made = {"post": build_pico_model(root / "post", seed=1), "donor": build_pico_model(root / "donor", seed=2)}
    made["tuned"] = build_pico_model(root / "tuned", seed=3, base=made["donor"], noise=0.01)
    for role, seed in (("post", 4), ("donor", 5)):
        made[f"bf16_{role}"] = build_pico_model(root / f"bf16_{role}", seed=seed, dtype=torch.bfloat16)
    made["bf16_tuned"] = build_pico_model(
        root / "bf16_tuned", seed=6, dtype=torch.bfloat16, base=made["bf16_donor"], noise=0.01
    )
    made["wide"] = build_pico_model(root / "wide", seed=7, hidden_size=24)
    rollouts = root / "rollouts.parquet"
    pl.DataFrame({"prompt_ids": [[1, 2, 3]] * 4, "completion_ids": [[4, 5]] * 4}).write_parquet(rollouts)
    made["fisher"] = root / "fisher"
    write_fisher("diag", made["post"], rollouts, made["fisher"])
    made["world"] = world_pico  # a tokenizer with a chat template: what SFT needs
    return made


@dataclass
class Ctx:
    """A case's scratch directory and the shared models; helpers build bad copies of them."""

    tmp: Path
    models: dict[str, Path]

    def copy(self, role: str, name: str | None = None) -> Path:
        return Path(shutil.copytree(self.models[role], self.tmp / (name or f"bad_{role}")))

    def poisoned(self, role: str, tensor: str = WEIGHT, value: float = math.nan, index: int = 3) -> Path:
        """A copy of model `role` with one element of `tensor` set to `value` (NaN by default)."""
        out = self.copy(role)
        weights = load_file(out / "model.safetensors")
        weights[tensor].view(-1)[index] = value
        save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
        return out

    def graft(self, post="post", donor="donor", tuned="tuned", scale="0.5", extra: tuple = ()) -> list[str]:
        paths = [self.models[m] if isinstance(m, str) else m for m in (post, donor, tuned)]
        return ["graft", *graft_args(*paths, scale, self.out), *extra]

    def without_config(self, role: str) -> Path:
        out = self.copy(role)
        (out / "config.json").unlink()
        return out

    def table(self, columns: dict) -> Path:
        pl.DataFrame(columns).write_parquet(self.tmp / "table.parquet")
        return self.tmp / "table.parquet"

    def rollouts(self, prompt_ids, completion_ids, typed: bool = False) -> Path:
        path = self.tmp / "rollouts.parquet"
        schema = {"prompt_ids": IDS, "completion_ids": IDS} if typed else None
        frame = pl.DataFrame({"prompt_ids": prompt_ids, "completion_ids": completion_ids}, schema=schema)
        frame.write_parquet(path)
        return path

    def fisher(self, rollouts: Path, model: Path | None = None) -> list[str]:
        model = model or self.models["post"]
        return ["fisher", "--model", str(model), "--rollouts", str(rollouts), "--out", str(self.out)]

    def problems(self, rows: list[dict], name: str = "candidates.parquet") -> Path:
        pl.DataFrame(rows, schema={"id": pl.String, "prompt": pl.String, "answer": pl.String}).write_parquet(
            self.tmp / name
        )
        return self.tmp / name

    @property
    def out(self) -> Path:
        return self.tmp / "out"


def _sft(ctx: Ctx, model: Path | None = None, *extra: str, data: dict | None = None, out: Path | None = None):
    """`graftlab sft` of the world's pico model (or `model`) on one example (or the columns `data`)."""
    path = ctx.tmp / "sft.parquet"
    pl.DataFrame(data or {"prompt": ["1+1="], "completion": ["2"]}).write_parquet(path)
    model = model or ctx.models["world"]
    argv = ["sft", "--model", str(model), "--data", str(path), "--lr", "1e-3", "--steps", "1"]
    return [*argv, "--out", str(out or ctx.out), *extra]


def _without_template(ctx: Ctx) -> Path:
    """A copy of the world's pico model whose tokenizer has no chat template, as a pre-training checkpoint."""
    model = ctx.copy("world", "no_template")
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    for file in model.glob("chat_template.*"):
        file.unlink()
    return model


def _truncated(ctx: Ctx) -> list[str]:
    donor = ctx.copy("donor")
    raw = (donor / "model.safetensors").read_bytes()
    (donor / "model.safetensors").write_bytes(raw[: len(raw) // 2])
    return ctx.graft(donor=donor)


def _garbage_weights(ctx: Ctx, content: bytes) -> list[str]:
    tuned = ctx.copy("tuned")
    (tuned / "model.safetensors").write_bytes(content)
    return ctx.graft(tuned=tuned)


def _no_config(ctx: Ctx) -> list[str]:
    return ctx.graft(donor=ctx.without_config("donor"))


def _tokenizers(ctx: Ctx) -> list[str]:
    # Same size, other ids: a graft would add up the embedding rows of different tokens.
    post, tuned = ctx.copy("post"), ctx.copy("tuned")
    vocab = {f"t{i}": i for i in range(VOCAB)}
    swapped = vocab | {"t0": 1, "t1": 0}
    for model, v in ((post, vocab), (ctx.copy("donor"), vocab), (tuned, swapped)):
        (model / "tokenizer.json").write_text(json.dumps({"model": {"type": "WordLevel", "vocab": v}}))
    return ctx.graft(post=post, donor=ctx.tmp / "bad_donor", tuned=tuned)


def _foreign_out(ctx: Ctx, command: Callable[[Ctx], list[str]]) -> list[str]:
    ctx.out.mkdir()
    (ctx.out / "thesis.tex").write_text("years of work\n")
    return command(ctx)


def _out_is_file(ctx: Ctx) -> list[str]:
    ctx.out.write_text("not a directory\n")
    return ctx.graft()


def _missing_shard(ctx: Ctx) -> list[str]:
    donor = ctx.copy("donor")
    names = list(load_file(donor / "model.safetensors"))
    index = {"metadata": {}, "weight_map": {n: "model-00002-of-00002.safetensors" for n in names}}
    (donor / "model.safetensors.index.json").write_text(json.dumps(index))
    return ctx.graft(donor=donor)


def _overflow(ctx: Ctx) -> list[str]:
    # Every input finite, the result not: tuned - donor = 3e38 - (-3e38) overflows fp32.
    donor, tuned = ctx.poisoned("donor", value=-3e38), ctx.poisoned("tuned", value=3e38)
    return ctx.graft(donor=donor, tuned=tuned, scale="1")


def _masked_nan(ctx: Ctx) -> None:
    """A projection that zeroes the whole update would hide the donor's NaN from the output."""
    from graftlab.graft import graft

    def zero(name: str, delta: torch.Tensor) -> torch.Tensor:
        return delta.zero_()

    graft(ctx.models["post"], ctx.poisoned("donor"), ctx.models["tuned"], 0.5, ctx.out, project=zero)


def _dataset(ctx: Ctx, file: str, content: str, **source) -> None:
    from graftlab.tasks.sources import ProblemSource, write_problems

    (ctx.tmp / file).write_text(content)
    src = ProblemSource("aime", str(ctx.tmp / file), **source)
    write_problems(src, ctx.out, ctx.tmp / "out.json")


def _mine(ctx: Ctx, rows: list[dict], benchmark: list[dict] | None = None) -> None:
    from graftlab.synth.mining import MiningConfig, mine

    candidates = ctx.problems(rows)
    benchmarks = [ctx.problems(benchmark, "benchmark.parquet")] if benchmark else []
    cfg = MiningConfig(samples=1, max_pass_rate=0.5, heldout=1, temperature=1.0, max_new_tokens=4)
    mine(ctx.models["post"], candidates, cfg, ctx.out, ctx.tmp / "heldout.parquet", benchmark_files=benchmarks)


def _benchmark(ctx: Ctx, rows: list[dict]) -> None:
    from graftlab.evaluate.run import Benchmark, read_problems

    read_problems(Benchmark("b", ctx.problems(rows, "b.parquet"), "new"))


def _evaluate(ctx: Ctx, model: Path) -> None:
    from graftlab.evaluate.run import Benchmark, evaluate
    from graftlab.sampling import SamplingConfig

    bench = Benchmark("b", ctx.problems([_row(0), _row(1)], "b.parquet"), "new")
    evaluate(model, [bench], SamplingConfig(1, 0.0, 1.0, 4, 0), ctx.out, "run")


def _retention(ctx: Ctx, rows: list[dict]) -> None:
    from graftlab.fisher.rollouts import problems_from_file

    path = ctx.tmp / "prompts.parquet"
    pl.DataFrame([{**r, "task": "arith"} for r in rows]).write_parquet(path)
    problems_from_file(path, 1, 0, [])


def _config(overlay: dict) -> Callable[[Ctx], None]:
    def run(ctx: Ctx) -> None:
        resolve(json.loads(json.dumps(overlay)))

    return run


def _row(i: int, answer: str = "42", prompt: str | None = None) -> dict:
    return {"id": f"p{i}", "prompt": prompt or f"What is {i} * 6?", "answer": answer}


STAGE = {"domain": "alg", "data": "star", "problems": {"source": "alg.jsonl"}, "benchmark": {"source": "alg.jsonl"}}

# (case id, build: Ctx -> argv of `graftlab` or None after calling the library, words the message must hold)
CASES = [
    # Non-finite weights: refused in any input, naming the model and the tensor.
    ("graft-donor-nan", lambda c: c.graft(donor=c.poisoned("donor")), ["donor model", WEIGHT, "NaN or Inf"]),
    (
        "graft-post-inf",
        lambda c: c.graft(post=c.poisoned("post", "model.norm.weight", math.inf)),
        ["post model", "model.norm.weight", "--allow-nonfinite"],
    ),
    (
        "graft-tuned-nan-bf16-fused-kernel",
        lambda c: c.graft("bf16_post", "bf16_donor", c.poisoned("bf16_tuned")),
        ["donor_tuned model", WEIGHT, "1 NaN or Inf"],
    ),
    (
        "graft-post-nan-scale-0",
        lambda c: c.graft(post=c.poisoned("post", "lm_head.weight"), scale="0"),
        ["post model", "lm_head.weight"],
    ),
    (
        "graft-donor-nan-row-blocks",
        lambda c: c.graft(donor=c.poisoned("donor", "model.embed_tokens.weight", index=500), extra=("--chunk-mb", "0")),
        ["donor model", "model.embed_tokens.weight", "rows 31-31"],
    ),
    ("graft-overflow", _overflow, [WEIGHT, "overflows F32", "inputs being finite"]),
    ("graft-projected-donor-nan", _masked_nan, ["donor model", WEIGHT]),
    (
        "graft-masked-donor-inf",
        lambda c: c.graft(
            donor=c.poisoned("donor", value=-math.inf),
            extra=("--mask", "diag", "--fisher", str(c.models["fisher"]), "--rho", "0.5"),
        ),
        ["donor model", WEIGHT, "1 NaN or Inf"],
    ),
    # Unreadable or truncated model files, mismatched models.
    ("graft-truncated-safetensors", _truncated, ["bad_donor/model.safetensors", "truncated"]),
    ("graft-text-as-safetensors", lambda c: _garbage_weights(c, b"these are not weights\n"), ["bad_tuned/model"]),
    (
        "graft-header-not-json",
        lambda c: _garbage_weights(c, (16).to_bytes(8, "little") + b"{not json at all"),
        ["bad_tuned/model.safetensors", "not valid JSON"],
    ),
    ("graft-no-config-json", _no_config, ["donor model", "bad_donor", "no config.json"]),
    ("graft-other-architecture", lambda c: c.graft(donor="wide"), ["donor", "shape difference", "[32, 24]"]),
    ("graft-tokenizers-differ", _tokenizers, ["donor_tuned", "tokenizer.json", "other ids"]),
    ("graft-missing-model", lambda c: c.graft(post=c.tmp / "nowhere"), ["model directory not found", "nowhere"]),
    ("graft-index-names-missing-shard", _missing_shard, ["model-00002-of-00002.safetensors", "does not exist"]),
    ("graft-nan-scale", lambda c: c.graft(scale="nan"), ["--scale", "must be finite"]),
    # Output directories graftlab did not write.
    ("graft-out-foreign-dir", lambda c: _foreign_out(c, Ctx.graft), ["--out", "graftlab.json"]),
    ("graft-out-is-a-file", _out_is_file, ["--out", "not a directory"]),
    (
        "fisher-out-foreign-dir",
        lambda c: _foreign_out(c, lambda c: c.fisher(c.rollouts([[1, 2]], [[3]]))),
        ["--out", "graftlab.json"],
    ),
    ("sft-out-foreign-dir", lambda c: _foreign_out(c, _sft), ["--out", "graftlab.json"]),
    # Rollouts of the Fisher: ids, types, unreadable files; its model.
    (
        "fisher-token-beyond-vocabulary",
        lambda c: c.fisher(c.rollouts([[1, 2], [3, 4]], [[5], [6, VOCAB]])),
        ["rollouts", "row 1 completion_ids", "vocabulary size 32"],
    ),
    (
        "fisher-negative-token-id",
        lambda c: c.fisher(c.rollouts([[1, -2]], [[5]])),
        ["row 0 prompt_ids", "negative token id"],
    ),
    (
        "fisher-not-parquet",
        lambda c: c.fisher(Path(shutil.copy(c.models["post"] / "config.json", c.tmp / "r.parquet"))),
        ["rollouts", "r.parquet", "cannot read"],
    ),
    (
        "fisher-ids-as-text",
        lambda c: c.fisher(c.rollouts(["1 2"], ["3"])),
        ["column prompt_ids is String", "not lists of integer token ids"],
    ),
    (
        "fisher-ids-as-floats",
        lambda c: c.fisher(c.rollouts([[1.0, 2.5]], [[3.0]])),
        ["prompt_ids", "not lists of integer token ids"],
    ),
    (
        "fisher-null-completion",
        lambda c: c.fisher(c.rollouts([[1], [2]], [[3], None])),
        ["row 1 completion_ids", "null"],
    ),
    (
        "fisher-empty-completion",
        lambda c: c.fisher(c.rollouts([[1]], [[]], typed=True)),
        ["row 0", "no completion tokens"],
    ),
    (
        "fisher-missing-column",
        lambda c: c.fisher(c.table({"prompt_ids": [[1]]})),
        ["lacks columns", "completion_ids"],
    ),
    ("fisher-nan-model", lambda c: c.fisher(c.rollouts([[1]], [[2]]), c.poisoned("post")), ["model", WEIGHT, "NaN"]),
    (
        "fisher-no-config-json",
        lambda c: c.fisher(c.rollouts([[1]], [[2]]), c.without_config("post")),
        ["bad_post", "no config.json"],
    ),
    ("sft-nan-start-model", lambda c: _sft(c, c.poisoned("world")), ["--model", WEIGHT, "NaN or Inf"]),
    # Data sets.
    (
        "dataset-bad-jsonl",
        lambda c: _dataset(c, "aime.jsonl", '{"problem": "1+1", "answer": 2}\n{"problem": \n'),
        ["dataset aime", "aime.jsonl", "cannot read"],
    ),
    (
        "dataset-bad-json",
        lambda c: _dataset(c, "aime.json", "[{'problem': 'single quotes'}]"),
        ["dataset aime", "aime.json", "cannot read"],
    ),
    (
        "dataset-text-as-parquet",
        lambda c: _dataset(c, "aime.parquet", "problem,answer\n1+1,2\n"),
        ["dataset aime", "aime.parquet", "cannot read"],
    ),
    (
        "dataset-duplicate-ids",
        lambda c: _dataset(
            c,
            "aime.jsonl",
            '{"n": 1, "problem": "a", "answer": 1}\n{"n": 1, "problem": "b", "answer": 2}\n',
            columns={"prompt": "problem", "answer": "answer", "id": "n"},
        ),
        ["dataset aime", "id column 'n'", "repeated"],
    ),
    (
        "dataset-empty-answers",
        lambda c: _dataset(
            c,
            "aime.jsonl",
            '{"problem": "1+1", "answer": ""}\n{"problem": "2+2", "answer": 4}\n',
            on_unparsable="error",
        ),
        ["dataset aime", "1 of 2 rows", "empty or unparsable"],
    ),
    (
        "mining-empty-answer",
        lambda c: _mine(c, [_row(0), _row(1, answer=" ")]),
        ["mining candidates", "row 1 (id 'p1')", "empty answer"],
    ),
    (
        "mining-duplicate-ids",
        lambda c: _mine(c, [_row(0), _row(1), {**_row(2), "id": "p0"}]),
        ["mining candidates", "id 'p0' repeats", "rows [0, 2]"],
    ),
    (
        "mining-benchmark-leak",
        lambda c: _mine(c, [_row(0), _row(1), _row(2)], [{**_row(9), "prompt": "  What is 2 *\n6?"}]),
        ["row 2 (id 'p2')", "benchmark.parquet", "leaks the benchmark"],
    ),
    # The workflow config: what the schema cannot say.
    (
        "config-infinite-lam",
        _config({"experiments": {"x": {"graft": {"lam": ["0.5", "1e400"]}}}}),
        ["experiments.x.graft.lam", "['1e400'] are not finite"],
    ),
    (
        "config-learning-rate-above-one",
        _config({"experiments": {"x": {"grpo": {"lr": ["1e-3", "2"]}}}}),
        ["experiments.x.grpo.lr", "['2']: a learning rate must be at most 1.0"],
    ),
    (
        "config-zero-learning-rate",
        _config({"experiments": {"x": {"sft": {"lr": ["0"]}}}}),
        ["experiments.x.sft.lr", "must be positive"],
    ),
    (
        "config-lr-spelled-twice",
        _config({"experiments": {"x": {"opsd": {"lr": ["1e-4", "0.0001"]}}}}),
        ["experiments.x.opsd.lr", "['0.0001', '1e-4'] are one value spelled twice"],
    ),
    (
        "config-problems-are-a-benchmark",
        _config(
            {
                "experiments": {
                    "x": {
                        "problems": {"source": "data/aime.jsonl"},
                        "benchmarks": {"aime": {"source": "data/aime.jsonl"}},
                        "fisher": {"prompts": {"source": "data/r.jsonl"}},
                    }
                }
            }
        ),
        ["experiments.x.problems", "experiments.x.benchmarks.aime", "leak"],
    ),
    (
        "config-stage-trains-on-its-benchmark",
        _config({"experiments": {"x": {"stages": [STAGE]}}}),
        ["experiments.x.stages.0.problems", "experiments.x.stages.0.benchmark", "leak"],
    ),
    (
        "config-misspelt-key",
        _config({"experiments": {"x": {"graft": {"lamda": ["0.5"]}}}}),
        ["experiments.x.graft", "'lamda' was unexpected"],
    ),
]


def _argv(*words: str) -> Callable[[Ctx], list[str]]:
    """A case whose command line is `words`, `{out}` and `{tmp}` filled in, `{post}`... the shared models."""
    return lambda c: [w.format(out=c.out, tmp=c.tmp, **c.models) for w in words]


def _flag(command: str, flag: str, value: str) -> Callable[[Ctx], list[str]]:
    """`command`'s sound command line with `flag` set to `value`."""
    sound = {
        "graft": lambda c: c.graft(),
        "fisher": lambda c: c.fisher(c.rollouts([[1, 2]], [[3]])),
        "drift": _argv("drift", "--base", "{post}", "--model", "{tuned}", "--out", "{out}"),
        "plan": _argv("plan", "--disk-free", "1e6"),
        "sft": _sft,
    }[command]
    return lambda c: [*sound(c), f"{flag}={value}"]  # "-1e-3" alone would read as a flag


def _rollouts_too_long(ctx: Ctx) -> list[str]:
    return ctx.fisher(ctx.rollouts([[1] * 40], [[2] * 30]))  # 70 tokens, the pico models attend over 64


def _config_file(ctx: Ctx, text: str) -> list[str]:
    (ctx.tmp / "run.yaml").write_text(text)
    return ["plan", "--configfile", str(ctx.tmp / "run.yaml"), "--disk-free", "1e6"]


# Numbers on the command line: finite and in range, whatever the flag (a usage error, exit status 2).
NUMBERS = [
    ("graft", "--scale", "inf", "must be finite"),
    ("graft", "--scale", "-1", "must be >= 0"),
    ("graft", "--scale", "half", "must be a number"),
    ("graft", "--chunk-mb", "-1", "must be >= 0"),
    ("graft", "--chunk-mb", "2.5", "whole number"),
    ("graft", "--threads", "0", "must be >= 1"),
    ("fisher", "--batch-size", "0", "must be >= 1"),
    ("fisher", "--max-dim", "-3", "must be >= 1"),
    ("fisher", "--threads", "1.5", "whole number"),
    ("drift", "--k", "0", "must be >= 1"),
    ("drift", "--share", "0", "must be > 0"),
    ("drift", "--share", "nan", "must be finite"),
    ("drift", "--share", "1.5", "must be <= 1"),
    ("drift", "--threads", "638138", "must be <="),  # more than the cores: set as torch's, it crashed the process
    ("plan", "--mfu", "0", "must be > 0"),
    ("plan", "--mfu", "nan", "must be finite"),
    ("plan", "--decode-mfu", "2", "must be <= 1"),
    ("plan", "--kv-utilisation", "-0.5", "must be > 0"),
    ("plan", "--gpu-flops", "-inf", "must be finite"),
    ("plan", "--gpu-memory-gb", "0", "must be > 0"),
    ("plan", "--jobs", "0", "must be >= 1"),
    ("plan", "--prompt-tokens", "-5", "must be >= 1"),
    ("plan", "--temp-grafts", "1e3", "whole number"),
    ("plan", "--kept", "1.01", "must be <= 1"),
    ("plan", "--disk-free", "nan", "must be finite"),
    ("sft", "--lr", "inf", "must be finite"),
    ("sft", "--lr", "0", "must be > 0"),
    ("sft", "--lr", "-1e-3", "must be > 0"),
    ("sft", "--lr", "6.5e37", "must be <= 1.0"),  # AdamW's arithmetic overflowed float32: a traceback
    ("sft", "--steps", "0", "must be >= 1"),
    ("sft", "--batch-size", "-2", "must be >= 1"),
    ("sft", "--micro-batch-size", "0", "must be >= 1"),
    ("sft", "--micro-batch-size", "big", "must be a number"),
    ("sft", "--seed", "-1", "must be >= 0"),
    ("sft", "--threads", "nan", "must be finite"),
]
CASES += [
    (f"{command}{flag}={value}", _flag(command, flag, value), [flag, words]) for command, flag, value, words in NUMBERS
]

CASES += [
    # Options that mean nothing without another, or contradict it.
    ("graft-rho-without-mask", _flag("graft", "--rho", "0.5"), ["--rho", "only mean something with --mask"]),
    ("graft-fisher-without-mask", lambda c: [*c.graft(), "--fisher", str(c.models["fisher"])], ["--fisher", "--mask"]),
    ("graft-mask-without-fisher", _flag("graft", "--mask", "diag"), ["--mask diag needs --fisher"]),
    ("graft-mask-scope-without-mask", _flag("graft", "--mask-scope", "tensor"), ["--mask-scope", "give --mask"]),
    ("fisher-kfac-option-of-diag", _flag("fisher", "--max-dim", "64"), ["--max-dim", "another --kind than diag"]),
    ("fisher-ekfac-of-diag", lambda c: [*c.fisher(c.rollouts([[1]], [[2]])), "--ekfac"], ["--ekfac", "--kind"]),
    ("sft-epochs-and-steps", _flag("sft", "--epochs", "2"), ["exactly one of --epochs and --steps"]),
    (
        "sft-micro-batch-not-dividing",
        lambda c: [*_sft(c), "--batch-size", "4", "--micro-batch-size", "3"],
        ["micro_batch_size", "3"],
    ),
    (
        "sft-epoch-dirs-with-steps",
        lambda c: [*_sft(c), "--epoch-dirs"],
        ["--epoch-dirs needs --epochs"],
    ),
    # Command lines argparse refuses: one line too, not its usage block.
    ("unknown-command", _argv("grfat"), ["invalid choice", "grfat"]),
    ("graft-misspelt-flag", lambda c: [*c.graft(), "--scal", "1"], ["unrecognized arguments", "--scal"]),
    ("fisher-flag-given-dashes", lambda c: [*c.fisher(c.rollouts([[1]], [[2]])), "--batch-size=--"], ["--batch-size"]),
    ("graft-missing-flag", _argv("graft", "--post", "{post}", "--out", "{out}"), ["required", "--donor"]),
    ("fisher-unknown-kind", lambda c: [*c.fisher(c.rollouts([[1]], [[2]])), "--kind", "full"], ["--kind", "full"]),
    # Outputs that are inputs: the command would replace what it reads.
    ("sft-out-is-model", lambda c: _sft(c, c.copy("world"), out=c.tmp / "bad_world"), ["--out", "is --model"]),
    (
        "sft-out-inside-model",
        lambda c: _sft(c, c.copy("world"), out=c.tmp / "bad_world" / "tuned"),
        ["--out", "lies inside --model"],
    ),
    ("sft-out-is-data", lambda c: _sft(c, out=c.tmp / "sft.parquet"), ["--out", "is --data"]),
    ("graft-out-is-post", lambda c: c.graft(post=c.copy("post", "out")), ["--out", "is --post"]),
    ("graft-out-is-tuned", lambda c: c.graft(tuned=c.copy("tuned", "out")), ["--out", "is --donor-tuned"]),
    (
        "graft-out-holds-post",
        lambda c: c.graft(post=Path(shutil.copytree(c.models["post"], c.out / "post"))),
        ["--out", "holds --post"],
    ),
    (
        "fisher-out-is-model",
        lambda c: (
            ["fisher", "--model", str(c.copy("post", "out")), "--rollouts", str(c.rollouts([[1]], [[2]]))]
            + ["--out", str(c.out)]
        ),
        ["--out", "is --model"],
    ),
    (
        "drift-out-is-model",
        lambda c: (
            ["drift", "--base", str(c.models["post"]), "--model", str(c.copy("tuned", "out"))] + ["--out", str(c.out)]
        ),
        ["--out", "is --model"],
    ),
    # SFT's table: text in both columns, every row, within the model's context.
    (
        "sft-null-completion",
        lambda c: _sft(c, data={"prompt": ["a", "b"], "completion": ["x", None]}),
        ["row 1 completion is null"],
    ),
    (
        "sft-empty-completion",
        lambda c: _sft(c, data={"prompt": ["a"], "completion": [""]}),
        ["row 0 completion is empty"],
    ),
    ("sft-blank-prompt", lambda c: _sft(c, data={"prompt": ["a", " \n"], "completion": ["x", "y"]}), ["row 1 prompt"]),
    (
        "sft-numbers-as-completion",
        lambda c: _sft(c, data={"prompt": ["a"], "completion": [2]}),
        ["completion is Int64"],
    ),
    ("sft-no-completion-column", lambda c: _sft(c, data={"prompt": ["a"]}), ["SFT data", "lacks columns"]),
    (
        "sft-no-rows",
        lambda c: _sft(
            c, data={"prompt": pl.Series([], dtype=pl.String), "completion": pl.Series([], dtype=pl.String)}
        ),
        ["SFT data", "holds no rows"],
    ),
    (
        "sft-longer-than-context",
        lambda c: _sft(c, data={"prompt": ["1+" * 200], "completion": ["2"]}),
        ["context of 256"],
    ),
    (
        "sft-data-missing",
        lambda c: [*_sft(c)[:4], str(c.tmp / "nowhere.parquet"), *_sft(c)[5:]],
        ["SFT data", "nowhere"],
    ),
    ("fisher-longer-than-context", _rollouts_too_long, ["rollouts", "row 0", "70 tokens", "context of 64"]),
    # Model directories: a tokenizer with a chat template where the command formats chats; weights whole.
    ("sft-no-chat-template", lambda c: _sft(c, _without_template(c)), ["no chat template", "--chat-template-from"]),
    (
        "sft-template-from-template-less",
        lambda c: _sft(c, None, "--chat-template-from", str(_without_template(c))),
        ["--chat-template-from", "no chat template"],
    ),
    ("sft-no-tokenizer", lambda c: _sft(c, c.copy("post")), ["--model", "no usable tokenizer"]),
    ("evaluate-no-chat-template", lambda c: _evaluate(c, _without_template(c)), ["model", "no chat template"]),
    ("sft-model-missing", lambda c: _sft(c, c.tmp / "nowhere"), ["--model", "nowhere", "not found"]),
    ("sft-no-config-json", lambda c: _sft(c, c.without_config("world")), ["--model", "no config.json"]),
    (
        "drift-model-nan",
        lambda c: _argv("drift", "--base", "{post}", "--model", str(c.poisoned("post")), "--out", "{out}")(c),
        ["model", WEIGHT, "NaN"],
    ),
    (
        "drift-base-inf",
        lambda c: _argv(
            "drift", "--base", str(c.poisoned("post", value=math.inf)), "--model", "{post}", "--out", "{out}"
        )(c),
        ["base", WEIGHT, "NaN or Inf"],
    ),
    (
        "drift-base-missing",
        _argv("drift", "--base", "{tmp}/nowhere", "--model", "{post}", "--out", "{out}"),
        ["base", "nowhere", "not found"],
    ),
    (
        "drift-no-config-json",
        lambda c: _argv("drift", "--base", "{post}", "--model", str(c.without_config("tuned")), "--out", "{out}")(c),
        ["model", "no config.json"],
    ),
    (
        "fisher-model-missing",
        lambda c: c.fisher(c.rollouts([[1]], [[2]]), c.tmp / "nowhere"),
        ["model", "nowhere", "not found"],
    ),
    # Config files `graftlab plan` reads as Snakemake would.
    (
        "plan-configfile-not-yaml",
        lambda c: _config_file(c, "experiments:\n  x: [\n"),
        ["--configfile", "run.yaml", "not valid JSON or YAML"],
    ),
    (
        "plan-configfile-a-list",
        lambda c: _config_file(c, "- 1\n- 2\n"),
        ["--configfile", "run.yaml", "keys at top level"],
    ),
    (
        "plan-configfile-missing",
        _argv("plan", "--configfile", "{tmp}/nowhere.yaml"),
        ["--configfile", "nowhere.yaml", "no such file"],
    ),
    ("plan-config-override-unparsable", _argv("plan", "--config", "=3"), ["--config =3", "valid identifier"]),
    (
        "plan-configfile-nan-lam",
        lambda c: _config_file(c, "experiments:\n  x:\n    graft:\n      lam: [.nan]\n"),
        ["experiments.x.graft.lam"],
    ),
    (
        "plan-configfile-inf-rate",
        lambda c: _config_file(c, "experiments:\n  x:\n    sft:\n      lr: ['inf']\n"),
        ["experiments.x.sft.lr.0", "'inf' is invalid"],
    ),
    # Problem tables the workflow samples: a prompt in every row.
    (
        "benchmark-null-prompt",
        lambda c: _benchmark(c, [_row(0), {**_row(1), "prompt": None}]),
        ["benchmark b", "row 1 prompt is null"],
    ),
    (
        "benchmark-blank-prompt",
        lambda c: _benchmark(c, [_row(0), _row(1, prompt="   ")]),
        ["benchmark b", "row 1 prompt is empty"],
    ),
    (
        "retention-prompts-empty-prompt",
        lambda c: _retention(c, [_row(0), _row(1, prompt="\t")]),
        ["retention prompts", "row 1 prompt is empty"],
    ),
    ("inspect-results-missing", _argv("inspect", "{tmp}/nowhere/results"), ["nowhere"]),
    (
        "inspect-configfile-not-yaml",
        lambda c: ["inspect", str(c.tmp), *_config_file(c, "experiments: [\n")[1:3]],
        ["--configfile", "run.yaml", "not valid JSON or YAML"],
    ),
    (
        "inspect-configfile-nan",
        lambda c: [
            "inspect",
            str(c.tmp),
            *_config_file(c, "experiments:\n  x:\n    eval:\n      temperature: .nan\n")[1:3],
        ],
        ["experiments.x.eval.temperature", "not a finite number"],
    ),
    ("inspect-config-override-unparsable", _argv("inspect", "{tmp}", "--config", "=3"), ["--config =3"]),
]

# The cases refused for their command line (exit status 2); every other CLI case for its data (1).
USAGE = {f"{command}{flag}={value}" for command, flag, value, _ in NUMBERS} | {
    "graft-nan-scale",
    "graft-out-foreign-dir",
    "graft-out-is-a-file",
    "fisher-out-foreign-dir",
    "sft-out-foreign-dir",
    "graft-rho-without-mask",
    "graft-fisher-without-mask",
    "graft-mask-without-fisher",
    "graft-mask-scope-without-mask",
    "fisher-kfac-option-of-diag",
    "fisher-ekfac-of-diag",
    "sft-epochs-and-steps",
    "sft-micro-batch-not-dividing",
    "sft-epoch-dirs-with-steps",
    "unknown-command",
    "graft-misspelt-flag",
    "fisher-flag-given-dashes",
    "graft-missing-flag",
    "fisher-unknown-kind",
    "sft-out-is-model",
    "sft-out-inside-model",
    "sft-out-is-data",
    "graft-out-is-post",
    "graft-out-is-tuned",
    "graft-out-holds-post",
    "fisher-out-is-model",
    "drift-out-is-model",
    "plan-config-override-unparsable",
    "inspect-config-override-unparsable",
}


def _snapshot(path: Path) -> dict[str, bytes] | None:
    """What lies at `path`: None when nothing, else every file's bytes by relative name."""
    if not path.exists():
        return None
    if path.is_file():
        return {"": path.read_bytes()}
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(("case", "build", "words"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_clear_line_and_leaves_nothing(capsys, tmp_path, models, case, build, words):
    ctx = Ctx(tmp_path, models)
    capsys.readouterr()
    argv = None
    try:
        argv = build(ctx)
    except (GraftlabError, ConfigError) as err:  # a library case: the workflow's jobs see this
        message = str(err)
    else:
        assert argv is not None, "a library case must raise"
        before = _snapshot(ctx.out)
        capsys.readouterr()
        assert main(argv) == (2 if case in USAGE else 1)
        err = capsys.readouterr().err
        assert err.startswith("graftlab: error: ") and err.count("\n") == 1, err
        message = err
        assert _snapshot(ctx.out) == before
    assert "\n" not in message.strip() and "Traceback" not in message, message
    for word in words:
        assert word in message, message
    assert not ctx.out.exists() or argv is not None  # a library case never leaves its output
    assert not list(tmp_path.glob(".out.*")), "a temporary sibling of the output was left behind"


def test_at_least_a_hundred_cases_including_the_three_reported():
    ids = [c[0] for c in CASES]
    assert len(ids) == len(set(ids)) >= 100
    assert {"graft-donor-nan", "fisher-token-beyond-vocabulary", "fisher-not-parquet"} <= set(ids)
    assert USAGE <= set(ids)


def test_allow_nonfinite_grafts_nan_through(capsys, tmp_path, models):
    # The opt-in writes exactly what the arithmetic gives: the NaN where the donor held it, and says so.
    ctx = Ctx(tmp_path, models)
    argv = ctx.graft(donor=ctx.poisoned("donor"), extra=("--allow-nonfinite",))
    assert main(argv) == 0
    out = load_file(ctx.out / "model.safetensors")[WEIGHT].view(-1)
    assert torch.isnan(out[3]) and torch.isfinite(torch.cat([out[:3], out[4:]])).all()
    assert json.loads((ctx.out / "graftlab.json").read_text())["params"]["allow_nonfinite"] is True


def test_rerun_into_graftlabs_own_output_is_allowed(tmp_path, models):
    ctx = Ctx(tmp_path, models)
    assert main(ctx.graft()) == 0
    assert main(ctx.graft(scale="1")) == 0  # graftlab.json marks it as a graft: replaced
    assert json.loads((ctx.out / "graftlab.json").read_text())["params"]["scale"] == 1.0


@pytest.mark.parametrize(
    ("build", "line"),
    [
        (
            lambda c: c.graft(donor=c.poisoned("donor")),
            "donor model {tmp}/bad_donor: tensor " + WEIGHT + " holds 1 NaN or Inf value(s)",
        ),
        (
            lambda c: c.fisher(c.rollouts([[1, 2]], [[5, 99]])),
            "rollouts ({tmp}/rollouts.parquet): row 0 completion_ids holds a token id >= the model's "
            "vocabulary size 32",
        ),
    ],
    ids=["graft-donor-nan", "fisher-token-beyond-vocabulary"],
)
def test_a_real_process_prints_one_line_and_no_traceback(tmp_path, models, build, line):
    argv = build(Ctx(tmp_path, models))
    done = subprocess.run([sys.executable, "-m", "graftlab", *argv], capture_output=True, text=True)
    assert done.returncode == 1
    errors = [text for text in done.stderr.splitlines() if text.startswith("graftlab: error: ")]
    assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr
    assert line.format(tmp=tmp_path) in errors[0]
    assert not (tmp_path / "out").exists()
