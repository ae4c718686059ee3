"""Share of each update (SFT of post, every graft and merge) in the top 1% of the post model's
retention-Fisher coordinates: a table and its figure."""

from graftlab.analysis.sensitivity import write_sensitivity
from graftlab.joblog import job_log

inp, out, p = snakemake.input, snakemake.output, snakemake.params
with job_log(snakemake.log[0], snakemake.threads):
    write_sensitivity(
        inp.fisher,
        inp.post,
        p.updates,
        out.parquet,
        out.png,
        top=p.top,
        title=f"{snakemake.wildcards.exp}: update written to the most Fisher-sensitive weights",
    )
