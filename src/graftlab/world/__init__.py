"""The tiny world. Standard library only here: the config checks and the plan import it on every parse."""

import math


def posttrain_steps(world: dict) -> int:
    """Optimizer steps of the world's post-training: whole epochs over `examples_per_task` problems of
    every old task, `batch_size` a step (`graftlab.world.build.posttrain` trains exactly these)."""
    post = world["posttrain"]
    examples = post["examples_per_task"] * len(world["old_tasks"])
    return post["epochs"] * math.ceil(examples / post["batch_size"])
