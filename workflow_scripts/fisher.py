"""Retention Fisher of a model on its rollouts (kind: diag or kfac): the post model's in its retention home, or a
continual chain's after a stage."""

from graftlab.io.warm import hand_off

hand_off()  # in the run's warm process, if there is one (graftlab.io.warm)

from graftlab.fisher import write_fisher
from graftlab.io.joblog import job_log
from graftlab.planning.layout import Experiment, retention_homes
from graftlab.train.shard import job_gpus_processes

p, inp, w = snakemake.params, snakemake.input, snakemake.wildcards
# The batch size is memory, not results, so it is no param: the smallest of the experiments sharing the Fisher.
config = snakemake.config
sharing = retention_homes(config)[w.home] if hasattr(w, "home") else [Experiment.of(config, w.exp)]
batch_size = min(x.x["fisher"]["batch_size"] for x in sharing)
with job_log(snakemake.log[0], snakemake.threads):
    processes = job_gpus_processes(snakemake.resources)  # sharded over several (diag)
    write_fisher(p.kind, inp.model, inp.rollouts, snakemake.output[0], batch_size, processes, **p.options)
