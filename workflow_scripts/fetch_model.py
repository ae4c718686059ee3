"""Fetch one configured model (a local directory or a hub id at a revision) into resources/models/."""

from graftlab.io.fetch import fetch_model, hub_online

hub_online()  # a local rule: the one job that downloads models

from graftlab.io.warm import hand_off

hand_off()  # runs cold: the hub's switch is read at import, and the warm process imported it off

from graftlab.io.joblog import job_log

p = snakemake.params
with job_log(snakemake.log[0]):
    fetch_model(p.source, snakemake.output[0], p.revision, rope_from=p.rope_from)
