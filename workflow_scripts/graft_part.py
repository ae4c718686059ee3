"""One part of a graft sweep's sampling (rules/graft.smk): each graft of the sweep made into this job's
scratch directory in turn, as the sweep's job makes it, and every n-th chunk of its evaluation's calls drawn
into the store the sweep's job reads back (graftlab.sample_chunks.Part); each model deleted with its scratch."""

from graftlab.io.warm import hand_off

hand_off()  # in the run's warm process, if there is one (graftlab.io.warm)

import shutil
import tempfile
from pathlib import Path

from graftlab.analysis.screen import screened_out
from graftlab.evaluate.run import Benchmark, presample
from graftlab.graft import graft_fingerprint, masked_graft
from graftlab.io.atomic import write_json
from graftlab.io.joblog import job_log
from graftlab.sample_chunks import Part, chunks_kept
from graftlab.sampling import Engine, SamplingConfig, load_sampler
from graftlab.train.resume import resume_dir
from graftlab.train.shard import job_gpus_processes

p, inp, w = snakemake.params, snakemake.input, snakemake.wildcards
part = Part(int(w.part), int(w.parts))
mask = {"mask": p.mask, "fisher": inp.fisher, "rho": p.rho, **p.mask_settings}
benchmarks = Benchmark.all_of(p.benchmarks)
screened = []
with job_log(snakemake.log[0], snakemake.threads):
    processes, sampler = job_gpus_processes(snakemake.resources), None
    for lam, run, metrics in zip(p.lams, p.runs, p.metrics, strict=True):
        # A graft an adaptive sweep screened out is scored no further: its parts sample nothing.
        if inp.screened and screened_out(inp.screened, run) is not None:
            screened.append(run)
            continue
        graft = (inp.post, p.donor, f"{inp.tuned}/epoch~{p.epoch}", float(lam))
        scratch = Path(tempfile.mkdtemp(prefix="graft-part-", dir=snakemake.resources.tmpdir))
        try:
            model = scratch / "model"
            masked_graft(*graft, model, **mask)
            store, fingerprint = resume_dir(metrics), graft_fingerprint(*graft, **mask)
            with chunks_kept(Engine.of(p.backend, seed=p.seed), store, processes, part, fingerprint) as engine:
                sampler = load_sampler(model, engine, after=sampler)
                presample(model, benchmarks, SamplingConfig.from_config(p.sampling, p.seed), sampler)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
write_json(snakemake.output[0], {"part": part.index, "of": part.count, "screened_out": screened})
