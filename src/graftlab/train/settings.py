"""How a training job runs, whatever it trains: `RunSettings`, the fields every trainer's config shares
(SFT, OPSD, GRPO, SDPO, the Pedagogical RL teacher), and `job_settings`, the one place a workflow script
reads them from its rule.

Defaults are the schema's top-level keys (`graftlab.schema`); a method's config sets its own
`micro_batch_size` default from its section. None of these settings changes what a run computes beyond
its floating-point precision: they say where and how fast it runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from graftlab.schema import schema_default
from graftlab.train.live import Live


@dataclass(frozen=True, kw_only=True)
class RunSettings:
    seed: int = 0  # every random stream of the run is keyed by it (graftlab.streams)
    threads: int = 1  # torch's threads on a CPU
    precision: str = schema_default("", "precision")  # graftlab.train.precision decides what it means here
    # The update's micro-batch: its gradients accumulate to the method's batch; auto sizes it to the GPU.
    micro_batch_size: int | str = "auto"
    gradient_checkpointing: bool | str = schema_default("", "gradient_checkpointing")
    save_dtype: str = schema_default("", "save_dtype")  # of the checkpoints written; auto: the start model's
    # Sampling, where the method samples (anything graftlab.sampling.Engine.of reads): with vLLM, an
    # in-process engine (TRL's colocated one for GRPO), into which the current weights are written each step.
    backend: Any = schema_default("", "sampling_backend")
    # Live metrics (graftlab.train.live.Live, or its dict): TensorBoard and W&B; none outside the workflow.
    live: Any = None


def job_settings(snakemake, **given) -> dict:
    """The RunSettings of a workflow job, from its rule's params (`seed`, `precision`,
    `gradient_checkpointing`, `save_dtype`, and `backend` where it samples) and its threads; `given`
    overrides one (the teacher passes its engine, made once)."""
    p = snakemake.params
    settings = {
        "seed": p.seed,
        "threads": snakemake.threads,
        "precision": p.precision,
        "gradient_checkpointing": p.gradient_checkpointing,
        "save_dtype": p.save_dtype,
    }
    if "backend" in p.keys():
        settings["backend"] = p.backend
    # From the config, not the params: where a run's live metrics go never re-runs it.
    settings["live"] = Live.for_job(snakemake.config["live_metrics"], snakemake.log[0])
    return settings | given


def recorded(cfg) -> dict:
    """A run's config as its checkpoints' provenance records it: all but where its live metrics went, which
    changes nothing it computes (a rerun logging elsewhere writes the same record)."""
    from dataclasses import asdict

    return {k: v for k, v in asdict(cfg).items() if k != "live"}
