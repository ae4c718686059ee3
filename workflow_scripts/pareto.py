"""Pareto plot: new-task vs old-task accuracy for every method, the post model as reference."""

from graftlab.analysis.pareto import plot_pareto
from graftlab.joblog import job_log

with job_log(snakemake.log[0]):
    plot_pareto(snakemake.input[0], snakemake.output[0], title=f"{snakemake.wildcards.exp}: grafting vs SFT vs merging")
