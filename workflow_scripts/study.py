"""The study over every experiment: verdicts on both splits and drift per experiment, seeds that
reproduce per group, and the §3 model's prediction at each experiment's measured routing."""

from graftlab.io.warm import hand_off

hand_off()  # in the run's warm process, if there is one (graftlab.io.warm)

from graftlab.analysis.moe import MoeConfig
from graftlab.analysis.study import write_study
from graftlab.io.joblog import job_log

out = snakemake.output
with job_log(snakemake.log[0]):
    moe = MoeConfig(**snakemake.params.moe, seed=snakemake.params.seed)
    write_study(snakemake.params.experiments, out.runs, out.groups, out.png, moe)
