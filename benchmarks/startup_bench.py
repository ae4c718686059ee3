"""What a model job pays before its work: the interpreter, importing torch, importing transformers, loading a
model (which pulls in transformers' distributed and compiler modules) and its tokenizer, each timed in a
fresh process, against a bare `python -c pass` in the same run. Prints a Markdown table.

    python benchmarks/startup_bench.py [--repeats 5] [--model DIR]

DIR defaults to a tiny-world-sized Qwen3 model built here (2 layers, hidden 64), the size of the smoke
run's models: loading it is start-up, not reading weights.
"""

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STEPS = {
    "interpreter (`python -c pass`)": "pass",
    "+ import torch": "import torch",
    "+ import transformers": "import torch, transformers",
    "+ load model and tokenizer": (
        "import torch, transformers\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "AutoModelForCausalLM.from_pretrained(MODEL); AutoTokenizer.from_pretrained(MODEL)"
    ),
}


def build_model(root: Path) -> Path:
    from graftlab.world import build
    from graftlab.world.tokenizer import build_tokenizer

    arch = dict(hidden_size=64, intermediate_size=128, layers=2, heads=2, kv_heads=1, max_positions=128)
    tok = build_tokenizer()
    build.init_model(tok, arch, seed=0).save_pretrained(root)
    tok.save_pretrained(root)
    return root


def timed(code: str, model: Path) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code.replace("MODEL", repr(str(model)))], check=True, capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or build_model(Path(tmp) / "model")
        # Interleaved, so a drift in the machine's speed spreads over every step alike.
        times = {name: [] for name in STEPS}
        for _ in range(args.repeats):
            for name, code in STEPS.items():
                times[name].append(timed(code, model))
    base = statistics.median(times["interpreter (`python -c pass`)"])
    print(f"| step (a fresh process each) | median s of {args.repeats} | x interpreter |")
    print("| --- | ---: | ---: |")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"| {name} | {median:.2f} | {median / base:.1f} |")


if __name__ == "__main__":
    main()
