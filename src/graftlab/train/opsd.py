"""On-policy self-distillation (OPSD; docs/methods.md#opsd, the grafting paper's on-policy baseline).

Each step the student samples one response (n = 1) to each bare problem of a batch; a frozen copy of the
initial model, the teacher, reads the same response tokens after a prompt that also holds the
demonstration (`template`, with `{problem}` and `{demonstration}`); the loss is D_alpha between teacher
and student over the teacher's top-k tokens, renormalised, averaged over response tokens
(`graftlab.train.divergence`); AdamW updates the student. Every step records its sampling and update
seconds apart (the paper's §7 latency split).

Our own loop rather than a TRL trainer, measured against TRL 1.16: GKD, GOLD and the distillation
trainers give the teacher the student's own prompt, so the demonstration cannot reach it. The
experimental `SDFTTrainer` can (a `privileged_context` column, a frozen `base` teacher, n = 1 on-policy
samples, the same D_alpha convention) and runs on the CPU, but it takes the top-k of the *student's*
logits where OPSD takes the teacher's (the same only when k >= vocabulary: on the tiny world's 84
tokens its losses equal ours to 1.4e-6; at k = 10 they differ by up to 5.2 nats per token, and real
vocabularies are 150k), and it averages tokens per sequence before averaging sequences, where OPSD
pools all response tokens. Nor does it time sampling and update apart, which the latency comparison
needs. Overriding its loss would leave little of it; the loop below is about 100 lines.
"""

import functools
import time
from dataclasses import dataclass

import torch

from graftlab.errors import GraftlabError
from graftlab.methods import METHODS
from graftlab.methods.spec import fill, refuse
from graftlab.sampling import response_logits
from graftlab.schema import schema_default
from graftlab.streams import passes, stream_seed
from graftlab.tasks import chat_prompt
from graftlab.train import shard
from graftlab.train.onpolicy import PairStep
from graftlab.train.precision import (
    Precision,
    accumulation,
    checkpointing,
    micro_batch,
)
from graftlab.train.settings import RunSettings


@dataclass(frozen=True, kw_only=True)
class OpsdConfig(RunSettings):
    alpha: float
    lr: float
    steps: int
    save_steps: tuple[int, ...] = ()  # checkpoints kept; empty: the last step only
    batch_size: int = schema_default("opsd", "batch_size")  # problems per sampled batch, one sample each
    updates_per_batch: int = schema_default("opsd", "updates_per_batch")  # steps a pass, each on 1/U of it
    epochs_per_batch: int = schema_default("opsd", "epochs_per_batch")  # passes over each sampled batch
    max_grad_norm: float = schema_default("opsd", "max_grad_norm")  # 0: no clipping
    top_k: int = schema_default("opsd", "top_k")  # the teacher's support (clamped to the vocabulary)
    max_new_tokens: int = schema_default("opsd", "max_new_tokens")
    temperature: float = schema_default("opsd", "temperature")
    template: str = schema_default("opsd", "template")
    micro_batch_size: int | str = schema_default("opsd", "micro_batch_size")  # of the update; batch sampled whole

    def __post_init__(self) -> None:
        refuse("OPSD", METHODS["opsd"].spec.check(vars(self)))  # the config's checks (graftlab.methods.opsd)

    @property
    def share(self) -> int:
        """Problems per optimizer step."""
        return self.batch_size // self.updates_per_batch

    def checkpoints(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.save_steps))) or (self.steps,)


def teacher_text(template: str, problem: str, demo: str) -> str:
    return fill(template, problem=problem, demonstration=demo)


