"""The grafting paper's §3 model: closed forms and their simulation as a table, and the figure."""

from graftlab.io.warm import hand_off

hand_off()  # in the run's warm process, if there is one (graftlab.io.warm)

from graftlab.analysis.moe import MoeConfig, write_moe
from graftlab.io.joblog import job_log

with job_log(snakemake.log[0]):
    cfg = MoeConfig(**snakemake.params.moe, seed=snakemake.params.seed)
    table = write_moe(cfg, snakemake.output.parquet, snakemake.output.png)
    print(f"moe: {table.height} rows for eps_D = {cfg.eps_donor}, eps_P in {list(cfg.eps_post)}")
