"""Pedagogical RL (docs/methods.md#pedagogical-rl; paper appendix B): a teacher, a copy of the post model,
sees the problem and its reference solution and writes a trace; GRPO trains it on reward = correctness x
learnability, where learnability is judged by the fixed student (the post model) seeing the problem only.

Learnability. Over the trace tokens y_t the student's surprise gap is
`d_t = log pS(argmax_t) - log pS(y_t) >= 0` (zero where the trace says what the student would have said).
The gaps are pooled by a soft maximum with temperature beta,
`S_beta = (1/beta) * log(mean_t exp(beta * d_t))`: beta = 0 is the mean gap exactly, beta -> inf the
largest gap, and S_beta never decreases as beta grows (a power mean of exp(d_t)). The paper names beta
and a strength lambda but leaves the exact form open; ours, the documented default, is
`learnability = exp(-lambda * S_beta)` in (0, 1], so reward = correct * exp(-lambda * S_beta).

Reward hacking. Learnability pays for traces the student finds predictable, and nothing is more
predictable than no reasoning at all: a teacher can learn to emit `<think>\\n\\n</think>\\n\\n42`, correct and
nearly gap-free. So a trace earns reward only when it is well formed: a `<think>` ... `</think>` block
with non-empty thinking, and at least `min_tokens` tokens; otherwise its reward is 0, whatever its
correctness and learnability. `well_formed` is a logged component, so a collapse shows in the step log.

Training uses TRL's `GRPOTrainer`, checked to run on the CPU here (pico Qwen3, char tokenizer, a custom
reward callable: about 13 steps/s at 8 completions of 24 tokens per step, one thread). Two details of
TRL 1.16 matter: the `completions` it passes to reward functions are decoded with special tokens
skipped, which drops `</think>`, so the reward decodes `completion_ids` itself; and reward functions get
a `log_metric` callback, through which every reward component is logged per step.
"""

import math
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from graftlab.errors import GraftlabError
from graftlab.methods.spec import fill
from graftlab.schema import schema_default
from graftlab.streams import passes
from graftlab.tasks import THINK_CLOSE, THINK_OPEN, chat_prompt, is_correct
from graftlab.train.settings import RunSettings

# The schema's default holds only characters of the tiny world's tokenizer: its char-level models read
# every one of them.
TEACHER_TEMPLATE = schema_default("pedagogical", "template")
REFERENCE_MARKER = "reference"
COMPONENTS = ("correct", "well_formed", "tokens", "gap_mean", "gap_max", "soft_gap", "learnability", "reward")


@dataclass(frozen=True)
class RewardConfig:
    """Defaults are the schema's `pedagogical` section (`graftlab.schema`)."""

    beta: float = schema_default("pedagogical", "beta")  # soft-max temperature: 0 = mean gap, inf = largest gap
    strength: float = schema_default("pedagogical", "strength")  # lambda
    # Completion tokens (end of turn included) a trace needs to earn reward. The tiny world's shortest
    # genuine traces are 11 tokens (compare: `<think>\n0=0\n</think>\n\n=`), 19 (sub), 23 (add) and 28
    # (mul, up to 33), so the default 8 never rejects one; the empty-think hack is caught by the non-empty
    # check, not by this count. Real models think for hundreds of tokens: raise it for them.
    min_tokens: int = schema_default("pedagogical", "min_tokens")

    def __post_init__(self):
        if not self.beta >= 0 or not self.strength >= 0:
            raise GraftlabError(
                f"pedagogical reward needs beta >= 0 and strength >= 0 (got {self.beta}, {self.strength})"
            )
        if not self.min_tokens >= 0:
            raise GraftlabError(f"pedagogical reward needs min_tokens >= 0 (got {self.min_tokens})")


def reference_solution(problem: dict) -> str:
    """What the teacher is shown: the problem's `solution` where the data has one (real data: a written
    reference solution), else its final answer. Never the expert `thinking`: the paper's teacher sees the
    reference solution but no thinking trace."""
    return str(problem.get("solution") or problem["answer"])


