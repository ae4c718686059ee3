# The grafting paper's §3 model: two linear-regression tasks, a mixture of two linear experts, routing
# eps_D in the donor and eps_P in the post model. Closed forms checked by simulation; no other input.
from graftlab.analysis.moe import MoeConfig
from graftlab.errors import GraftlabError

# The schema cannot compare eps_donor with eps_post: check them here, so that a bad value stops the
# dry-run rather than the job at the end of a long workflow.
try:
    MoeConfig.from_config(config)
except GraftlabError as err:
    raise WorkflowError(f"config key {err}") from None


rule moe:
    output:
        parquet="results/moe/moe.parquet",
        png=report(
            "results/moe/moe.png",
            caption="../report/moe.rst",
            category="moe",
            subcategory="Figures",
            labels={"figure": "mixture of experts (§3)"},
        ),
    log:
        "logs/moe.log",
    benchmark:
        "benchmarks/jobs/moe.tsv"
    conda:
        "../envs/cpu.yaml"
    params:
        moe=config["moe"],
        seed=config["seed"],
    script:
        "../workflow_scripts/moe.py"
