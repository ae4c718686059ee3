"""KL against forgetting: how much a trained model forgot of the old tasks, set against how far its output
distribution moved from the starting model's, both ways (`DIRECTIONS`):

    reverse  KL(π ‖ π₀) = E_{y ~ π}[ log π(y|x) − log π₀(y|x) ]    on the trained model's own samples
    forward  KL(π₀ ‖ π) = E_{y ~ π₀}[ log π₀(y|x) − log π(y|x) ]   on the starting model's samples

each estimated by Monte Carlo: a response y (up to the end-of-turn token, or cut at `max_new_tokens`)
contributes the sum over its tokens of the two models' log-prob difference. The samples must be the
sampling model's own distribution for the estimate to be unbiased: temperature 1, no top-p and no top-k. A
cut response makes it the KL between the distributions of responses truncated at that length, the same for
every model compared. The reverse direction asks how unlikely the start finds what the model now says; the
forward one, how much of what the start said the model lost (the direction RL's Razor states its law in).

Across methods and stages, forgetting is fitted as a + b·KL by least squares, once per direction: a
method's residual is the forgetting its KL does not account for (above the line: it forgets more than its
distance from the starting model predicts).

Light to import: torch, transformers and matplotlib load inside functions.
"""

import math

import numpy as np
import polars as pl

from graftlab.errors import GraftlabError
from graftlab.io.atomic import atomic_file
from graftlab.io.tables import require_columns
from graftlab.tasks import get_task

FIT_COLUMNS = ("method", "stage", "forgetting")
# Each direction of the KL, as tables (`kl_<direction>`) and figures name it.
DIRECTIONS = {
    "reverse": "KL(model ‖ start), on the model's samples",
    "forward": "KL(start ‖ model), on the start's samples",
}


