"""Seconds per step of the tiny world's post-training SFT in fp32 and in bf16 autocast, and their ratio.

    python benchmarks/precision_bench.py --steps 30 --repeats 5

Both run in this process through graftlab's SFT (TRL's SFTTrainer) on the same data: the default world's
model (config.yaml) freshly initialised, its post-training batches of old-task traces. Precisions are
forced, whatever `precision` would choose on this CPU, so an AVX2-only machine measures emulated bf16.
The first step of each run is left out (warm-up); runs alternate precisions, `--repeats` times each. The
table gives each run's mean and the fastest run, whose ratio is the figure to quote on a shared machine:
other work only ever slows a run down.
"""

import argparse
import statistics
import tempfile
from pathlib import Path

import torch

import graftlab.train.precision as precision
from graftlab.train.precision import Precision, native_bf16_flags
from graftlab.train.sft import TrainConfig, train
from graftlab.world import build
from graftlab.world.tokenizer import build_tokenizer


def world_setup(root: Path):
    """The default world's arch, post-training settings and SFT rows (benchmarks written to `root`)."""
    import yaml

    from graftlab.planning.config import resolve

    config = resolve(yaml.safe_load((Path(__file__).parents[1] / "config.yaml").read_text()))
    world, tok = config["world"], build_tokenizer()
    build.make_benchmarks(world["old_tasks"], world["benchmark_size"], config["seed"], root)
    per_task = world["posttrain"]["examples_per_task"]
    rows = build.sft_rows(tok, build.posttrain_problems(world["old_tasks"], per_task, config["seed"], root))
    return world, tok, rows


def run(name: str, world: dict, tok, rows: list[dict], steps: int, threads: int, work: Path) -> float:
    """Mean seconds of steps 2..`steps` of one post-training run in precision `name`."""
    forced = Precision(name, "forced by the benchmark")
    precision.choose = lambda *args, **kwargs: forced
    model = build.init_model(tok, world["model"], 0)
    post = world["posttrain"]
    cfg = TrainConfig(lr=post["lr"], batch_size=post["batch_size"], steps=steps, seed=0, threads=threads)
    records: list[dict] = []
    train(model, tok, rows, work / name, cfg, records)
    return statistics.mean(r["update_s"] for r in records[1:])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    times = {"fp32": [], "bf16": []}
    with tempfile.TemporaryDirectory() as tmp:
        world, tok, rows = world_setup(Path(tmp))
        for _ in range(a.repeats):
            for name in times:
                times[name].append(run(name, world, tok, rows, a.steps, a.threads, Path(tmp)))
    base = min(times["fp32"])
    print(f"\nCPU native bf16 flags: {native_bf16_flags() or 'none'}; torch {torch.__version__}, {a.threads} threads")
    print(f"tiny world post-training SFT, batch {world['posttrain']['batch_size']}, steps 2..{a.steps}\n")
    print("| precision | s/step of each run | fastest run, s/step | ratio to fp32 |")
    print("| --- | --- | ---: | ---: |")
    for name, values in times.items():
        print(f"| {name} | {', '.join(f'{v:.3f}' for v in values)} | {min(values):.3f} | {min(values) / base:.2f} |")


if __name__ == "__main__":
    main()
