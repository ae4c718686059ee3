"""An adaptive sweep's first pass over one graft (rules/graft.smk): the graft made into this job's scratch
directory, as the graft job makes it, and scored on the share `eval.adaptive` of the problems alone, drawn from
the validation split (graftlab.analysis.screen)."""

from graftlab.io.warm import hand_off

hand_off()  # in the run's warm process, if there is one (graftlab.io.warm)

import shutil
import tempfile
from pathlib import Path

from graftlab.evaluate.run import Benchmark, evaluate
from graftlab.graft import masked_graft
from graftlab.io.joblog import job_log
from graftlab.sampling import Engine, SamplingConfig

p, inp, out = snakemake.params, snakemake.input, snakemake.output
graft = (inp.post, p.donor, f"{inp.tuned}/epoch~{p.epoch}", float(p.lam))
mask = {"mask": p.mask, "fisher": inp.fisher, "rho": p.rho, **p.mask_settings}
with job_log(snakemake.log[0], snakemake.threads):
    scratch = Path(tempfile.mkdtemp(prefix="graft-screen-", dir=snakemake.resources.tmpdir))
    try:
        model = scratch / "model"
        masked_graft(*graft, model, **mask)
        evaluate(
            model,
            Benchmark.all_of(p.benchmarks),
            SamplingConfig.from_config(p.sampling, p.seed),
            Path(out.metrics).parent,
            p.run,
            Engine.of(p.backend, seed=p.seed),
            validation=p.validation,
            model_name=f"results/{snakemake.wildcards.exp}/{p.run}",  # the graft job's name for it
            screening=p.adaptive,
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
