"""Independent random streams, one per purpose.

Every draw is keyed by a string of purpose, task and seed ("benchmark:add:0"), never by `seed + k`:
with integer offsets, world seed s+1's benchmarks came from the same stream as world seed s's
post-training problems, so seed replicates were not independent. Python seeds `random.Random` from a
string by its SHA-512, the same in every process (unlike the salted `hash()`).
"""

import hashlib
import random


def stream_key(purpose: str, *parts) -> str:
    """The string naming one stream: its purpose, then whatever tells its draws apart (task, seed, step)."""
    return ":".join([purpose, *map(str, parts)])


def stream(purpose: str, *parts) -> random.Random:
    """A `random.Random` of its own for one purpose."""
    return random.Random(stream_key(purpose, *parts))


def stream_seed(purpose: str, *parts) -> int:
    """An integer seed of its own for one purpose, for libraries that take an integer (torch, vLLM): the
    first 63 bits of the key's BLAKE2b digest."""
    digest = hashlib.blake2b(stream_key(purpose, *parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def passes(n: int, count: int, purpose: str, *parts) -> list[int]:
    """The first `count` indices of successive seeded permutations of range(n): a fresh order each pass
    over `n` items, fixed in advance, so a run resumed at any step reads what an uninterrupted one did."""
    rng, order = stream(purpose, *parts), []
    while len(order) < count:
        epoch = list(range(n))
        rng.shuffle(epoch)
        order += epoch
    return order[:count]
