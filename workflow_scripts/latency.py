"""Latency: each run's compute by kind (sampling, update, graft, Fisher), per-step seconds per method, and
the figure comparing them."""

from graftlab.io.warm import hand_off

hand_off()  # in the run's warm process, if there is one (graftlab.io.warm)

from graftlab.analysis.latency import write_latency
from graftlab.io.joblog import job_log

out = snakemake.output
with job_log(snakemake.log[0]):
    root = f"results/{snakemake.wildcards.exp}"
    write_latency(
        snakemake.input.summary,
        root,
        out.runs,
        out.steps,
        out.png,
        title=snakemake.wildcards.exp,
        fishers=snakemake.params.fishers,
    )