def teacher_prompt(problem: str, solution: str, template: str = TEACHER_TEMPLATE) -> str:
    """The teacher's user turn (`pedagogical.template`): by default the problem, the reference solution, and
    the instruction to solve it independently."""
    return fill(template, problem=problem, solution=solution)


def teacher_chat(tokenizer, problem: dict, template: str = TEACHER_TEMPLATE) -> str:
    """A problem row's teacher prompt as the chat the teacher reads, in training and in trace writing alike."""
    return chat_prompt(tokenizer, teacher_prompt(problem["prompt"], reference_solution(problem), template))


def soft_max_gap(gaps: torch.Tensor, beta: float) -> float:
    """`S_beta` of one trace's gaps; 0 for a trace of no tokens (such a trace is never correct)."""
    if gaps.numel() == 0:
        return 0.0
    d = gaps.double()
    if beta == 0:
        return d.mean().item()
    if math.isinf(beta):
        return d.max().item()
    # logsumexp, so a large beta * d_t cannot overflow exp.
    return ((torch.logsumexp(beta * d, 0) - math.log(d.numel())) / beta).item()


def learnability(soft_gap: float, strength: float) -> float:
    return math.exp(-strength * soft_gap)


def gaps_from_ids(
    student, prompt_ids: list[list[int]], completion_ids: list[list[int]], batch_size: int = 16
) -> list[torch.Tensor]:
    """Per-token surprise gaps of the student over each completion, given the exact token ids."""
    if any(not p for p in prompt_ids):
        raise GraftlabError("surprise gaps need a non-empty prompt: the first trace token is predicted from it")
    out: list[torch.Tensor] = []
    for start in range(0, len(prompt_ids), batch_size):
        stop = start + batch_size
        out.extend(_gap_batch(student, prompt_ids[start:stop], completion_ids[start:stop]))
    return out


def _gap_batch(student, prompts: list[list[int]], completions: list[list[int]]) -> list[torch.Tensor]:
    seqs = [list(p) + list(c) for p, c in zip(prompts, completions)]
    ids = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)
    mask = torch.zeros_like(ids)
    # Right padding: a causal model's logits at real positions never see the padding after them.
    for row, seq in enumerate(seqs):
        ids[row, : len(seq)] = torch.tensor(seq)
        mask[row, : len(seq)] = 1
    device = next(student.parameters()).device
    with torch.no_grad():
        logits = student(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
    gaps = []
    for row, (p, c) in enumerate(zip(prompts, completions)):
        # The logits at position i predict token i + 1: the completion is read from one position earlier.
        logp = logits[row, len(p) - 1 : len(p) + len(c) - 1].float().log_softmax(-1)
        y = torch.tensor(list(c), dtype=torch.long, device=logp.device)
        gaps.append((logp.max(-1).values - logp.gather(-1, y[:, None]).squeeze(-1)).cpu())
    return gaps


def surprise_gaps(
    student, tokenizer, prompts: list[str], completions: list[str], batch_size: int = 16
) -> list[torch.Tensor]:
    """Gaps `d_t` over each completion's tokens (end of turn included, as SFT trains on it), the student
    reading the chat-formatted problem `prompts[i]` (the user turn: problem only, no solution)."""
    enc = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    prompt_ids = [enc(chat_prompt(tokenizer, p)) for p in prompts]
    return gaps_from_ids(student, prompt_ids, [enc(c) for c in completions], batch_size)


def well_formed(completion: str, tokens: int, min_tokens: int) -> bool:
    """Whether a trace may earn reward: it thinks (something other than whitespace and think tags
    between its first `<think>` and its last `</think>`, after which grading reads the answer) and is
    at least `min_tokens` tokens long."""
    start, end = completion.find(THINK_OPEN), completion.rfind(THINK_CLOSE)
    if start < 0 or end < start:
        return False
    thinking = completion[start + len(THINK_OPEN) : end].replace(THINK_OPEN, "").replace(THINK_CLOSE, "")
    return bool(thinking.strip()) and tokens >= min_tokens


def reward_components(
    gaps: Sequence[torch.Tensor], correct: Sequence[bool], cfg: RewardConfig, *, completions: Sequence[str]
) -> list[dict]:
    """Per sample: correct, well formed, token count, mean / largest / soft-max gap, learnability and
    the reward; `completions` are the exact texts (special tokens kept) whose tokens `gaps` scores."""
    rows = []
    for d, ok, text in zip(gaps, correct, completions, strict=True):
        soft = soft_max_gap(d, cfg.beta)
        learn = learnability(soft, cfg.strength)
        formed = well_formed(text, d.numel(), cfg.min_tokens)
        rows.append(
            {
                "correct": bool(ok),
                "well_formed": formed,
                "tokens": d.numel(),
                "gap_mean": d.double().mean().item() if d.numel() else 0.0,
                "gap_max": d.max().item() if d.numel() else 0.0,
                "soft_gap": soft,
                "learnability": learn,
                "reward": float(ok and formed) * learn,
            }
        )
    return rows


def pedagogical_reward(
    student,
    tokenizer,
    prompts: list[str],
    answers: list[str],
    completions: list[str],
    cfg: RewardConfig,
    batch_size: int = 16,
) -> list[dict]:
    """Reward components of teacher `completions` to problems `prompts` (user text, no solution) with
    reference `answers`; the student is frozen and only scores."""
    gaps = surprise_gaps(student, tokenizer, prompts, completions, batch_size)
    correct = [is_correct(c, a) for c, a in zip(completions, answers)]
    return reward_components(gaps, correct, cfg, completions=completions)


def group_advantages(rewards: Sequence[float] | torch.Tensor, group_size: int, eps: float = 1e-4) -> torch.Tensor:
    """GRPO advantages `(r - mean r) / (std r + eps)` within consecutive groups of `group_size` samples of
    one prompt; std is the sample std (Bessel-corrected) and eps 1e-4, as in TRL's GRPOTrainer."""
    r = torch.as_tensor(rewards, dtype=torch.float64)
    if group_size < 2 or r.numel() % group_size:
        raise GraftlabError(f"GRPO needs groups of >= 2 samples; got {r.numel()} rewards in groups of {group_size}")
    g = r.view(-1, group_size)
    return ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + eps)).view(-1)


