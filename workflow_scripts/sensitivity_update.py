"""Share of one update (SFT of post, a graft or a merge) in the top 1% of the post model's
retention-Fisher coordinates."""

from graftlab.analysis.sensitivity import write_update_sensitivity
from graftlab.joblog import job_log

inp, p = snakemake.input, snakemake.params
with job_log(snakemake.log[0], snakemake.threads):
    write_update_sensitivity(inp.fisher, inp.post, p.run, p.model, snakemake.output[0], top=p.top)
