"""How far each model of a continual experiment moved in its outputs (`graftlab.planning.chains`): response drift,
and KL from the starting model set against forgetting.

    results/{exp}/response_drift.parquet   cosine between the post model's and each model's response to the
                                           same prompt, both embedded by the post model (per run, benchmark,
                                           problem), `graftlab.analysis.response_drift`
    results/{exp}/response_quantiles.parquet  its mean and 5% / 10% quantiles per run and benchmark
    results/{exp}/response_drift.png       their distributions, a violin per run
    results/{exp}/kl_forgetting.parquet    per model and kept checkpoint (`step`: an earlier one of an on-policy
                                           stage): on its stage's new-task prompts, `kl_reverse` = KL(model ||
                                           post) from its own samples and `kl_forward` = KL(post || model) from
                                           the post model's (Monte Carlo, each with its `_se`), its mean old-task
                                           forgetting, and per direction the fit forgetting = a + b KL and its
                                           residual (`graftlab.analysis.kl_forgetting`)
    results/{exp}/kl_forgetting.png        forgetting against each KL with its fit, and the residuals

A run is `method@stage` (`sdpo:frozen@2`). The post model itself enters the fit at KL 0 and no forgetting.
"""

import json
from pathlib import Path

import polars as pl

from graftlab.analysis.continual_results import method_names
from graftlab.analysis.kl_forgetting import DIRECTIONS, draw, fit_kl_forgetting, kl_on, plot_kl_forgetting
from graftlab.analysis.response_drift import plot_similarity, response_similarity, similarity_quantiles
from graftlab.io.atomic import atomic_file


def _write(frame: pl.DataFrame, path) -> None:
    with atomic_file(Path(path)) as tmp:
        frame.write_parquet(tmp)


def old_forgetting(metrics: dict, base: dict) -> float | None:
    """Mean forgetting max(-(acc - acc0) / acc0, 0) over the old benchmarks where the post model scores
    above 0 (`graftlab.analysis.continual`'s, from one model's metrics.json); None where there is none."""
    values = [
        max(-(m["acc@n"] - base[b]["acc@n"]) / base[b]["acc@n"], 0.0)
        for b, m in metrics["benchmarks"].items()
        if m["role"] == "old" and base.get(b, {}).get("acc@n")
    ]
    return sum(values) / len(values) if values else None


def kl_frame(post_dir: str, models: list[dict], prompts: dict[int, tuple[list[str], str]], cfg: dict) -> pl.DataFrame:
    """Both KLs of each model against the post model on its stage's prompts ({stage: (prompts, task)}) beside
    its old-task forgetting: `kl_reverse` from the model's own samples, `kl_forward` from the post model's
    (drawn once a stage, the same for every model); cfg: samples, max_new_tokens, seed."""
    base = json.loads((Path(cfg["post_eval_dir"]) / "metrics.json").read_text())["benchmarks"]
    zero = {f"kl_{d}{end}": 0.0 for d in DIRECTIONS for end in ("", "_se")}
    rows = [{"method": "post", "stage": 0, "step": None, "forgetting": 0.0} | zero]
    args = lambda stage: (*prompts[stage], cfg["samples"], cfg["max_new_tokens"], cfg["seed"])  # noqa: E731
    post, post_drawn = None, {}
    for m in models:
        model, drawn = draw(m["model"], *args(m["stage"]))
        if m["stage"] not in post_drawn:
            # The post model as its first draw loaded it (float32, on the device the models sample on).
            loaded, post_drawn[m["stage"]] = draw(post_dir, *args(m["stage"]))
            post = loaded if post is None else post
        kl = {"reverse": kl_on(model, post, drawn), "forward": kl_on(post, model, post_drawn[m["stage"]])}
        metrics = json.loads((Path(m["eval_dir"]) / "metrics.json").read_text())
        keys = {k: m[k] for k in ("method", "stage", "step")}
        values = {f"kl_{d}{end}": kl[d][f"kl{end}"] for d in DIRECTIONS for end in ("", "_se")}
        rows.append(keys | values | {"forgetting": old_forgetting(metrics, base)})
        said = ", ".join(f"{d} {kl[d]['kl']:.4f} +- {kl[d]['kl_se']:.4f}" for d in DIRECTIONS)
        print(f"KL {m['method']} stage {m['stage']} step {m['step']}: {said}", flush=True)
    return pl.DataFrame(rows, schema_overrides={"step": pl.Int64, "forgetting": pl.Float64})


def write_probes(
    post_dir, post_eval_dir, benchmarks: list[dict], chains: list[dict], checkpoints: list[dict], cfg: dict, out: dict
) -> None:
    """`benchmarks`: [{name, path, task, stage}] (stage None for an old benchmark); `chains`: as
    `graftlab.analysis.continual_results.write_continual_results` takes them, each stage with its `model`;
    `checkpoints`: the earlier kept checkpoints of on-policy stages ([{chain, stage, step, eval_dir, model}]),
    which enter KL against forgetting; `cfg`: response_prompts, kl_prompts, samples, max_new_tokens, seed;
    `out`: paths `responses`, `quantiles`, `responses_png`, `kl`, `kl_png`."""
    names = dict(zip((c["chain"] for c in chains), method_names(chains)))
    models = [
        {
            "method": names[chain["chain"]],
            "stage": s["stage"],
            "step": None,
            "eval_dir": s["eval_dir"],
            "model": s["model"],
        }
        for chain in chains
        for s in chain["stages"]
    ]
    runs = {f"{m['method']}@{m['stage']}": m["eval_dir"] for m in models}
    similarity = response_similarity(post_dir, benchmarks, post_eval_dir, runs, cfg["response_prompts"])
    _write(similarity, out["responses"])
    _write(similarity_quantiles(similarity), out["quantiles"])
    plot_similarity(similarity, out["responses_png"], order=list(runs))
    prompts = {
        b["stage"]: (pl.read_parquet(b["path"])["prompt"].head(cfg["kl_prompts"]).to_list(), b["task"])
        for b in benchmarks
        if b["stage"] is not None
    }
    scored = models + [{"method": names[c["chain"]]} | c for c in checkpoints]
    frame, fits = kl_frame(post_dir, scored, prompts, cfg | {"post_eval_dir": post_eval_dir}), []
    for direction in DIRECTIONS:
        fits.append(fit_kl_forgetting(frame, direction))
        frame = fits[-1]["frame"]
    _write(frame, out["kl"])
    plot_kl_forgetting(frame, fits, out["kl_png"])
