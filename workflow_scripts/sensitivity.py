"""The sensitive-weight table of an experiment, one row per update, and its figure.

Torch-free (polars and matplotlib): no thread count is passed to job_log, which would import torch only to
pin its threads.
"""

from graftlab.io.warm import hand_off

hand_off()  # in the run's warm process, if there is one (graftlab.io.warm)

from graftlab.analysis.sensitivity import collect_sensitivity
from graftlab.io.joblog import job_log

out = snakemake.output
with job_log(snakemake.log[0]):
    collect_sensitivity(
        list(snakemake.input),
        out.parquet,
        out.png,
        title=f"{snakemake.wildcards.exp}: update written to the most Fisher-sensitive weights",
    )