@dataclass(frozen=True, kw_only=True)
class TeacherConfig(RunSettings):
    """Defaults are the schema's `pedagogical` section and top-level `precision` (`graftlab.schema`)."""

    group_size: int = schema_default("pedagogical", "group_size")  # GRPO samples per prompt
    prompts_per_step: int = schema_default("pedagogical", "prompts_per_step")
    steps: int = schema_default("pedagogical", "steps")
    lr: float = schema_default("pedagogical", "lr")
    temperature: float = schema_default("pedagogical", "temperature")
    max_new_tokens: int = schema_default("pedagogical", "max_new_tokens")
    kl: float = schema_default("pedagogical", "kl")  # GRPO's k3 KL to the initial teacher; 0: no reference model
    max_grad_norm: float = schema_default("pedagogical", "max_grad_norm")  # 0: no clipping
    template: str = TEACHER_TEMPLATE  # the teacher's user turn (`teacher_prompt`)
    reward: RewardConfig = field(default_factory=RewardConfig)
    # Completions per forward and backward pass; accumulation makes up prompts_per_step x group_size.
    micro_batch_size: int | str = schema_default("pedagogical", "micro_batch_size")

    @property
    def completions(self) -> int:
        """Completions of one GRPO step: what its micro-batches make up."""
        return self.prompts_per_step * self.group_size


def make_reward_func(student, tokenizer, cfg: RewardConfig, grade=is_correct):
    """A reward function for TRL's GRPOTrainer over a dataset with `student_prompt` (the chat-formatted
    problem alone) and `answer` columns, correctness judged by `grade(completion, answer)`; logs the
    mean of every component per step."""

    def pedagogical(prompts, completions, completion_ids, student_prompt, answer, log_metric=None, **_):
        # TRL's `completions` skip special tokens, `</think>` among them; grading needs the exact text.
        texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=False)
        p_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in student_prompt]
        rows = reward_components(
            gaps_from_ids(student, p_ids, completion_ids),
            [grade(t, a) for t, a in zip(texts, answer)],
            cfg,
            completions=texts,
        )
        if log_metric is not None:
            for key in COMPONENTS:
                log_metric(f"pedagogical/{key}", sum(float(r[key]) for r in rows) / len(rows))
        return [r["reward"] for r in rows]

    return pedagogical


