"""Response drift: how far a trained model's answers moved from the starting model's, as the starting model
itself reads them.

Each response is embedded as the starting model's mean-pooled last hidden state over the response tokens,
read after the prompt the response answered (formatted by the benchmark's task, as evaluation posed it).
For a fixed set of prompts per benchmark (the first `prompts_per_benchmark` problems in the benchmark's
order, sample 0 of each), the cosine between the starting model's own response and a run's response to
the same prompt says how much of the starting model's behaviour the run kept: 1 where it answers as the
starting model did, lower as its answers drift. The low tail (q05, q10) shows the prompts on which a
method rewrote its answers most, which a mean over mostly unchanged answers hides.

Reads the per-sample records evaluation wrote (`graftlab.evaluate.run`: `{benchmark}.parquet` in each
evaluated model's directory). Light to import: torch, transformers and matplotlib load inside functions.
"""

from pathlib import Path

import numpy as np
import polars as pl

from graftlab.errors import GraftlabError
from graftlab.io.atomic import atomic_file
from graftlab.io.tables import read_table, require_columns
from graftlab.tasks import EMPTY_THINK, Task, get_task

POOLED = "all"  # the `benchmark` of statistics over every benchmark together
SIMILARITY_SCHEMA = {"run": pl.Utf8, "benchmark": pl.Utf8, "problem_id": pl.Utf8, "cosine": pl.Float64}


def _load_encoder(model_dir):
    """The model's decoder stack in float32 (its last hidden state, no logits) and its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval().to(device)
    return model.get_decoder(), AutoTokenizer.from_pretrained(model_dir)


def _continuation(task: Task, turn: str) -> str:
    """What the model wrote after the chat prompt: records hold the whole assistant turn, and for a task
    that pre-fills an empty think block the chat prompt already holds it, so it must not be read twice."""
    return turn.removeprefix(EMPTY_THINK) if not task.thinking else turn


def _embed(encoder, tok, task: Task, prompts, responses, batch_size: int, where: str) -> np.ndarray:
    import torch

    if len(prompts) != len(responses):
        raise GraftlabError(f"{where}: {len(prompts)} prompts but {len(responses)} responses")
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    heads = [enc(task.chat_prompt(tok, p)) for p in prompts]
    tails = [enc(_continuation(task, r)) for r in responses]
    empty = [i for i, t in enumerate(tails) if not t]
    if empty:
        raise GraftlabError(f"{where}: responses {empty[:5]} are empty; a mean over no tokens is undefined")
    device = next(encoder.parameters()).device
    out = [np.zeros((0, encoder.config.hidden_size), np.float32)]
    for lo in range(0, len(heads), batch_size):
        part = list(zip(heads[lo : lo + batch_size], tails[lo : lo + batch_size]))
        width = max(len(h) + len(t) for h, t in part)
        ids = torch.zeros(len(part), width, dtype=torch.long)
        attn, pool = torch.zeros_like(ids), torch.zeros(len(part), width)
        for row, (h, t) in enumerate(part):
            # Right padding: a causal model's states at real positions never see the padding after them.
            ids[row, : len(h) + len(t)] = torch.tensor(h + t)
            attn[row, : len(h) + len(t)] = 1
            pool[row, len(h) : len(h) + len(t)] = 1
        with torch.inference_mode():
            hidden = encoder(input_ids=ids.to(device), attention_mask=attn.to(device)).last_hidden_state.float()
        pool = pool.to(device)
        out.append(((hidden * pool[..., None]).sum(1) / pool.sum(1, keepdim=True)).cpu().numpy())
    return np.concatenate(out).astype(np.float32)


def embed_responses(model_dir, prompts: list[str], responses: list[str], task: str, batch_size: int = 32) -> np.ndarray:
    """Each response as `model_dir`'s mean last hidden state over its own tokens, read after its prompt (the
    user turn, formatted by `task`'s chat prompt): float32 [N, hidden]. A response may be the whole
    assistant turn as evaluation records it; a pre-filled empty think block is not counted as response."""
    encoder, tok = _load_encoder(model_dir)
    return _embed(encoder, tok, get_task(task), prompts, responses, batch_size, f"model {model_dir}")


def _first_responses(eval_dir, bench: str, ids: list[str], where: str) -> list[str]:
    """Sample 0 of each problem in `ids`, from one evaluated model's records of `bench`."""
    path = Path(eval_dir) / f"{bench}.parquet"
    records = read_table(path, ("problem_id", "sample", "completion"), f"{where}, benchmark {bench}")
    first = records.filter(pl.col("sample") == 0)
    by_id = dict(zip(first["problem_id"].cast(pl.Utf8).to_list(), first["completion"].to_list()))
    missing = [pid for pid in ids if pid not in by_id]
    if missing:
        raise GraftlabError(f"{where}, benchmark {bench} ({path}): no sample 0 of problems {missing[:5]}")
    return [by_id[pid] for pid in ids]


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = a.astype(np.float64), b.astype(np.float64)
    cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    return np.clip(cos, -1.0, 1.0)  # rounding can put identical vectors a hair above 1


