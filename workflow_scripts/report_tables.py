"""The run's summary tables as HTML pages, which `snakemake --report` shows inline."""

from graftlab.io.warm import hand_off

hand_off()  # in the run's warm process, if there is one (graftlab.io.warm)

from graftlab.analysis.report_tables import write_report_tables
from graftlab.io.joblog import job_log

with job_log(snakemake.log[0]):
    write_report_tables(snakemake.params.tables, snakemake.output[0])
