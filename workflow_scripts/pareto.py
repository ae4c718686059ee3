"""Pareto plot: new-task vs old-task accuracy for every method, the post model as reference."""

from graftlab.io.warm import hand_off

hand_off()  # in the run's warm process, if there is one (graftlab.io.warm)

import polars as pl

from graftlab.analysis.pareto import data_title, plot_pareto
from graftlab.io.joblog import job_log

with job_log(snakemake.log[0]):
    summary = pl.read_parquet(snakemake.input[0])
    plot_pareto(summary, snakemake.output[0], title=data_title(snakemake.wildcards.exp, summary))
