"""What each method's models cost: per-step seconds split into sampling and weight update (grafting paper
§7, Figure 8), and the compute each method spends to reach its best point of the Pareto frontier.

The seconds are measured inside the jobs around the work alone, without process start-up: SFT and OPSD
time every optimizer step (`steps.jsonl`), a graft times its mask and its sum (`seconds.json`), the
retention Fisher times its rollouts (`rollouts.json`) and its statistics (`{kind}/seconds.json`). A run is
charged everything that produced it, under `results/{exp}/`:

    sft/{base}/lr~L/epoch~e            the SFT steps of epochs 1..e                      update
    opsd/post/alpha~A/lr~L/step~S      OPSD steps 1..S                                   sampling + update
    grpo/post/lr~L/step~S              GRPO steps 1..S (and SDPO's likewise)             sampling + update
    graft/{donor}/lr~L/epoch~e/...     the donor's SFT steps of epochs 1..e, the graft,  update + graft
                                       and for a masked graft its Fisher, whole           + fisher

A Fisher serves every masked graft of its kind, yet reaching any one point needs it once, so each masked
graft is charged all of it. A method's best point is the point of its own frontier with the highest mean
of new- and old-task accuracy (ties: the cheaper); `latency.parquet` holds every run, so another choice is
a filter away.
"""

import json
from pathlib import Path
from typing import TYPE_CHECKING

import polars as pl

from graftlab.analysis.summary import pareto_front
from graftlab.io.atomic import atomic_file
from graftlab.methods import METHODS, on_policy
from graftlab.planning.layout import parse_run

if TYPE_CHECKING:
    from matplotlib.figure import Figure

COSTS = ("sample_s", "update_s", "graft_s", "fisher_s")
COST_LOOK = {
    "sample_s": ("sampling", "tab:orange"),
    "update_s": ("weight update", "tab:blue"),
    "graft_s": ("graft (mask + sum)", "tab:green"),
    "fisher_s": ("retention Fisher (rollouts + statistics)", "tab:gray"),
}
# The methods whose runs update the post model, each a contender for the cheapest good point.
METHOD_NAMES = {m.name: m.short for m in METHODS.values() if m.updates}
ON_POLICY = tuple(m.name for m in on_policy())


def _json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing ({what}); re-run the job that writes it")
    return json.loads(path.read_text())


def training_dir(run: str) -> str:
    """The training run's directory of an on-policy checkpoint's key: the key without its `step~S`."""
    return run.rsplit("/step~", 1)[0]


def read_steps(run_dir: str | Path) -> pl.DataFrame:
    """The `steps.jsonl` of one SFT or on-policy run: a row per optimizer step with its seconds."""
    path = Path(run_dir) / "steps.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing (per-step seconds of a training run); re-run that run")
    steps = pl.read_ndjson(path)
    missing = {"step", "sample_s", "update_s"} - set(steps.columns)
    if steps.is_empty() or missing:
        raise ValueError(f"{path}: no steps, or columns {sorted(missing)} missing")
    return steps


