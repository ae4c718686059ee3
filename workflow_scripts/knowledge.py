"""The knowledge world's data: QA in training phrasings + replay, held-out questions, the facts."""

from graftlab.io.warm import hand_off

hand_off()  # in the run's warm process, if there is one (graftlab.io.warm)

from pathlib import Path

from graftlab.io.joblog import job_log
from graftlab.world.knowledge import KnowledgeConfig, write_knowledge_data

p = snakemake.params
with job_log(snakemake.log[0]):
    cfg = KnowledgeConfig(**p.knowledge, seed=p.seed)
    out_dir = Path(snakemake.output.sft).parent
    write_knowledge_data(out_dir, cfg, p.old_tasks, snakemake.input.benchmarks)