def _token_logprobs(model, prompts: list[list[int]], responses: list[list[int]]):
    """log π of each response token, float32 softmax, as float64 [rows, longest], zero past a response."""
    import torch

    from graftlab.sampling import response_logits

    logits, mask = response_logits(model, prompts, responses)
    ids = torch.zeros(mask.shape, dtype=torch.long, device=logits.device)
    for row, r in enumerate(responses):
        ids[row, : len(r)] = torch.tensor(r, device=logits.device)
    lp = torch.log_softmax(logits.float(), -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    return lp.double() * mask.double()


def log_ratios(model, start, samples: list[tuple[list[int], list[int]]], batch_size: int = 32) -> np.ndarray:
    """Per sample `(prompt_ids, response_ids)`: the sum over its response tokens of log π_model − log π_start,
    float64 [N]. Both models read the same ids, so they must share a vocabulary."""
    import torch

    out = [np.zeros(0)]
    for lo in range(0, len(samples), batch_size):
        prompts = [list(p) for p, _ in samples[lo : lo + batch_size]]
        responses = [list(r) for _, r in samples[lo : lo + batch_size]]
        with torch.inference_mode():
            diff = _token_logprobs(model, prompts, responses) - _token_logprobs(start, prompts, responses)
        out.append(diff.sum(1).cpu().numpy())
    return np.concatenate(out)


def _load_fp32(model_dir, device):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval().to(device)


def draw(
    model_dir,
    prompts: list[str],
    task: str,
    samples: int,
    max_new_tokens: int,
    seed: int,
    batch_size: int = 32,
    backend="transformers",
):
    """(the model at `model_dir` in float32, its `samples` responses per prompt at temperature 1 as
    (prompt_ids, response_ids)): the samples a KL is estimated on. `prompts` are user turns, posed by
    `task`'s chat prompt; `batch_size` sequences per forward pass; `backend` anything
    `graftlab.sampling.Engine.of` reads, transformers by default, since the fp32 scoring copies must fit
    beside it."""
    from transformers import AutoTokenizer

    from graftlab.sampling import Engine, SamplingConfig, load_sampler

    if samples < 1 or max_new_tokens < 1 or not prompts:
        raise GraftlabError(
            f"mc_kl of {model_dir}: needs prompts ({len(prompts)}), samples >= 1 ({samples}) and "
            f"max_new_tokens >= 1 ({max_new_tokens})"
        )
    tok = AutoTokenizer.from_pretrained(model_dir)
    posed = [get_task(task).chat_prompt(tok, p) for p in prompts]
    sampler = load_sampler(model_dir, Engine.of(backend, seed=seed))
    cfg = SamplingConfig(samples, 1.0, 1.0, max_new_tokens, seed, batch_size=max(1, batch_size // samples))
    drawn = [s for per_prompt in sampler.sample_ids(posed, cfg) for s in per_prompt]
    # transformers' sampler holds the model already: scored in float32, it needs no second copy.
    held = getattr(sampler, "model", None)
    return (held.float() if held is not None else _load_fp32(model_dir, "cuda")), drawn


def kl_on(sampler, other, drawn, batch_size: int = 32) -> dict:
    """KL(sampler ‖ other) on `drawn`, the sampling model's own samples (both models loaded, float32):
    `kl` (mean over samples), `kl_se` (its standard error; NaN from one sample), `samples` (their number
    N) and `tokens` (mean response length)."""
    if other.config.vocab_size != sampler.config.vocab_size:
        raise GraftlabError(
            f"mc_kl: {sampler.name_or_path} ({sampler.config.vocab_size} tokens) and {other.name_or_path} "
            f"({other.config.vocab_size}) do not share a vocabulary"
        )
    ratios = log_ratios(sampler, other, drawn, batch_size)
    n = len(ratios)
    return {
        "kl": float(ratios.mean()),
        "kl_se": float(ratios.std(ddof=1) / math.sqrt(n)) if n > 1 else math.nan,
        "samples": n,
        "tokens": float(np.mean([len(r) for _, r in drawn])),
    }


def mc_kl(
    model_dir,
    start_dir,
    prompts: list[str],
    task: str,
    samples: int,
    max_new_tokens: int,
    seed: int,
    batch_size: int = 32,
    backend="transformers",
) -> dict:
    """KL(model ‖ start) over `prompts` from `samples` responses per prompt drawn from `model_dir` (`draw`;
    the forward direction is the same call with the two swapped): as `kl_on` returns it."""
    model, drawn = draw(model_dir, prompts, task, samples, max_new_tokens, seed, batch_size, backend)
    return kl_on(model, _load_fp32(start_dir, next(model.parameters()).device), drawn, batch_size)


def fit_kl_forgetting(frame: pl.DataFrame, direction: str | None = None) -> dict:
    """Least squares forgetting = a + b·kl over the rows (one per evaluated model: `method`, `stage`, the
    KL column, `forgetting`) where both are finite. The KL column is `kl`, or with a `direction`
    (`DIRECTIONS`) `kl_<direction>`, and the columns written are suffixed alike. Returns `a`, `b`, `r2`
    (None when forgetting does not vary), `n` (rows fitted), `direction` and `frame`: the rows with
    `fitted` and `residual` (forgetting − fitted; null where a row was not fitted)."""
    if direction is not None and direction not in DIRECTIONS:
        raise GraftlabError(f"KL-forgetting fit: direction {direction!r}, expected one of {list(DIRECTIONS)}")
    end = "" if direction is None else f"_{direction}"
    require_columns(frame, (*FIT_COLUMNS, f"kl{end}"), "KL-forgetting table")
    x = frame[f"kl{end}"].cast(pl.Float64).fill_null(math.nan).to_numpy()
    y = frame["forgetting"].cast(pl.Float64).fill_null(math.nan).to_numpy()
    used = np.isfinite(x) & np.isfinite(y)
    if len(np.unique(x[used])) < 2:
        raise GraftlabError(
            f"KL-forgetting fit needs rows with at least two distinct KL values and a forgetting; "
            f"{int(used.sum())} of {frame.height} rows have both, with KL {sorted(set(x[used].tolist()))}"
        )
    design = np.stack([np.ones(int(used.sum())), x[used]], axis=1)
    (a, b), *_ = np.linalg.lstsq(design, y[used], rcond=None)
    fitted = a + b * x
    residual = np.where(used, y - fitted, math.nan)
    ss_res = float(np.sum(residual[used] ** 2))
    ss_tot = float(np.sum((y[used] - y[used].mean()) ** 2))
    out = frame.with_columns(
        pl.Series(f"fitted{end}", fitted, nan_to_null=True), pl.Series(f"residual{end}", residual, nan_to_null=True)
    )
    return {
        "a": float(a),
        "b": float(b),
        "r2": 1 - ss_res / ss_tot if ss_tot > 0 else None,
        "n": int(used.sum()),
        "direction": direction,
        "frame": out,
    }


def plot_kl_forgetting(frame: pl.DataFrame, fits: list[dict], out_png) -> None:
    """A row per fit (`fit_kl_forgetting`'s, one per direction): left, forgetting against that KL, a colour
    and marker per method, each point labelled with its stage, and the fitted line; right, the residuals.
    Each axis names its direction. Written as a PNG, atomically."""
    from matplotlib.figure import Figure

    # A bare Figure renders through Agg without pyplot: no global backend is switched.
    fig = Figure(figsize=(11.0, 4.4 * len(fits)), layout="constrained")
    axes = fig.subplots(len(fits), 2, squeeze=False)
    markers = "osD^vP*Xh<>"
    for (left, right), fit in zip(axes, fits, strict=True):
        direction = fit.get("direction")
        end = "" if direction is None else f"_{direction}"
        named = "KL" if direction is None else DIRECTIONS[direction]
        require_columns(frame, (*FIT_COLUMNS, f"kl{end}"), "KL-forgetting table")
        a, b = fit["a"], fit["b"]
        part_frame = frame.with_columns(residual=pl.col("forgetting") - (a + b * pl.col(f"kl{end}")))
        for i, method in enumerate(part_frame["method"].unique(maintain_order=True).to_list()):
            part = part_frame.filter(pl.col("method") == method)
            style = dict(color=f"C{i % 10}", marker=markers[i % len(markers)], label=str(method))
            left.scatter(part[f"kl{end}"].to_numpy(), part["forgetting"].to_numpy(), **style)
            right.scatter(part[f"kl{end}"].to_numpy(), part["residual"].to_numpy(), **style)
            for row in part.iter_rows(named=True):
                if row[f"kl{end}"] is not None and row["forgetting"] is not None:
                    left.annotate(
                        str(row["stage"]),
                        (row[f"kl{end}"], row["forgetting"]),
                        xytext=(3, 3),
                        textcoords="offset points",
                        fontsize=7,
                        color=style["color"],
                    )
        kl = part_frame[f"kl{end}"].drop_nulls().to_numpy()
        xs = np.linspace(min(0.0, float(np.nanmin(kl))), float(np.nanmax(kl)), 2) if len(kl) else np.zeros(0)
        r2 = "" if fit.get("r2") is None else f", r² = {fit['r2']:.2f}"
        left.plot(xs, a + b * xs, "k--", linewidth=1, label=f"{a:.3g} + {b:.3g}·KL{r2}")
        right.axhline(0.0, color="k", linewidth=0.8)
        label = f"{named}, nats per response"
        left.set(xlabel=label, ylabel="old-task forgetting", title=f"Forgetting vs {named.split(',')[0]}")
        right.set(xlabel=label, ylabel="forgetting − fit", title="Residuals")
        left.legend(fontsize=7)
    with atomic_file(out_png) as tmp:
        fig.savefig(tmp, dpi=150, format="png")
