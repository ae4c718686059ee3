"""Make and score a graft sweep (rules/graft.smk): for each lam in turn, one donor update grafted onto the post
model (merging when the donor is the post model), masked by the post model's retention Fisher unless the mask
is `none`, into this job's scratch directory; evaluated, its update's sensitivity share measured, deleted.
One sampling engine for the sweep (with vLLM, each next graft's weights read into it in place). Each graft's
`seconds.json` holds its seconds, and when its model was written and deleted (unix seconds) and its bytes: the
latency analysis reads the one, `graftlab.planning.disk` the others.

An adaptive sweep's first pass (`params.screening`, the share `eval.adaptive`) makes the same grafts and
scores each on that share of the validation problems alone (graftlab.analysis.screen), writing its metrics
and kept samples only."""

from graftlab.io.warm import hand_off

hand_off()  # in the run's warm process, if there is one (graftlab.io.warm)

import shutil
import tempfile
import time
from pathlib import Path

from graftlab.analysis.screen import screened_out, write_screened
from graftlab.analysis.sensitivity_shares import write_update_sensitivity
from graftlab.evaluate.run import Benchmark, evaluate
from graftlab.graft import graft_fingerprint, masked_graft
from graftlab.io.atomic import write_json
from graftlab.io.joblog import job_log, timed
from graftlab.planning.disk import size_of
from graftlab.sample_chunks import chunks_kept
from graftlab.sampling import Engine, SamplingConfig, load_sampler
from graftlab.train.resume import resume_dir
from graftlab.train.shard import job_gpus_processes

p, inp, out = snakemake.params, snakemake.input, snakemake.output
mask = {"mask": p.mask, "fisher": inp.fisher, "rho": p.rho, **p.mask_settings}
benchmarks = Benchmark.all_of(p.benchmarks)
# The job screening the sweep: the share of the validation problems each graft is scored on, and nothing more.
screening, screened = p.get("screening", 0.0), inp.get("screened")
with job_log(snakemake.log[0], snakemake.threads):
    # A job one engine would take beyond its limit runs several at once, one a GPU group.
    processes, sampler = job_gpus_processes(snakemake.resources), None
    for i, (lam, run, metrics) in enumerate(zip(p.lams, p.runs, out.metrics, strict=True)):
        graft, record = (inp.post, p.donor, f"{inp.tuned}/epoch~{p.epoch}", float(lam)), {}
        scratch = Path(tempfile.mkdtemp(prefix="graft-", dir=snakemake.resources.tmpdir))
        try:
            model = scratch / "model"
            record["model_written_at"] = time.time()
            with timed(record, "graft_s"):  # one figure for mask and graft
                masked_graft(*graft, model, **mask)
            record["model_bytes"] = size_of(model)
            # An adaptive sweep's graft screened out on the validation problems is scored no further.
            if screened and (decision := screened_out(screened, run)):
                write_screened(f"results/{snakemake.wildcards.exp}/screen/{run}/metrics.json", metrics, decision)
            else:
                # Sampled in chunks as an evaluation job samples (the same draws), each finished one kept under
                # the graft's inputs and settings (the model is made anew each attempt), or drawn before by
                # the sweep's parts or its screening. Kept past the job: a sweep that gains a lam value remakes
                # this graft in a job of its own, which reads these samples back.
                store, engine = resume_dir(metrics), Engine.of(p.backend, seed=p.seed)
                fingerprint = graft_fingerprint(*graft, **mask)
                with chunks_kept(engine, store, processes, fingerprint=fingerprint, keep=True) as engine:
                    sampler = load_sampler(model, engine, after=sampler)
                    evaluate(
                        model,
                        benchmarks,
                        SamplingConfig.from_config(p.sampling, p.seed),
                        Path(metrics).parent,
                        run,
                        sampler=sampler,
                        validation=p.validation,
                        # Named by its run: the scratch directory is deleted, and random.
                        model_name=f"results/{snakemake.wildcards.exp}/{run}",
                        screening=screening,
                    )
            if not screening:
                write_update_sensitivity(inp.sensitivity_fisher, inp.post, run, model, out.share[i], top=p.top)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
            record["model_deleted_at"] = time.time()
        if not screening:
            write_json(out.seconds[i], record)
