"""The sensitive-weight table of an experiment, one row per update, and its figure."""

from graftlab.analysis.sensitivity import collect_sensitivity
from graftlab.joblog import job_log

out = snakemake.output
with job_log(snakemake.log[0], snakemake.threads):
    collect_sensitivity(
        list(snakemake.input),
        out.parquet,
        out.png,
        title=f"{snakemake.wildcards.exp}: update written to the most Fisher-sensitive weights",
    )