class Ledger:
    """The timing records under `results/{exp}/` (`root`), each file read once however many runs share it."""

    def __init__(self, root: str | Path, fishers: dict[str, str | Path] | None = None):
        # The post model's retention Fisher of each kind, whose retention home holds its rollouts.json
        # (`graftlab.planning.layout.Experiment.fisher_dir`): shared between experiments, so outside `root`.
        self.root, self.fishers, self._steps = Path(root), {k: Path(d) for k, d in (fishers or {}).items()}, {}

    def steps(self, run_dir: str) -> pl.DataFrame:
        if run_dir not in self._steps:
            self._steps[run_dir] = read_steps(self.root / run_dir)
        return self._steps[run_dir]

    def sft_to_epoch(self, base: str, lr: str, epoch: str) -> dict:
        steps = self.steps(f"sft/{base}/lr~{lr}")
        if "epoch" not in steps.columns or int(epoch) > steps["epoch"].max():
            raise ValueError(f"{self.root}/sft/{base}/lr~{lr}/steps.jsonl: no steps of epoch {epoch}; re-run that SFT")
        return {"update_s": steps.filter(pl.col("epoch") <= int(epoch))["update_s"].sum()}

    def on_policy_to_step(self, run: str, step: str) -> dict:
        """Sampling and update seconds of an on-policy run (its key with `step~S`) up to step S."""
        run_dir = training_dir(run)
        steps = self.steps(run_dir).filter(pl.col("step") <= int(step))
        if steps.height != int(step):
            raise ValueError(f"{self.root}/{run_dir}/steps.jsonl: {steps.height} of {step} steps")
        return {"sample_s": steps["sample_s"].sum(), "update_s": steps["update_s"].sum()}

    def fisher(self, kind: str) -> float:
        if kind not in self.fishers:
            raise ValueError(f"a graft masked by the {kind} Fisher, but no {kind} Fisher was given to charge it")
        rollouts = _json(self.fishers[kind].parent / "rollouts.json", "retention rollout statistics")
        fisher = _json(self.fishers[kind] / "seconds.json", f"seconds of the {kind} Fisher")
        return rollouts["sample_s"] + fisher["fisher_s"]

    def cost(self, run: str) -> dict[str, float]:
        """The seconds that produced `run`, by kind (`COSTS`)."""
        keys, cost = parse_run(run), dict.fromkeys(COSTS, 0.0)
        method = METHODS[keys["method"]]
        if method.on_policy:
            cost |= self.on_policy_to_step(run, keys["step"])
        elif "epoch" in method.keys:  # an SFT checkpoint, or a graft or merge of its update
            cost |= self.sft_to_epoch(keys["donor"], keys["lr"], keys["epoch"])
        if method.grafts:
            cost["graft_s"] = _json(self.root / run / "seconds.json", "seconds of this graft")["graft_s"]
            if keys["mask"] != "none":
                cost["fisher_s"] = self.fisher(keys["mask"])
        return cost


def run_costs(summary: pl.DataFrame, root: str | Path, fishers: dict | None = None) -> pl.DataFrame:
    """The summary's ids and scores with each run's compute (`COSTS`, `total_s`), whether it lies on its
    method's own frontier (`on_front`), and the method's best point (`best`); `fishers` as `Ledger`'s."""
    ledger = Ledger(root, fishers)
    costs = pl.DataFrame([ledger.cost(run) for run in summary["run"]], schema=dict.fromkeys(COSTS, pl.Float64))
    # The run's ids and keys (strings) and its old/new scores with their intervals; not every benchmark.
    scores = [c for c in ("old", "new", "old_lo", "old_hi", "new_lo", "new_hi") if c in summary.columns]
    keep = [c for c, dtype in summary.schema.items() if dtype == pl.String] + scores
    table = pl.concat([summary.select(keep), costs], how="horizontal")
    table = table.with_columns(total_s=pl.sum_horizontal(COSTS))
    fronts = [pareto_front(part) for _, part in table.group_by("method", maintain_order=True)]
    table = pl.concat(fronts).sort("run")
    score = (pl.col("new") + pl.col("old")) / 2
    contenders = table.filter(pl.col("on_front") & pl.col("method").is_in(list(METHOD_NAMES)))
    best = contenders.sort(score, pl.col("total_s"), descending=[True, False]).group_by("method").first()["run"]
    return table.with_columns(best=pl.col("run").is_in(best.implode()))


def per_batch(steps: pl.DataFrame) -> pl.DataFrame:
    """Seconds per optimizer step, each sampled batch's spread over the steps that use it: a step that
    reuses its batch (GRPO's and SDPO's `updates_per_batch` > 1) logs no sampling, and a median over such
    steps would hide the sampling. A run that never samples (SFT) keeps its steps as they are."""
    steps = steps.select("sample_s", "update_s")
    if not (steps["sample_s"] > 0).any():
        return steps
    batch = (pl.col("sample_s") > 0).cum_sum().alias("batch")
    return (
        steps.group_by(batch, maintain_order=True)
        .agg(pl.col("sample_s").mean(), pl.col("update_s").mean())
        .select("sample_s", "update_s")
    )


