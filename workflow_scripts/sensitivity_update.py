"""Share of one update (SFT of post, a graft or a merge) in the top 1% of the post model's
retention-Fisher coordinates.

Torch-free (numpy and polars), like the module it calls: one such job runs per update, and importing
torch was most of each one's time. No thread count is passed to job_log, which would import torch only to
pin its threads; numpy's elementwise work here runs on one thread.
"""

from graftlab.io.warm import hand_off

hand_off()  # in the run's warm process, if there is one (graftlab.io.warm)

from graftlab.analysis.sensitivity_shares import write_update_sensitivity
from graftlab.io.joblog import job_log

inp, p = snakemake.input, snakemake.params
with job_log(snakemake.log[0]):
    write_update_sensitivity(inp.fisher, inp.post, p.run, p.model, snakemake.output[0], top=p.top)
