"""What a model job pays before its work: the interpreter, importing torch, importing transformers, loading a
model (which pulls in transformers' distributed and compiler modules) and its tokenizer, each timed in a
fresh process, against a bare `python -c pass` in the same run; and the same load in a job handed to a warm
process (graftlab.io.warm, as the workflow's local runs do): a fresh interpreter that connects, and a
worker forked from a process that has imported what the workflow scripts import. Prints a Markdown table.

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


WARM = "+ load model and tokenizer, handed to a warm process"
SCRIPTS = Path(__file__).resolve().parents[1] / "workflow_scripts"


def timed(code: str, model: Path, script: Path) -> float:
    start = time.perf_counter()
    if code == WARM:  # the job as a script file (a worker runs a file), handing itself off first
        subprocess.run([sys.executable, str(script)], check=True, capture_output=True)
    else:
        subprocess.run([sys.executable, "-c", code.replace("MODEL", repr(str(model)))], check=True, capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", type=Path)
    args = parser.parse_args()
    from graftlab.io import warm

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or build_model(Path(tmp) / "model")
        script = Path(tmp) / "job.py"
        load = STEPS["+ load model and tokenizer"].replace("MODEL", repr(str(model)))
        script.write_text(f"from graftlab.io.warm import hand_off\nhand_off()\n{load}\n")
        server = warm.start(SCRIPTS)
        steps = STEPS | {WARM: WARM}
        try:
            timed(WARM, model, script)  # the warm process's own imports, before the first timing
            # Interleaved, so a drift in the machine's speed spreads over every step alike.
            times = {name: [] for name in steps}
            for _ in range(args.repeats):
                for name, code in steps.items():
                    times[name].append(timed(code, model, script))
        finally:
            server.kill()
    base = statistics.median(times["interpreter (`python -c pass`)"])
    print(f"| step (a fresh process each) | median s of {args.repeats} | x interpreter |")
    print("| --- | ---: | ---: |")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"| {name} | {median:.2f} | {median / base:.1f} |")


if __name__ == "__main__":
    main()
