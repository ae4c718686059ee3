"""An adaptive sweep's first pass (rules/graft.smk): each graft of the sweep made into this job's scratch
directory in turn, as the sweep's job makes it, and scored on the share `eval.adaptive` of the problems alone,
drawn from the validation split (graftlab.analysis.screen); one sampling engine for the sweep, each graft's
samples kept."""

from graftlab.io.warm import hand_off

hand_off()  # in the run's warm process, if there is one (graftlab.io.warm)

import shutil
import tempfile
from pathlib import Path

from graftlab.evaluate.run import Benchmark, evaluate
from graftlab.graft import graft_fingerprint, masked_graft
from graftlab.io.joblog import job_log
from graftlab.sample_chunks import chunks_kept
from graftlab.sampling import Engine, SamplingConfig, load_sampler
from graftlab.train.resume import resume_dir

p, inp, out = snakemake.params, snakemake.input, snakemake.output
mask = {"mask": p.mask, "fisher": inp.fisher, "rho": p.rho, **p.mask_settings}
sampler = None
with job_log(snakemake.log[0], snakemake.threads):
    for lam, run, metrics in zip(p.lams, p.runs, out.metrics, strict=True):
        scratch = Path(tempfile.mkdtemp(prefix="graft-screen-", dir=snakemake.resources.tmpdir))
        try:
            model, graft = scratch / "model", (inp.post, p.donor, f"{inp.tuned}/epoch~{p.epoch}", float(lam))
            masked_graft(*graft, model, **mask)
            # Each graft's screening samples kept under its inputs and settings, as its full scoring's are
            # (graft.py): a killed job, or the sweep grown by a lam, reads them back instead of sampling.
            fingerprint = graft_fingerprint(*graft, **mask)
            engine = Engine.of(p.backend, seed=p.seed)
            with chunks_kept(engine, resume_dir(metrics), fingerprint=fingerprint, keep=True) as engine:
                sampler = load_sampler(model, engine, after=sampler)
                evaluate(
                    model,
                    Benchmark.all_of(p.benchmarks),
                    SamplingConfig.from_config(p.sampling, p.seed),
                    Path(metrics).parent,
                    run,
                    sampler=sampler,
                    validation=p.validation,
                    model_name=f"results/{snakemake.wildcards.exp}/{run}",  # the sweep job's name for it
                    screening=p.adaptive,
                )
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
