"""Random streams are keyed by purpose, task and seed: no two purposes or seeds share a stream."""

import subprocess
import sys

from graftlab.streams import stream, stream_key, stream_seed
from graftlab.tasks import arith


def test_a_seeds_streams_never_coincide_with_the_next_seeds_of_another_purpose():
    # With `seed + k` offsets, world seed 1's benchmarks were world seed 0's post-training problems.
    for task in arith.OLD_TASKS:
        benchmark_next_seed = arith.sample_problems(task, 40, "benchmark", 1)
        posttrain = arith.sample_problems(task, 40, "posttrain", 0)
        assert benchmark_next_seed != posttrain
    draws = {
        (p, s): stream(p, "add", s).random()
        for p in ("benchmark", "posttrain", "retention", "replay")
        for s in range(4)
    }
    assert len(set(draws.values())) == len(draws)


def test_integer_seeds_are_distinct_per_step_and_stable_across_processes():
    seeds = [stream_seed("opsd-sampling", 0, step) for step in range(100)] + [stream_seed("opsd-sampling", 1, 0)]
    assert len(set(seeds)) == len(seeds) and all(0 <= s < 2**63 for s in seeds)
    # Python's own hash() is salted per process; a stream must not be.
    code = (
        "from graftlab.streams import stream, stream_seed; print(stream_seed('star', 3, 1), stream('star', 3).random())"
    )
    runs = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        for _ in range(2)
    }
    assert runs == {f"{stream_seed('star', 3, 1)} {stream('star', 3).random()}\n"}
    assert stream_key("benchmark", "add", 0) == "benchmark:add:0"