def teacher_dataset(tokenizer, problems, template: str = TEACHER_TEMPLATE):
    """GRPO's prompts (problem + reference solution, posed by `template`) with the student's view and the
    answer beside them."""
    from datasets import Dataset

    from graftlab.synth.star import require_problems

    return Dataset.from_list(
        [
            {
                "prompt": teacher_chat(tokenizer, p, template),
                "student_prompt": chat_prompt(tokenizer, p["prompt"]),
                "answer": str(p["answer"]),
            }
            for p in require_problems(problems, "pedagogical RL")
        ]
    )


def train_teacher(
    post_dir, problems, cfg: TeacherConfig, out_dir, log_out, task: str = "arith", resume=None, curves_out=None
) -> None:
    """GRPO-train a copy of the post model at `post_dir` as the teacher on the problems parquet, graded
    by registry task `task`; write the teacher to `out_dir` (atomically, with provenance) and the
    per-step log, reward components included, as JSON lines to `log_out`, and that log's curves
    (`graftlab.train.curves.plot_training`: GRPO's loss, reward, entropy) to `curves_out`, by default
    `training.png` beside it. With `resume` (a `graftlab.train.resume.Resume`), the Trainer saves its
    full state there every `resume.minutes` and a rerun continues from the newest."""
    import polars as pl
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    from graftlab.io.atomic import atomic_dir
    from graftlab.io.provenance import write_provenance
    from graftlab.sampling import trl_grpo_trainer
    from graftlab.tasks import get_task
    from graftlab.train import diverge
    from graftlab.train import resume as rs
    from graftlab.train.grpo import context as grpo_context
    from graftlab.train.grpo import micro as grpo_micro
    from graftlab.train.precision import WEIGHTS_DTYPE, announce, cast_saved, save_dtype
    from graftlab.train.settings import recorded

    torch.set_num_threads(cfg.threads)
    precision = announce(cfg.precision)
    dtype = save_dtype(cfg.save_dtype, post_dir)
    tok = AutoTokenizer.from_pretrained(post_dir)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    student = AutoModelForCausalLM.from_pretrained(post_dir, dtype=WEIGHTS_DTYPE)
    student = student.eval().requires_grad_(False).to(device)
    dataset = teacher_dataset(tok, pl.read_parquet(problems), cfg.template)
    # The prompts of every step, in an order fixed in advance and read in sequence (shuffle_dataset off).
    # TRL's RepeatSampler draws each epoch's order from one generator that a resumed Trainer does not
    # advance past the epochs already done: resumed across an epoch boundary, it repeated the first
    # epoch's order and ended on other weights (tests/test_resume.py compares them bit for bit).
    problems_read = len(dataset)
    dataset = dataset.select(passes(len(dataset), cfg.steps * cfg.prompts_per_step, "pedagogical-order", cfg.seed))
    if resume is not None:
        resume.open(rs.fingerprint(cfg, post=str(post_dir), problems=str(problems), task=task))
    with atomic_dir(out_dir) as tmp:
        model = AutoModelForCausalLM.from_pretrained(post_dir, dtype=WEIGHTS_DTYPE)
        # Beside the frozen student, already on the GPU, and with a KL term the reference model TRL loads.
        micro = grpo_micro(
            cfg.micro_batch_size, cfg.completions, dataset["prompt"], cfg.max_new_tokens, cfg.kl, tok, model
        )
        args = _grpo_args(
            cfg,
            resume.dir if resume is not None else tmp / ".trainer",
            precision,
            micro,
            grpo_context(dataset["prompt"], cfg.max_new_tokens, tok, model),
        )
        trainer = trl_grpo_trainer(
            GRPOTrainer,
            args,
            model=model,
            reward_funcs=[make_reward_func(student, tok, cfg.reward, get_task(task).grade)],
            train_dataset=dataset,
            processing_class=tok,
            callbacks=[diverge.trainer_callback("Pedagogical RL teacher")]
            + ([rs.trainer_callback(resume)] if resume is not None else []),
        )
        trainer.train(resume_from_checkpoint=rs.last_checkpoint(resume) if resume is not None else None)
        trainer.model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        cast_saved(tmp, dtype)
        shutil.rmtree(tmp / ".trainer", ignore_errors=True)
        inputs = {"post": str(post_dir), "problems": str(problems)}
        write_provenance(tmp, inputs, recorded(cfg), extra={"problems": problems_read, "save_dtype": dtype})
    steps = [h for h in trainer.state.log_history if "pedagogical/reward" in h]
    from graftlab.train.curves import write_step_log

    write_step_log(steps, log_out, curves_out)
    if resume is not None:
        resume.finish()


