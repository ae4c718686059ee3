"""Per-job logs for workflow scripts: Snakemake's `script:` does not redirect output to `log:`."""

import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def job_log(path, threads: int | None = None):
    """Send this process's stdout and stderr (file descriptors too: torch and tqdm write there) to `path`.

    Also pins torch to `threads`: two torch processes that each take every core run several times
    slower than one (docs/methods.md#jobs-threads-and-start-up), so a job uses exactly the threads its rule declares.
    """
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    if threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(threads)
        import torch

        torch.set_num_threads(threads)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "a") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            yield
        except BaseException:
            import traceback

            traceback.print_exc()
            raise
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def benchmark_of(log: str) -> str | None:
    """A job's Snakemake benchmark file: its log's path under benchmarks/jobs/ instead of logs/, `.tsv` for
    `.log` (every rule names both from the same pattern); None for a log elsewhere."""
    if not (log.startswith("logs/") and log.endswith(".log")):
        return None
    return "benchmarks/jobs/" + log.removeprefix("logs/").removesuffix(".log") + ".tsv"


@contextmanager
def timed(record: dict, key: str):
    """Add the wall seconds of the block to `record[key]`: the latency analysis reads what each job spent
    on its work alone, without process start-up and model loading."""
    start = time.perf_counter()
    yield
    record[key] = record.get(key, 0.0) + time.perf_counter() - start