def step_latency(ledger_root: str | Path, runs: pl.DataFrame) -> pl.DataFrame:
    """Median seconds of one optimizer step, sampling and update, per method: each on-policy method (all
    its runs, over sampled batches: `per_batch`), SFT of post, and the donor SFT grafting trains with; and
    the median seconds of one graft, done once. Medians, since a run's first step also warms up and a short
    run has few steps to average it away."""
    ledger, rows = Ledger(ledger_root), []
    groups = {METHOD_NAMES[m]: {training_dir(r) for r in runs.filter(method=m)["run"]} for m in ON_POLICY} | {
        "SFT of post": {f"sft/post/lr~{r['lr']}" for r in runs.filter(method="sft").iter_rows(named=True)},
        "donor SFT (grafting)": {
            f"sft/{r['donor']}/lr~{r['lr']}" for r in runs.filter(method="graft").iter_rows(named=True)
        },
    }
    for name, dirs in groups.items():
        if dirs:
            steps = pl.concat([per_batch(ledger.steps(d)) for d in sorted(dirs)])
            rows.append(
                {
                    "what": name,
                    "count": steps.height,
                    "sample_s": steps["sample_s"].median(),
                    "update_s": steps["update_s"].median(),
                }
            )
    grafts = runs.filter(pl.col("method").is_in([m.name for m in METHODS.values() if m.grafts]))
    if grafts.height:
        rows.append(
            {"what": "graft (once)", "count": grafts.height, "sample_s": 0.0, "update_s": grafts["graft_s"].median()}
        )
    return pl.DataFrame(rows).with_columns(
        sampling_share=pl.col("sample_s") / (pl.col("sample_s") + pl.col("update_s"))
    )


def _stacked(ax, labels: list[str], parts: dict[str, list[float]]) -> None:
    bottom = [0.0] * len(labels)
    for cost, heights in parts.items():
        name, color = COST_LOOK[cost]
        if any(heights):
            ax.bar(labels, heights, bottom=bottom, color=color, label=name, width=0.6)
            bottom = [b + h for b, h in zip(bottom, heights)]
    ax.tick_params(axis="x", labelsize=8)
    ax.grid(axis="y", alpha=0.3)


def latency_figure(steps: pl.DataFrame, runs: pl.DataFrame, title: str | None = None) -> "Figure":
    """Left: the seconds of one step, sampling and update, per method (and of one graft). Right: each
    method's compute to its best frontier point, by kind, with that point's accuracies."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 5.4))
    left, right = fig.subplots(1, 2)
    _stacked(left, steps["what"].to_list(), {c: steps[c].to_list() for c in ("sample_s", "update_s")})
    for i, row in enumerate(steps.iter_rows(named=True)):
        if row["sample_s"] > 0:
            total = row["sample_s"] + row["update_s"]
            left.annotate(f"{row['sampling_share']:.0%} sampling", (i, total), ha="center", va="bottom", fontsize=8)
    left.set_ylabel("seconds per step (median)")
    left.set_title("One step: sampling vs weight update")
    left.legend(fontsize=8)
    best = runs.filter("best").with_columns(
        order=pl.col("method").replace_strict(list(METHOD_NAMES), range(len(METHOD_NAMES)))
    )
    best = best.sort("order")
    _stacked(right, [METHOD_NAMES[m] for m in best["method"]], {c: best[c].to_list() for c in COSTS})
    for i, row in enumerate(best.iter_rows(named=True)):
        right.annotate(
            f"new {row['new']:.2f}\nold {row['old']:.2f}", (i, row["total_s"]), ha="center", va="bottom", fontsize=8
        )
    right.set_ylabel("seconds to the point (sum over every step)")
    right.set_title("Compute to each method's best frontier point")
    right.margins(y=0.18)
    # Below the axes: inside, it would cover the accuracies written over the tallest bars.
    right.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def write_latency(
    summary_parquet, root, out_parquet, out_steps, out_png, title: str | None = None, fishers: dict | None = None
) -> pl.DataFrame:
    """`run_costs` and `step_latency` of an experiment as parquet, and their figure as PNG, each atomic."""
    runs = run_costs(pl.read_parquet(summary_parquet), root, fishers)
    steps = step_latency(root, runs)
    print(steps)
    print(runs.filter("best").select("method", "run", "new", "old", *COSTS, "total_s"))
    for frame, out in ((runs, out_parquet), (steps, out_steps)):
        with atomic_file(out) as tmp:
            frame.write_parquet(tmp)
    with atomic_file(out_png) as tmp:
        latency_figure(steps, runs, title).savefig(tmp, dpi=150, format="png")
    return runs
