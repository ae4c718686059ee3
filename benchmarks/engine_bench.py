"""What a vLLM evaluation pays per model, and what one engine for many models saves (issue 34, item 1):
starting an engine over a model directory, against reading the next model of a job into the running engine
(`load_sampler(after=)`: vLLM's reload from its directory, in the engine's own process, as a job scoring a
training run's checkpoints or a sweep's grafts does), and against sampling the same greedy answers with it.
On vLLM's CPU build the start is also timed as that build runs it by default, its engine core and worker
spawned as two processes (VLLM_ENABLE_V1_MULTIPROCESSING=1), against graftlab's engine in the job's own
process (`sampling.in_process_on_cpu`): wall and CPU seconds (the process's and its children's).
Each figure is the median of `--repeats`, an engine start each in a fresh process, the rest in one process
after one warm-up of each, so the import of vLLM is paid once and reported on its own. Run in the vLLM
environment:

    bash envs/vllm-cpu.sh && PYTHONPATH=src .venv-vllm/bin/python benchmarks/engine_bench.py [--repeats 3]

The models are tiny-world-sized (2 layers, hidden 64; head_dim 32, the least vLLM's CPU attention takes):
what the start costs is the engine's own set-up, not reading weights. Prints a Markdown table.
"""

import argparse
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ARCH = dict(hidden_size=64, intermediate_size=128, layers=2, heads=2, kv_heads=1, max_positions=128)
MARK = "engine_bench: "  # the line of a child's figures among vLLM's own logging
PROMPTS = [f"{a}*{b}=" for a in range(3, 11) for b in range(3, 7)]  # 32 prompts, as a small benchmark


def build_models(root: Path, count: int) -> list[Path]:
    """`count` models of one architecture, other seeds: a sweep's grafts, as the engine sees them."""
    from graftlab.world import build
    from graftlab.world.tokenizer import build_tokenizer

    tok, dirs = build_tokenizer(), []
    for seed in range(count):
        path = root / f"m{seed}"
        build.init_model(tok, ARCH, seed=seed).save_pretrained(path)
        tok.save_pretrained(path)
        dirs.append(path)
    return dirs


def timed(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def engine():
    """The tiny world's engine settings: eager, a small KV share of the machine's memory, float32."""
    from graftlab.sampling import Engine

    return Engine("vllm", max_model_len=128, gpu_memory_utilization=0.05, dtype="float32", enforce_eager=True)


def cpu_seconds() -> float:
    """This process's CPU seconds and its ended children's (an engine's spawned processes, once shut down)."""
    mine, theirs = (resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return mine.ru_utime + mine.ru_stime + theirs.ru_utime + theirs.ru_stime


def start_once(model: Path) -> None:
    """In a fresh process: the seconds importing vLLM and starting one engine over `model` take, and the CPU
    seconds of the start (the engine shut down first, so that spawned processes count), as JSON."""
    t0 = time.perf_counter()
    import vllm  # noqa: F401

    from graftlab.sampling import VllmSampler

    t1, cpu = time.perf_counter(), cpu_seconds()
    sampler = VllmSampler(model, engine())
    start_s = time.perf_counter() - t1
    sampler.llm = None
    gc.collect()
    print(MARK + json.dumps({"import_s": t1 - t0, "start_s": start_s, "start_cpu_s": cpu_seconds() - cpu}), flush=True)


def starts(model: Path, repeats: int, processes: str) -> list[dict]:
    """`repeats` engine starts over `model`, each in a fresh process, VLLM_ENABLE_V1_MULTIPROCESSING set to
    `processes` ("0": graftlab's engine in the process; "1": the CPU build's default, two more processes)."""
    env = os.environ | {"VLLM_ENABLE_V1_MULTIPROCESSING": processes}
    cmd = [sys.executable, __file__, "--start-once", str(model)]
    runs = [subprocess.run(cmd, capture_output=True, text=True, env=env) for _ in range(repeats)]
    found = [json.loads(line.removeprefix(MARK)) for r in runs for line in r.stdout.splitlines() if MARK in line]
    assert len(found) == repeats, [r.stderr[-2000:] for r in runs]
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--start-once", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.start_once:
        return start_once(args.start_once)

    from graftlab.sampling import SamplingConfig, VllmSampler, load_sampler

    greedy = SamplingConfig(n=1, temperature=0.0, top_p=1.0, max_new_tokens=24, seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        models = build_models(Path(tmp), args.repeats + 1)
        # Each start in a process of its own: an engine's memory is not given back within one.
        spawned, inside = (starts(models[0], args.repeats, processes) for processes in ("1", "0"))
        sampler = VllmSampler(models[0], engine())  # started at once: its context is configured
        timed(lambda: load_sampler(models[0], engine(), after=sampler))  # warm-up
        swaps = [timed(lambda m=m: load_sampler(m, engine(), after=sampler)) for m in models[1:]]
        assert sampler.model_dir == str(models[-1])  # the same engine, now the last model's
        timed(lambda: sampler(PROMPTS, greedy))  # warm-up
        samples = [timed(lambda: sampler(PROMPTS, greedy)) for _ in range(args.repeats)]
        sampler.llm = None  # the engine's processes shut down now: left to the interpreter's exit, they hang
        gc.collect()

    import_s = statistics.median(s["import_s"] for s in inside)
    start_s, swap_s, sample_s = (statistics.median(x) for x in ([s["start_s"] for s in inside], swaps, samples))
    spawned_s, spawned_cpu, cpu = (
        statistics.median(s[k] for s in runs)
        for runs, k in ((spawned, "start_s"), (spawned, "start_cpu_s"), (inside, "start_cpu_s"))
    )
    print(f"| step ({len(PROMPTS)} prompts, 24 greedy tokens) | seconds | against an engine start |")
    print("| --- | ---: | ---: |")
    print(f"| import vllm and graftlab.sampling (once a process) | {import_s:.2f} | {import_s / start_s:.2f}x |")
    print(f"| start an engine over a model directory | {start_s:.2f} ({cpu:.2f} CPU) | 1.00x |")
    print(
        f"| the same, engine core and worker spawned (the CPU build's default) | {spawned_s:.2f} "
        f"({spawned_cpu:.2f} CPU) | {spawned_s / start_s:.2f}x ({spawned_cpu / cpu:.2f}x CPU) |"
    )
    print(f"| read the next model's weights into it | {swap_s:.3f} | {swap_s / start_s:.3f}x |")
    print(f"| sample the prompts | {sample_s:.3f} | {sample_s / start_s:.3f}x |")


if __name__ == "__main__":
    main()