class Opsd(PairStep):
    """The student being trained, the frozen teacher and the optimizer of one OPSD run."""

    name = "OPSD"

    def __init__(
        self, student, teacher, tokenizer, cfg: OpsdConfig, precision: Precision | None = None, micro: int | None = None
    ) -> None:
        super().__init__(student, teacher, tokenizer, cfg, cfg.share, precision, micro)

    def sample(self, problems: list[str], step: int) -> list[tuple[list[int], list[int]]]:
        from graftlab.sampling import SamplingConfig

        self.student.eval()
        seed = stream_seed("opsd-sampling", self.cfg.seed, step)
        scfg = SamplingConfig(1, self.cfg.temperature, 1.0, self.cfg.max_new_tokens, seed)
        prompts = [chat_prompt(self.tok, p) for p in problems]
        if self.sampler.backend == "vllm":
            # On-policy: the engine must sample the student as it is after the last update. Our own loop
            # does what TRL's colocate mode does inside its trainers: an in-process engine, weights written.
            self.sampler.load_weights(shard.full_parameters(self.student))
        with self.autocast():
            samples = self.sampler.sample_ids(prompts, scfg)
        return [s[0] for s in samples]

    def update(self, samples, teacher_prompts: list[str]) -> tuple[float, float]:
        from graftlab.train.divergence import generalized_divergence

        enc = lambda t: self.tok(t, add_special_tokens=False)["input_ids"]  # noqa: E731
        t_prompts = [enc(chat_prompt(self.tok, t)) for t in teacher_prompts]
        s_prompts, responses = [list(p) for p, _ in samples], [list(r) for _, r in samples]
        total = shard.total(sum(map(len, responses)))  # the whole batch's, over every process's share
        self.student.train()
        self.optimizer.zero_grad(set_to_none=True)
        batch_loss = 0.0
        for lo in range(0, len(samples), self.micro):
            part = slice(lo, lo + self.micro)
            with torch.no_grad(), self.autocast():
                t_logits, _ = response_logits(self.teacher, t_prompts[part], responses[part])
            with self.autocast():
                s_logits, mask = response_logits(self.student, s_prompts[part], responses[part])
                loss = generalized_divergence(s_logits, t_logits, mask, self.cfg.alpha, "teacher_topk", self.k)
            # The batch's loss is the mean over all its response tokens: a micro-batch's mean counts by its
            # share of them, so the accumulated gradient is the whole batch's. Backward outside autocast, as
            # torch advises: it runs each op in its forward's dtype anyway.
            share = mask.sum().item() / total if total else 1.0
            (loss * share * self.scale).backward()
            batch_loss += loss.item() * share
        batch_loss = shard.total(batch_loss)
        return batch_loss, self.optimizer_step(batch_loss)

    @classmethod
    def start(cls, tok, student, teacher, precision: Precision, cfg: OpsdConfig, examples: list[dict]) -> "Opsd":
        """The step function of a run whose pair is loaded: its update's micro-batch sized."""
        run = cls(student, teacher, tok, cfg, precision, _micro(cfg, examples, tok, student))
        recompute = "on" if checkpointing(cfg.gradient_checkpointing) else "off"
        processes = shard.world()[1]
        accumulated = accumulation(cfg.share // processes, run.micro)
        print(
            f"batch: {cfg.batch_size} problems, {cfg.updates_per_batch} update(s) of {cfg.share} = {run.micro} x "
            f"{accumulated} accumulated x {processes} processes, {cfg.epochs_per_batch} pass(es); "
            f"gradient checkpointing {recompute}",
            flush=True,
        )
        return run

    def rounds(self, examples: list[dict]):
        """Each sampled batch with the optimizer steps it serves (`PairStep.serving`)."""
        return self.serving(batches(examples, self.cfg))

    def state(self) -> dict:
        return {"model": self.student}

    def finals(self) -> dict:
        return {}

    def steps(self, batch: list[dict], steps: range):
        """Sample the batch once (over several processes each its share of the problems), then one optimizer
        step per step on its share of the samples: each update takes the same samples as one process would,
        each process its part of them. A reused sample is distilled as it is: OPSD's loss is a divergence on
        given tokens, with no importance weight."""
        cfg = self.cfg
        start = time.perf_counter()
        mine = shard.part(batch, "OPSD: the problems of a batch")
        samples = shard.everyone(self.sample([b["prompt"] for b in mine], steps[0]))
        texts = [teacher_text(cfg.template, b["prompt"], b["demonstration"]) for b in batch]
        sample_s = time.perf_counter() - start
        for step in steps:
            began = time.perf_counter()
            self.step = step
            share, own = self.share_of(samples, steps, step, "OPSD: the samples of an update")
            loss, norm = self.update(own, self.share_of(texts, steps, step, "OPSD: the samples of an update")[1])
            yield {
                "step": step,
                "loss": loss,
                "grad_norm": norm,
                "sample_s": sample_s if step == steps[0] else 0.0,
                "update_s": time.perf_counter() - began,
                "response_tokens": sum(len(r) for _, r in share),
            }


def batches(examples: list[dict], cfg: OpsdConfig):
    """The sampled batches of a run of `cfg`, passing over the examples in a fresh seeded order each epoch."""
    size, count = cfg.batch_size, -(-cfg.steps // (cfg.updates_per_batch * cfg.epochs_per_batch))
    order = passes(len(examples), size * count, "opsd-order", cfg.seed)
    for start in range(0, size * count, size):
        yield [examples[i] for i in order[start : start + size]]


def train_opsd(
    post_dir, examples: list[dict], cfg: OpsdConfig, out_dir, inputs: dict | None = None, resume=None, processes=1
) -> list[dict]:
    """OPSD of the model at `post_dir` on `examples` (`prompt`, `demonstration`); writes `out_dir/step~N`
    for every checkpoint, `out_dir/steps.jsonl` (loss, sampling and update seconds per step) and
    `training.png`, all at once when the run ends (`graftlab.train.onpolicy.OnPolicyRun`). With `resume` (a
    `graftlab.train.resume.Resume`), the full state is saved every `resume.minutes` and a rerun continues
    from it. Over `processes` (one per GPU), sharded (`graftlab.train.shard`)."""
    from graftlab.train import resume as rs
    from graftlab.train.onpolicy import OnPolicyRun

    if not examples:
        raise GraftlabError("OPSD: no training examples")
    mark = rs.fingerprint(cfg, post=str(post_dir), examples=len(examples))
    start = functools.partial(Opsd.start, cfg=cfg, examples=examples)  # picklable: a launch sends it
    return OnPolicyRun("OPSD", "examples", post_dir, cfg, start).train(
        examples, out_dir, inputs, resume, mark, processes=processes
    )


def _micro(cfg: OpsdConfig, examples: list[dict], tok, student) -> int:
    """The update's micro-batch under `cfg.micro_batch_size`; `auto` sizes it for the longest sequence the
    teacher reads (the student's are shorter), the student and the frozen teacher already on the GPU."""
    enc = lambda t: len(tok(chat_prompt(tok, t), add_special_tokens=False)["input_ids"])  # noqa: E731

    def longest() -> int:
        texts = [teacher_text(cfg.template, e["prompt"], e["demonstration"]) for e in examples]
        return max(map(enc, texts)) + cfg.max_new_tokens

    return micro_batch(cfg.micro_batch_size, cfg.share // shard.world()[1], longest, student)
