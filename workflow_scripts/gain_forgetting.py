"""Gain and forgetting per run and benchmark against the post model (Denser ≠ Better), and its heatmap."""

from graftlab.io.warm import hand_off

hand_off()  # in the run's warm process, if there is one (graftlab.io.warm)

from graftlab.analysis.gain_forgetting import write_gain_forgetting
from graftlab.io.joblog import job_log

out = snakemake.output
with job_log(snakemake.log[0]):
    # The summary keeps only the role means (old, new): each benchmark's role comes from the layout.
    write_gain_forgetting(snakemake.input[0], out.table, out.png, roles=dict(snakemake.params.roles))
