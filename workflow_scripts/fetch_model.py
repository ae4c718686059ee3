"""Fetch one configured model (a local directory or a hub id at a revision) into resources/models/."""

from graftlab.fetch import fetch_model
from graftlab.joblog import job_log

p = snakemake.params
with job_log(snakemake.log[0]):
    fetch_model(p.source, snakemake.output[0], p.revision)
