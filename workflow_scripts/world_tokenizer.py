"""Write the tiny world's character tokenizer as a Hugging Face tokenizer directory."""

from graftlab.io.warm import hand_off

hand_off()  # in the run's warm process, if there is one (graftlab.io.warm)

from graftlab.io.joblog import job_log
from graftlab.world.tokenizer import save_tokenizer

with job_log(snakemake.log[0]):
    save_tokenizer(snakemake.output[0])
