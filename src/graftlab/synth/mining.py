"""Hard-problem mining: keep the problems the target model rarely or never solves.

Never-solved problems are kept on purpose (docs/methods.md#hard-problem-mining): dropping them would drop
exactly the part of the new task the model cannot yet do.
"""

from dataclasses import dataclass

import polars as pl

from graftlab.errors import GraftlabError
from graftlab.io.tables import PROBLEM_COLUMNS, read_table
from graftlab.sampling import SamplingConfig
from graftlab.streams import stream, stream_seed
from graftlab.tasks import get_task


@dataclass(frozen=True)
class MiningConfig:
    samples: int
    max_pass_rate: float
    heldout: int
    temperature: float
    max_new_tokens: int
    leaks: str = "refuse"  # or "report": keep candidates that a benchmark holds, with a warning
    seed: int = 0


def pass_rates(sampler, tokenizer, problems: list[dict], cfg: MiningConfig, task: str = "arith") -> list[float]:
    """Each problem's fraction of correct samples, drawn and graded as task `task` has them."""
    scfg = SamplingConfig(cfg.samples, cfg.temperature, 1.0, cfg.max_new_tokens, stream_seed("mining", cfg.seed))
    records = get_task(task).sample_and_grade(sampler, tokenizer, pl.DataFrame(problems), scfg)
    per_problem = records.group_by("problem_id", maintain_order=True).agg(pl.col("correct").mean())
    return per_problem["correct"].to_list()


def split_hard(problems: list[dict], rates: list[float], cfg: MiningConfig) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(train, heldout): disjoint sets of the problems at or below the pass-rate threshold."""
    hard = [dict(p, pass_rate=r) for p, r in zip(problems, rates) if r <= cfg.max_pass_rate]
    if len(hard) <= cfg.heldout:
        raise GraftlabError(
            f"mining kept {len(hard)} of {len(problems)} problems at pass rate <= {cfg.max_pass_rate}; "
            f"need more than mining.heldout = {cfg.heldout} to leave any for training"
        )
    stream("mining-split", cfg.seed).shuffle(hard)
    return pl.DataFrame(hard[cfg.heldout :]), pl.DataFrame(hard[: cfg.heldout])


def mine(
    model_dir,
    candidates,
    cfg: MiningConfig,
    train_out,
    heldout_out,
    backend: str = "auto",
    task: str = "arith",
    benchmark_files=(),
) -> None:
    """Sample the model on every candidate, grade by registry task `task`, keep the hard ones, write
    disjoint train / held-out sets. Candidates that repeat an id, lack a prompt or answer, or are
    problems of any of `benchmark_files` are refused before the model loads (with `cfg.leaks` "report",
    kept and warned of)."""
    from transformers import AutoTokenizer

    from graftlab.sampling import load_sampler
    from graftlab.tasks.sources import check_problems, refuse_leaks

    name = f"mining candidates ({candidates})"
    frame = check_problems(read_table(candidates, PROBLEM_COLUMNS, "mining candidates"), name)
    refuse_leaks(frame, benchmark_files, name, report=cfg.leaks == "report")
    problems = frame.to_dicts()
    sampler, tokenizer = load_sampler(model_dir, backend), AutoTokenizer.from_pretrained(model_dir)
    rates = pass_rates(sampler, tokenizer, problems, cfg, task)
    train, heldout = split_hard(problems, rates, cfg)
    print(
        f"mined {len(train) + len(heldout)} of {len(problems)} problems (pass rate <= {cfg.max_pass_rate}); "
        f"{sum(r == 0 for r in rates)} never solved; {len(train)} train, {len(heldout)} held out"
    )
    heldout.write_parquet(heldout_out)
    train.write_parquet(train_out)