def _grpo_args(cfg: TeacherConfig, work: Path, precision, micro: int | None = None, context: tuple | None = None):
    """GRPO's arguments (`graftlab.train.trl_args.grpo_args`) at TRL's defaults for the rest: the teacher
    is GRPO with its own reward."""
    from graftlab.train.precision import accumulation
    from graftlab.train.trl_args import grpo_args

    batch = cfg.completions
    micro = micro or batch
    print(f"batch: {batch} = {micro} x {accumulation(batch, micro)} accumulated", flush=True)
    return grpo_args(cfg, work, batch, micro, precision, generations=cfg.group_size, beta=cfg.kl, context=context)


def teacher_traces(sampler, tokenizer, problems, cfg, grade=is_correct, template: str = TEACHER_TEMPLATE) -> tuple:
    """(traces, stats) of the trained teacher: STaR's rounds (`cfg` a `StarConfig`, rationalization
    unused) over the teacher prompts (posed by `template`, as in its training), the first verified
    (`grade(completion, answer)`) and well-formed completion kept per problem. The stored prompt is the
    problem alone, and a completion that mentions the reference (`REFERENCE_MARKER`) is not kept: the
    student who learns from the trace never sees a solution. The reward's length floor is not applied
    here: a short trace that thinks is a fine example, only an empty thought is the reward hack."""
    import polars as pl

    from graftlab.sampling import SamplingConfig
    from graftlab.synth.star import first_verified, require_problems, star_stats

    rows = require_problems(problems, "pedagogical RL teacher traces")
    prompts = [teacher_chat(tokenizer, r, template) for r in rows]

    def accept(i: int, completion: str) -> bool:
        leaks = REFERENCE_MARKER.lower() in completion.lower()
        return grade(completion, str(rows[i]["answer"])) and well_formed(completion, 0, 0) and not leaks

    scfg = SamplingConfig(1, cfg.temperature, cfg.top_p, cfg.max_new_tokens, cfg.seed)
    found, drawn = first_verified(
        sampler, prompts, accept, cfg.attempts, cfg.attempts_per_round, scfg, "teacher-traces"
    )
    if not found:
        raise GraftlabError(f"the teacher verified none of {len(rows)} problems in {cfg.attempts} attempts: no traces")
    traces = [
        {
            "id": r["id"],
            "task": r.get("task"),
            "prompt": r["prompt"],
            "completion": found[i].completion,
            "attempts": found[i].attempt,
        }
        for i, r in enumerate(rows)
        if i in found
    ]
    return pl.DataFrame(traces), star_stats(len(rows), found, {}, drawn, 0, cfg)


def write_teacher_traces(
    teacher_dir,
    problems,
    cfg,
    out,
    stats_out,
    backend: str = "auto",
    task: str = "arith",
    template: str = TEACHER_TEMPLATE,
) -> dict:
    """Sample the trained teacher at `teacher_dir` on the problems parquet, graded by registry task
    `task`; write the stats JSON, then the traces parquet."""
    import polars as pl
    from transformers import AutoTokenizer

    from graftlab.io.atomic import write_table_with_stats
    from graftlab.sampling import load_sampler, sampling_record
    from graftlab.tasks import get_task

    sampler, tok = load_sampler(teacher_dir, backend), AutoTokenizer.from_pretrained(teacher_dir)
    traces, stats = teacher_traces(sampler, tok, pl.read_parquet(problems), cfg, get_task(task).grade, template)
    stats["sampling"] = sampling_record(sampler)
    write_table_with_stats(traces, stats, out, stats_out)
    return stats