def _benchmark_similarity(encoder, tok, bench: dict, start_eval_dir, runs: dict, count: int, batch_size: int):
    """One benchmark's rows of `response_similarity`, as one frame per run."""
    name = bench["name"]
    if name == POOLED:
        raise GraftlabError(f"benchmark {name!r}: the name is reserved for statistics over all benchmarks")
    try:
        task = get_task(bench["task"])
    except GraftlabError as err:
        raise GraftlabError(f"benchmark {name}: {err}") from None
    problems = read_table(bench["path"], ("id", "prompt"), f"benchmark {name}").head(count)
    ids, prompts = problems["id"].cast(pl.Utf8).to_list(), problems["prompt"].to_list()

    def embed(eval_dir, where: str) -> np.ndarray:
        responses = _first_responses(eval_dir, name, ids, where)
        return _embed(encoder, tok, task, prompts, responses, batch_size, f"{where}, benchmark {name}")

    start = embed(start_eval_dir, f"starting model ({start_eval_dir})")  # once, for every run
    return [
        pl.DataFrame(
            {"run": label, "benchmark": name, "problem_id": ids, "cosine": _cosines(start, embed(d, f"run {label}"))}
        )
        for label, d in runs.items()
    ]


def response_similarity(
    start_dir,
    benchmarks: list[dict],
    start_eval_dir,
    runs: dict[str, str],
    prompts_per_benchmark: int = 32,
    batch_size: int = 32,
) -> pl.DataFrame:
    """Cosine, in the starting model's embedding (`embed_responses`), between the starting model's response
    and each run's response to the same prompt. `benchmarks`: dicts with `name`, `path` (the problems'
    parquet) and `task`; `start_eval_dir` and `runs` (label -> directory): evaluation directories. Rows
    `run`, `benchmark`, `problem_id` (as text), `cosine`, for the first `prompts_per_benchmark` problems
    of each benchmark (sample 0 of each)."""
    if prompts_per_benchmark < 1:
        raise GraftlabError(f"prompts_per_benchmark must be at least 1, got {prompts_per_benchmark}")
    encoder, tok = _load_encoder(start_dir)
    frames = [pl.DataFrame(schema=SIMILARITY_SCHEMA)]
    for bench in benchmarks:
        frames += _benchmark_similarity(encoder, tok, bench, start_eval_dir, runs, prompts_per_benchmark, batch_size)
    return pl.concat(frames, how="vertical_relaxed").cast(SIMILARITY_SCHEMA)


def similarity_quantiles(frame: pl.DataFrame) -> pl.DataFrame:
    """Per run and benchmark, and per run over every benchmark (`benchmark` = "all"): `n`, and the `mean`,
    `q05` and `q10` (linear interpolation, as numpy's default) of the cosine. Runs in order of appearance."""
    require_columns(frame, ("run", "benchmark", "cosine"), "response similarity")
    pooled = frame.with_columns(benchmark=pl.lit(POOLED))
    cos = pl.col("cosine")
    stats = [
        pl.len().alias("n"),
        cos.mean().alias("mean"),
        cos.quantile(0.05, "linear").alias("q05"),
        cos.quantile(0.10, "linear").alias("q10"),
    ]
    table = pl.concat([frame, pooled], how="vertical_relaxed").group_by("run", "benchmark", maintain_order=True)
    rank = {run: i for i, run in enumerate(frame["run"].unique(maintain_order=True).to_list())}
    # A stable sort by run alone keeps each run's benchmarks in their order, the pooled row last.
    return table.agg(stats).sort(pl.col("run").replace_strict(rank), maintain_order=True)


def _violins(ax, data: list[np.ndarray]) -> None:
    """One violin per run; a run whose cosines are all equal (e.g. 1: answers unchanged) has no density
    to draw, so it is a point. The mean is marked either way."""
    spread = [i for i, d in enumerate(data) if len(d) > 1 and np.ptp(d) > 0]
    if spread:
        ax.violinplot([data[i] for i in spread], positions=spread, showextrema=False, widths=0.8)
    for i, d in enumerate(data):
        if len(d) and i not in spread:
            ax.plot([i], [d[0]], "o", color="C0", markersize=4)
        if len(d):
            ax.plot([i - 0.2, i + 0.2], [d.mean()] * 2, color="k", linewidth=1)


def plot_similarity(frame: pl.DataFrame, out_png, order: list[str] | None = None) -> None:
    """Violins of the cosine per run (in `order`, else order of appearance; the black bar is the mean), one
    panel per benchmark and, with several, one pooled over all; written as a PNG, atomically."""
    from matplotlib.figure import Figure

    require_columns(frame, ("run", "benchmark", "cosine"), "response similarity")
    present = frame["run"].unique(maintain_order=True).to_list()
    runs = list(order) if order is not None else present
    unknown = sorted(set(runs) - set(present))
    if unknown:
        raise GraftlabError(f"plot_similarity: runs {unknown} of the order have no similarities; runs: {present}")
    benches = frame["benchmark"].unique(maintain_order=True).to_list()
    panels = [(b, frame.filter(pl.col("benchmark") == b)) for b in benches]
    panels += [(f"{POOLED} benchmarks", frame)] if len(benches) > 1 else []
    # A bare Figure renders through Agg without pyplot: no global backend is switched.
    fig = Figure(figsize=(max(6.0, 2.0 + 0.5 * len(runs)), 0.6 + 2.4 * len(panels)), layout="constrained")
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (title, part) in zip(axes, panels):
        _violins(ax, [part.filter(pl.col("run") == r)["cosine"].to_numpy() for r in runs])
        ax.set_title(title, fontsize=9)
        ax.set_ylabel("cosine to start", fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    axes[-1].set_xticks(range(len(runs)), runs, rotation=30, ha="right", fontsize=7)
    fig.suptitle("Response drift: each run's answer against the starting model's, in its embedding", fontsize=10)
    with atomic_file(out_png) as tmp:
        fig.savefig(tmp, dpi=150, format="png")
