"""SDPO: self-distilled policy optimisation of the post model (docs/methods.md#sdpo; the second paper,
*Denser ≠ Better*, arXiv 2607.01763, after the official code, lasgroup/SDPO).

Each sampled batch: G rollouts of every problem, graded by the problem's task verifier. A rollout's
teacher is the same network under a teacher schedule (`graftlab.train.teacher`) reading the reprompt
`{prompt}{solution}{feedback}\\n\\nCorrectly solve the original question.`: `solution` is the first
successful *sibling* of the same problem (never the rollout itself; the official rule), its thinking
stripped (`thinking: strip`, the official code's) or kept; `feedback` the verifier's message on the
rollout's own answer (optional). A rollout with no successful sibling has no teacher and gets zero loss;
its share is logged. The loss is D_alpha (alpha 0.5: the Jensen-Shannon divergence) over the student's
top-k tokens plus a tail bucket (`graftlab.train.divergence`, "student_topk_tail"), pooled over the
distilled tokens of the update: every response token (`tokens: all`, the official code's) or the answer
tokens after `</think>` (`tokens: answer`). `sdpo` and `sdpo_cot` are named settings of the two switches
(`graftlab.methods.sdpo.run_density`); without a think block every setting is the same
(`answer_share` in the step log says how much of the response the answer is). A batch may serve
`updates_per_batch` optimizer steps a pass, each on its own share of the rollouts, over
`epochs_per_batch` passes; each token's loss is then weighted by pi_now / pi_sampled,
clipped at `is_clip` (2), as the official code does for its off-policy mini-batches. The teacher follows
its schedule once a batch's steps are done, as the official code's does; the gradient is clipped at
`max_grad_norm` (1, the official code's).

Our own loop rather than TRL 1.16's `trl.experimental.sdpo.SDPOTrainer`, measured on the CPU against the
definitions above (pico Qwen3, custom verifier). Its top-k-plus-tail D_alpha agrees with ours (6.7e-8
per token) and its teacher schedules can be configured (ema, and refresh-and-freeze as rate 1 with sync
steps), but:
- it averages tokens per sequence and then over all rollouts, masked ones included: with 6 of 16
  rollouts masked its loss was 1.571e-3 where the pooled token mean (the official code's) is 2.537e-3,
  so its step size shrinks with the masked share;
- it decodes completions with special tokens skipped before stripping the thinking, so where `<think>`
  is a special token (the tiny world, Qwen3) the thinking leaked into the demonstration, and the
  verifier never sees `</think>`;
- it has no answer-only mask (`sdpo`), no per-rollout verifier feedback (a fixed dataset column only),
  no entropy, JS or sampling-versus-update seconds in its logs;
- it reloads the teacher from the model's path, and a resumed run starts the EMA teacher afresh
  (teacher-to-initial distance at step 2: 31.9 uninterrupted, 0.0 resumed).
Overriding all of that would leave little of it, in an API marked experimental. The loop below reuses
OPSD's sampling, logits and precision code.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import NamedTuple

import torch

from graftlab.errors import GraftlabError
from graftlab.methods import METHODS
from graftlab.methods.sdpo import Schedule, parse_schedule
from graftlab.methods.spec import fill, refuse
from graftlab.schema import schema_default
from graftlab.streams import passes, stream_seed
from graftlab.tasks import THINK_CLOSE, extract_answer, get_task
from graftlab.train import shard
from graftlab.train.curves import mean_entropy
from graftlab.train.onpolicy import PairStep
from graftlab.train.precision import Precision, accumulation, checkpointing
from graftlab.train.settings import RunSettings
from graftlab.train.teacher import update_teacher


@dataclass(frozen=True, kw_only=True)
class SdpoConfig(RunSettings):
    lr: float
    steps: int
    teacher: str = "frozen"  # a schedule of graftlab.train.teacher
    tokens: str = "all"  # which response tokens carry the loss: all, or the answer's after </think>
    thinking: str = "strip"  # whether a sibling's thinking stays in the demonstration: strip or keep
    save_steps: tuple[int, ...] = ()  # checkpoints kept; empty: the last step only
    batch_size: int = schema_default("sdpo", "batch_size")  # problems per sampled batch
    generations: int = schema_default("sdpo", "generations")  # G, rollouts per problem
    updates_per_batch: int = schema_default("sdpo", "updates_per_batch")  # steps a pass, each on 1/U of it
    epochs_per_batch: int = schema_default("sdpo", "epochs_per_batch")  # passes over each sampled batch
    max_grad_norm: float = schema_default("sdpo", "max_grad_norm")  # 0: no clipping
    alpha: float = schema_default("sdpo", "alpha")
    top_k: int = schema_default("sdpo", "top_k")  # the student's support, plus a tail bucket
    is_clip: float = schema_default("sdpo", "is_clip")
    feedback: bool = schema_default("sdpo", "feedback")
    template: str = schema_default("sdpo", "template")
    solution_template: str = schema_default("sdpo", "solution_template")
    feedback_template: str = schema_default("sdpo", "feedback_template")
    max_new_tokens: int = schema_default("sdpo", "max_new_tokens")
    temperature: float = schema_default("sdpo", "temperature")
    micro_batch_size: int | str = schema_default("sdpo", "micro_batch_size")  # rollouts per forward/backward

    def __post_init__(self) -> None:
        # The config's checks (graftlab.methods.sdpo); sdpo and sdpo_cot share them.
        refuse("SDPO", METHODS["sdpo"].spec.check(vars(self)))

    @functools.cached_property
    def schedule(self) -> Schedule:
        """The teacher schedule, parsed once (the check above has parsed it without error)."""
        return parse_schedule(self.teacher)

    @property
    def rollouts(self) -> int:
        return self.batch_size * self.generations

    @property
    def share(self) -> int:
        """Rollouts per optimizer step."""
        return self.rollouts // self.updates_per_batch

    def checkpoints(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.save_steps))) or (self.steps,)


def feedback_message(answer: str | None, correct: bool) -> str:
    """The verifier's message on a rollout's own final answer."""
    if answer is None:
        return "Your response never closed its thinking, so it has no final answer."
    return "Your final answer is correct." if correct else f"Your final answer {answer} is incorrect."


def demonstrations(answers: list[str | None], correct: list[bool]) -> list[str | None]:
    """For each rollout of one problem's group, the final answer of its first successful sibling; None
    where no other rollout succeeded. A rollout is never its own demonstration."""
    return [next((answers[j] for j in range(len(correct)) if correct[j] and j != i), None) for i in range(len(correct))]


def answer_mask(response: list[int], close_id: int | None) -> list[int]:
    """1 for the response tokens after its last `</think>` token; with `close_id` None (a task without a
    think block) every token. A response that never closed its thinking has no answer tokens."""
    if close_id is None:
        return [1] * len(response)
    last = max((i for i, t in enumerate(response) if t == close_id), default=None)
    return [0] * len(response) if last is None else [0] * (last + 1) + [1] * (len(response) - last - 1)


class Rollout(NamedTuple):
    prompt: list[int]  # the student's prompt ids
    response: list[int]
    text: str
    correct: bool
    teacher_prompt: list[int] | None  # None: no successful sibling, masked out
    mask: list[int]  # the distilled response tokens (all zero when masked out)
    answer_tokens: int  # response tokens after </think>


class Sdpo(PairStep):
    """The student, the scheduled teacher and the optimizer of one SDPO run."""

    name = "SDPO"

    def __init__(self, student, teacher, tokenizer, cfg: SdpoConfig, precision: Precision | None = None, micro=None):
        super().__init__(student, teacher, tokenizer, cfg, cfg.share, precision, micro)
        self.close_id = _close_id(tokenizer)
        self.keep_teacher = False  # a continual stage's EMA teacher, written for the next stage

    @classmethod
    def start(cls, tok, student, teacher, precision, cfg: SdpoConfig, problems, post_dir, keep_teacher=False) -> Sdpo:
        """The step function of a run whose pair is loaded (the teacher a second copy of the post model, or a
        continual stage's): rollouts per pass sized, the answer-only mask checked against the tokenizer."""
        run = cls(student, teacher, tok, cfg, precision, _micro(cfg, student, tok, problems))
        run.keep_teacher = keep_teacher
        if cfg.tokens == "answer" and run.close_id is None:
            raise GraftlabError(
                f"SDPO: the tokenizer of {post_dir} has no single {THINK_CLOSE} token, so the answer "
                "tokens cannot be told apart; distil every token (tokens: all) instead"
            )
        recompute = "on" if checkpointing(cfg.gradient_checkpointing) else "off"
        processes = shard.world()[1]
        print(
            f"SDPO on {cfg.tokens} tokens, thinking {cfg.thinking}, teacher {cfg.teacher}: {cfg.batch_size} problems x "
            f"{cfg.generations} rollouts, {cfg.updates_per_batch} update(s) of {cfg.share} = {run.micro} x "
            f"{accumulation(cfg.share // processes, run.micro)} accumulated x {processes} processes; "
            f"gradient checkpointing {recompute}",
            flush=True,
        )
        return run

    def rounds(self, problems: list[dict]):
        """Each sampled batch with the optimizer steps it serves (`PairStep.serving`)."""
        return self.serving(batches(problems, self.cfg))

    def steps(self, batch: list[dict], steps: range):
        """Sample the batch once, then one update per step on its share of the rollouts (`PairStep.share_of`),
        and the teacher following its schedule once the batch's steps are done, as the official code does.
        Over several processes each samples its share of the problems; each update takes the same rollouts
        as one process would, each process its part of them. A batch serving more than one step weights the
        later ones by the importance ratio to the log-probs it was sampled at."""
        cfg = self.cfg
        start = time.perf_counter()
        rollouts = shard.everyone(self.sample(shard.part(batch, "SDPO: the problems of a batch"), steps[0]))
        what = "SDPO: the rollouts of an update"
        reused = len(steps) > 1
        old = None
        if reused:
            # This process's rollouts of every share, in share order: the log-probs the samples were drawn at.
            shares = range(steps[0], steps[0] + cfg.updates_per_batch)
            mine = [r for step in shares for r in self.share_of(rollouts, steps, step, what)[1]]
            old = dict(zip(map(id, mine), self.sampled_logprobs(mine)))
        sample_s = time.perf_counter() - start
        for step in steps:
            began = time.perf_counter()
            self.step = step
            share, own = self.share_of(rollouts, steps, step, what)
            update = self.update(own, [old[id(r)] for r in own] if reused else None)
            if step == steps[-1]:
                update_teacher(self.teacher, self.student, cfg.schedule, steps, cfg.steps)
            yield step_record(step, share, update, sample_s if step == steps[0] else 0.0, time.perf_counter() - began)

    def state(self) -> dict:
        return {"model": self.student, "teacher": self.teacher}  # an EMA or refreshed teacher is state too

    def finals(self) -> dict:
        return {"teacher": (self.teacher, {"teacher": self.cfg.teacher})} if self.keep_teacher else {}

    def sample(self, problems: list[dict], step: int) -> list[Rollout]:
        """G graded rollouts of each problem, with their teachers' prompts and distilled-token masks."""
        from graftlab.sampling import SamplingConfig

        self.student.eval()
        seed = stream_seed("sdpo-sampling", self.cfg.seed, step)
        scfg = SamplingConfig(self.cfg.generations, self.cfg.temperature, 1.0, self.cfg.max_new_tokens, seed)
        tasks = [get_task(p["task"]) for p in problems]
        prompts = [t.chat_prompt(self.tok, p["prompt"]) for t, p in zip(tasks, problems)]
        if self.sampler.backend == "vllm":
            self.sampler.load_weights(shard.full_parameters(self.student))  # on-policy: the student as it is now
        with self.autocast():
            groups = self.sampler.sample_ids(prompts, scfg)
        return [r for p, t, g in zip(problems, tasks, groups) for r in self._group(p, t, g)]

    def _group(self, problem: dict, task, samples) -> list[Rollout]:
        sampled = [self.tok.decode(r, skip_special_tokens=False) for _, r in samples]
        texts = [task.turn(s) for s in sampled]
        correct = [bool(task.grade(t, problem["answer"])) for t in texts]
        answers = [_final_answer(t) for t in texts]
        shown = answers if self.cfg.thinking == "strip" else [_whole(s) for s in sampled]
        close = self.close_id if task.thinking else None
        rollouts = []
        for (prompt, response), text, ok, demo, own in zip(
            samples, texts, correct, demonstrations(shown, correct), answers
        ):
            answer = answer_mask(list(response), close)
            if demo is None:
                rollouts.append(Rollout(list(prompt), list(response), text, ok, None, [0] * len(response), sum(answer)))
                continue
            c = self.cfg
            said = fill(c.feedback_template, feedback=feedback_message(own, ok)) if c.feedback else ""
            reprompt = fill(
                c.template, prompt=problem["prompt"], solution=fill(c.solution_template, solution=demo), feedback=said
            )
            ids = self.tok(task.chat_prompt(self.tok, reprompt), add_special_tokens=False)["input_ids"]
            mask = answer if c.tokens == "answer" else [1] * len(response)
            rollouts.append(Rollout(list(prompt), list(response), text, ok, ids, mask, sum(answer)))
        return rollouts

    @torch.no_grad()
    def sampled_logprobs(self, rollouts: list[Rollout]) -> list[torch.Tensor]:
        """log pi(token) of every response token under the student as it sampled them: the denominator of
        the importance weight on a reused batch."""
        from graftlab.sampling import response_logits

        self.student.eval()
        out = []
        for lo in range(0, len(rollouts), self.micro):
            part = rollouts[lo : lo + self.micro]
            with self.autocast():
                logits, _ = response_logits(self.student, [r.prompt for r in part], [r.response for r in part])
            lp = _token_logprobs(logits, part)
            out += [lp[i, : len(r.response)] for i, r in enumerate(part)]
        return out

    def update(self, rollouts: list[Rollout], old: list[torch.Tensor] | None) -> dict:
        """One optimizer step on `rollouts`: the pooled mean of the weighted D_alpha over their distilled
        tokens. Returns the loss and the student's entropy and teacher-student JS of the step."""
        total = int(shard.total(sum(sum(r.mask) for r in rollouts)))  # every process's share's
        self.student.train()
        self.optimizer.zero_grad(set_to_none=True)
        stats = {"loss": 0.0, "entropy_sum": 0.0, "tokens": 0, "js_sum": 0.0}
        for lo in range(0, len(rollouts), self.micro):
            part = rollouts[lo : lo + self.micro]
            self._micro_step(part, None if old is None else old[lo : lo + self.micro], total, stats)
        stats = {key: shard.total(value) for key, value in stats.items()}
        norm = self.optimizer_step(stats["loss"]) if total else None
        return {
            "loss": stats["loss"],
            "grad_norm": norm,
            "entropy": stats["entropy_sum"] / max(stats["tokens"], 1),
            "js": stats["js_sum"] / total if total else None,
            "distilled_tokens": total,
        }

    def _micro_step(self, part: list[Rollout], old, total: int, stats: dict) -> None:
        from graftlab.sampling import response_logits
        from graftlab.train.divergence import token_divergence

        with self.autocast():
            s_logits, every = response_logits(self.student, [r.prompt for r in part], [r.response for r in part])
        tokens = int(every.sum().item())
        stats["entropy_sum"] += mean_entropy(s_logits, every) * tokens  # pooled over the update's micro-batches
        stats["tokens"] += tokens
        rows = [i for i, r in enumerate(part) if r.teacher_prompt is not None and sum(r.mask)]
        if not total:
            return  # no process has a token to distil (`total` is all of theirs): no one steps
        if not rows:
            if self.scale > 1:
                # Sharded, a process with nothing to distil still meets the others' teacher forward and
                # backward: FSDP gathers and reduces a unit's shards with every process at once.
                with torch.no_grad(), self.autocast():
                    response_logits(self.teacher, [part[0].prompt], [part[0].response])
                (s_logits.sum() * 0.0).backward()
            return
        taught = [part[i] for i in rows]
        with torch.no_grad(), self.autocast():
            t_logits, _ = response_logits(
                self.teacher, [r.teacher_prompt for r in taught], [r.response for r in taught]
            )
        s_taught = s_logits[rows, : t_logits.shape[1]]
        d = token_divergence(s_taught, t_logits, self.cfg.alpha, "student_topk_tail", self.k)
        mask = _mask(taught, d)
        weight = mask
        if old is not None:
            # pi_now / pi_sampled per token, detached and clipped: the later updates of a batch are off-policy.
            now = _token_logprobs(s_taught, taught)
            sampled = _pad([old[i] for i in rows], now.shape[1]).to(now.device)
            weight = mask * torch.exp(now.detach() - sampled).clamp(max=self.cfg.is_clip)
        loss = torch.where(mask.bool(), d * weight, torch.zeros_like(d)).sum() / total
        (loss * self.scale).backward()
        stats["loss"] += loss.item()
        js = (
            d.detach()
            if self.cfg.alpha == 0.5
            else token_divergence(s_taught.detach(), t_logits, 0.5, "student_topk_tail", self.k)
        )
        stats["js_sum"] += float((js * mask).sum())


def _close_id(tok) -> int | None:
    """The id of `</think>` as one token; None where the tokenizer has no such token (then the answer-only
    mask cannot be taken by ids, and an `sdpo` run on a thinking task is refused when it meets one)."""
    ids = tok(THINK_CLOSE, add_special_tokens=False)["input_ids"]
    return ids[0] if len(ids) == 1 else None


def _final_answer(turn: str) -> str | None:
    """A rollout's final answer, thinking stripped (all after its last </think>, as the official code's
    remove_thinking_from_demonstration leaves): what a sibling shows as its solution under `strip`."""
    answer = extract_answer(turn)
    return answer if answer else None


def _whole(sampled: str) -> str | None:
    """A rollout's sampled text, its thinking kept: what a sibling shows under `keep` (a task without a think
    block samples none, and its pre-filled empty one is not shown)."""
    text = sampled.replace("<|im_end|>", "").strip()
    return text or None


def _mask(rollouts: list[Rollout], like: torch.Tensor) -> torch.Tensor:
    m = torch.zeros(like.shape, device=like.device)
    for i, r in enumerate(rollouts):
        m[i, : len(r.mask)] = torch.tensor(r.mask, dtype=m.dtype)
    return m


def _pad(rows: list[torch.Tensor], width: int) -> torch.Tensor:
    out = torch.zeros(len(rows), width)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def _token_logprobs(logits: torch.Tensor, rollouts: list[Rollout]) -> torch.Tensor:
    """log pi of each rollout's own response tokens, [rows, width] (zero past a response's end)."""
    ids = torch.zeros(logits.shape[:2], dtype=torch.long, device=logits.device)
    for i, r in enumerate(rollouts):
        ids[i, : len(r.response)] = torch.tensor(r.response, device=logits.device)
    return torch.log_softmax(logits.float(), -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)


def step_record(step: int, rollouts: list[Rollout], update: dict, sample_s: float, update_s: float) -> dict:
    """One line of steps.jsonl: the update's numbers and what its rollouts looked like."""
    from graftlab.train.curves import repeated_rate

    responses = sum(len(r.response) for r in rollouts)
    answer = sum(r.answer_tokens for r in rollouts)
    return {
        "step": step,
        "loss": update["loss"],
        "grad_norm": update["grad_norm"],  # before clipping; None where nothing was distilled (no step)
        "reward": sum(r.correct for r in rollouts) / len(rollouts),  # the verifier's 1/0
        "accuracy": sum(r.correct for r in rollouts) / len(rollouts),
        "masked_share": sum(r.teacher_prompt is None for r in rollouts) / len(rollouts),
        "entropy": update["entropy"],
        "js": update["js"],
        "response_len": responses / len(rollouts),
        "repeated_rate": repeated_rate([r.text for r in rollouts]),
        "answer_share": answer / responses if responses else None,
        "distilled_tokens": update["distilled_tokens"],
        "response_tokens": responses,
        "sample_s": sample_s,
        "update_s": update_s,
    }


def batches(problems: list[dict], cfg: SdpoConfig):
    """The problems of each sampled batch, passing over them in a fresh seeded order each epoch."""
    rounds = -(-cfg.steps // (cfg.updates_per_batch * cfg.epochs_per_batch))
    order = passes(len(problems), cfg.batch_size * rounds, "sdpo-order", cfg.seed)
    for start in range(0, len(order), cfg.batch_size):
        yield [problems[i] for i in order[start : start + cfg.batch_size]]


def train_sdpo(
    post_dir,
    problems: list[dict],
    cfg: SdpoConfig,
    out_dir,
    inputs: dict | None = None,
    resume=None,
    teacher_dir=None,
    keep_teacher: bool = False,
    processes: int = 1,
):
    """SDPO of the model at `post_dir` on `problems` ([{prompt, answer, task}],
    `graftlab.train.problems.rl_problems`); writes `out_dir/step~N` for every kept checkpoint,
    `steps.jsonl` and `training.png` at once when the run ends (`graftlab.train.onpolicy.OnPolicyRun`). With
    `resume`, the state (the teacher's included) is saved at batch boundaries every `resume.minutes` and a
    rerun continues from it.

    A continual stage (`graftlab.planning.chains`) starts the teacher from `teacher_dir` (the post model for a
    frozen teacher, the previous stage's for an EMA one) instead of a copy of the student, and with
    `keep_teacher` writes the final teacher to `out_dir/teacher` for the next stage. Over `processes` (one
    per GPU), sharded (`graftlab.train.shard`)."""
    from graftlab.train import resume as rs
    from graftlab.train.onpolicy import OnPolicyRun

    if not problems:
        raise GraftlabError("SDPO: no training problems")
    mark = rs.fingerprint(cfg, post=str(post_dir), problems=len(problems), teacher=str(teacher_dir))

    # Picklable: a launch over several processes sends it.
    start = functools.partial(Sdpo.start, cfg=cfg, problems=problems, post_dir=post_dir, keep_teacher=keep_teacher)
    frozen = cfg.schedule.kind == "frozen"
    run = OnPolicyRun("SDPO", "problems", post_dir, cfg, start, frozen_teacher=frozen)
    extras = ("teacher",) if keep_teacher else ()
    return run.train(
        problems, out_dir, inputs, resume, mark, teacher_dir=teacher_dir, extras=extras, processes=processes
    )


def _micro(cfg: SdpoConfig, student, tok, problems: list[dict]) -> int:
    """Rollouts per forward and backward pass; `auto` sizes it on CUDA for the longest reprompt the teacher
    can read (the longest problem, the template, a sibling's answer of up to a full response) plus a full
    response, beside the teacher; on a CPU the whole update."""
    from graftlab.train.precision import micro_batch

    def longest() -> int:
        prompt = max(len(tok(get_task(p["task"]).chat_prompt(tok, p["prompt"]))["input_ids"]) for p in problems)
        template = len(tok(cfg.template + cfg.solution_template + cfg.feedback_template)["input_ids"])
        return prompt + template + 2 * cfg.max_new_tokens

    return micro_batch(cfg.micro_batch_size, cfg.share // shard.world()[1], longest, student)
