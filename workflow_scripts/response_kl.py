"""Response drift of every continual model against the post model, and KL from it against forgetting."""

from graftlab.io.warm import hand_off

hand_off()  # in the run's warm process, if there is one (graftlab.io.warm)

from graftlab.analysis.continual_probes import write_probes
from graftlab.io.joblog import job_log

p, out = snakemake.params, snakemake.output
with job_log(snakemake.log[0], snakemake.threads):
    write_probes(p.post, p.post_eval, p.benchmarks, p.chains, p.checkpoints, p.cfg, dict(out.items()))
