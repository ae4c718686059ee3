"""One part of a graft job's sampling (rules/graft.smk): the graft made into this job's scratch directory, as
the graft job makes it, and every n-th chunk of its evaluation's calls drawn into the store the graft job
reads back (graftlab.sample_chunks.Part); the model is deleted with the scratch."""

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
graft = (inp.post, p.donor, f"{inp.tuned}/epoch~{p.epoch}", float(p.lam))
mask = {"mask": p.mask, "fisher": inp.fisher, "rho": p.rho, **p.mask_settings}
# A graft an adaptive sweep screened out is scored no further: its parts sample nothing.
screened = bool(inp.screened) and screened_out(inp.screened, p.run) is not None
with job_log(snakemake.log[0], snakemake.threads):
    scratch = Path(tempfile.mkdtemp(prefix="graft-part-", dir=snakemake.resources.tmpdir))
    try:
        if not screened:
            model = scratch / "model"
            masked_graft(*graft, model, **mask)
            benchmarks = Benchmark.all_of(p.benchmarks)
            processes = job_gpus_processes(snakemake.resources)
            store, fingerprint = resume_dir(p.metrics), graft_fingerprint(*graft, **mask)
            with chunks_kept(Engine.of(p.backend, seed=p.seed), store, processes, part, fingerprint) as engine:
                presample(
                    model, benchmarks, SamplingConfig.from_config(p.sampling, p.seed), load_sampler(model, engine)
                )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
write_json(snakemake.output[0], {"part": part.index, "of": part.count, "screened_out": screened})
