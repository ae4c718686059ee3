"""Seconds of one optimizer step of SDPO and of GRPO against one of OPSD, sampling and update apart.

    python benchmarks/onpolicy_bench.py --steps 8 --repeats 3

All three run in this process through graftlab's trainers on the default world's model (config.yaml's
architecture, freshly initialised) with the schema's default sections: OPSD samples one response to each
of 8 problems; GRPO and SDPO sample 4 of each (32 responses). Their verifier passes a response of even
length, so about half the rollouts succeed: GRPO's groups mostly have a signal and SDPO finds a sibling
for most rollouts, the case in which each does all of its work (on a new task the post model never
solves, SDPO masks every rollout and GRPO's groups are flat, and both cost little more than sampling).
Each run's first step is left out (warm-up); the medians of the rest are taken, and the table gives the
run with the fastest total per method, the figure to quote on a shared machine.
"""

import argparse
import statistics
import tempfile
from pathlib import Path

import torch

from graftlab.synth.demonstrations import opsd_examples
from graftlab.tasks import TASKS, Task, arith, chat_completion
from graftlab.train.grpo import GrpoConfig, train_grpo
from graftlab.train.opsd import OpsdConfig, train_opsd
from graftlab.train.sdpo import SdpoConfig, train_sdpo
from graftlab.world import build
from graftlab.world.tokenizer import build_tokenizer


def post_model(root: Path) -> Path:
    import yaml

    from graftlab.planning.config import resolve

    config = resolve(yaml.safe_load((Path(__file__).parents[1] / "config.yaml").read_text()))
    tok = build_tokenizer()
    build.init_model(tok, config["world"]["model"], seed=0).save_pretrained(root / "post")
    tok.save_pretrained(root / "post")
    return root / "post"


def problems(count: int = 64):
    rows = arith.sample_problems("mul", count, "bench", 0)
    rl = [{"prompt": p["prompt"], "answer": p["answer"], "task": "coin"} for p in rows]
    import polars as pl

    frame = pl.DataFrame(
        [
            {
                "id": p["id"],
                "task": "mul",
                "prompt": p["prompt"],
                "completion": chat_completion(p["thinking"], p["answer"]),
            }
            for p in rows
        ]
    )
    return rl, opsd_examples(frame)


def run(method: str, post: Path, out: Path, steps: int) -> list[dict]:
    rl, demos = problems()
    if method == "OPSD":
        return train_opsd(post, demos, OpsdConfig(alpha=0.5, lr=1e-4, steps=steps, threads=2), out)
    if method == "GRPO":
        return train_grpo(post, rl, GrpoConfig(lr=1e-4, steps=steps, threads=2), out)
    return train_sdpo(post, rl, SdpoConfig(lr=1e-4, steps=steps, teacher="ema:0.05", cot=True, threads=2), out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    TASKS["coin"] = Task("coin", prompt=str, grade=lambda completion, answer: len(completion) % 2 == 0, reference=str)
    torch.set_num_threads(2)
    best: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        post = post_model(Path(tmp))
        for r in range(args.repeats):
            for method in ("OPSD", "GRPO", "SDPO-CoT"):
                log = run(method, post, Path(tmp) / f"{method}-{r}", args.steps)[1:]
                # SDPO and GRPO log the responses of the step; OPSD one per problem.
                row = {
                    "sample_s": statistics.median(s["sample_s"] for s in log),
                    "update_s": statistics.median(s["update_s"] for s in log),
                    "responses": 8 if method == "OPSD" else 32,
                }
                row["total_s"] = row["sample_s"] + row["update_s"]
                if method not in best or row["total_s"] < best[method]["total_s"]:
                    best[method] = row
                print(method, r, row, flush=True)
    base = best["OPSD"]["total_s"]
    print("\n| method | responses per step | sampling s | update s | step s | step / OPSD's | per response / OPSD's |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for method, row in best.items():
        per_response = (row["total_s"] / row["responses"]) / (base / best["OPSD"]["responses"])
        print(
            f"| {method} | {row['responses']} | {row['sample_s']:.3f} | {row['update_s']:.3f} | {row['total_s']:.3f} "
            f"| {row['total_s'] / base:.2f} | {per_response:.2f} |"
        )


if __name__ == "__main__":
    main()
