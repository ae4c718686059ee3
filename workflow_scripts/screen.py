"""An adaptive sweep's decisions: which grafts can still reach the frontier, scored on the validation problems
(graftlab.analysis.screen)."""

from graftlab.io.warm import hand_off

hand_off()  # in the run's warm process, if there is one (graftlab.io.warm)

from graftlab.analysis.screen import write_decisions
from graftlab.io.joblog import job_log

out = snakemake.output
with job_log(snakemake.log[0], snakemake.threads):
    write_decisions(list(snakemake.input), out.decisions, out.table)
