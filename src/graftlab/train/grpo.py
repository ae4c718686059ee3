"""GRPO of the post model (docs/methods.md, GRPO): the second paper's sequence-level RL baseline.

Each step the policy samples `generations` (G) completions of each of `batch_size` problems of the
setting's SFT data (`graftlab.train.problems.rl_problems`) at `temperature`; the task's verifier rewards
each 1 or 0 (`get_task(task).grade(task.turn(completion), answer)`; a knowledge question's pre-filled
empty think block is part of its prompt, and its greedy decoding is not used: RL samples). The
advantage of a completion is its reward minus its group's mean (the second paper's baseline), divided by
the group's reward std when `scale_rewards` is on; the loss is the clipped importance-ratio objective
and, with `beta` > 0, beta times TRL's k3 estimate of the KL to the post model. A sampled batch serves
`updates_per_batch` optimizer steps a pass, each on its own 1/U of the completions (TRL's
`steps_per_generation` at U steps' accumulation), over `epochs_per_batch` passes (`num_iterations`).

TRL 1.16's `GRPOTrainer` does all of that; what we set and measured on the CPU (tests/test_grpo.py):

- Groups whose rewards are all equal get advantage exactly 0 (r - mean r is 0, divided by 0 + 1e-4),
  hence a per-token loss of exactly 0 and, with beta = 0, a zero gradient: a step on a batch of
  all-correct or all-wrong groups leaves every weight bit for bit where it was (weight decay is 0).
- The std is the sample std (Bessel-corrected), eps 1e-4 (as `graftlab.synth.pedagogical.group_advantages`);
  `scale_rewards: false` is TRL's `scale_rewards="none"`, mean-centred only.
- The loss is per token: TRL's default `loss_type="dapo"` (set explicitly here) sums the per-token
  losses over every response token of the step's batch and divides by their count, across
  micro-batches too, as OPSD pools its tokens and verl's `token-mean` does. On-policy (the ratio is 1)
  the logged loss is therefore -sum_i A_i n_i / sum_i n_i over completions of n_i tokens, not 0 as the
  per-sequence mean of zero-mean advantages would be.
- beta = 0 (TRL's default and ours) loads no reference model at all and logs no `kl`. With beta > 0,
  TRL reloads the post model as the reference; the per-token term is k3 =
  exp(ref - logp) - (ref - logp) - 1, multiplied by the importance ratio (TRL's default
  `use_bias_correction_kl`): its value is k3 (the ratio is 1 on-policy), but the ratio is differentiable,
  so the gradient is (logp - ref) grad logp, the unbiased gradient of KL(policy || post); k3 alone would
  give (1 - exp(ref - logp)) grad logp, whose expectation is the gradient of the forward KL.
- Defaults we change: a constant learning rate (TRL's is linear decay to 0), as OPSD and SDPO use
  plain AdamW; the prompt order fixed in advance (`graftlab.streams.passes`, `shuffle_dataset` off, as the
  Pedagogical RL teacher does, so a resumed run reads the prompts an uninterrupted one did); gradient
  clipping at `max_grad_norm` (TRL's default 1, the official code's). Kept as TRL has them: AdamW
  without weight decay, truncated completions trained on.

What TRL does not do, done here: sampling and update seconds apart (TRL logs only a `step_time` that
includes generation). `_Trainer` times `_generate`, TRL's rollout (tokenising the prompts, generation,
and with vLLM the weights moved into the engine) as `sample_s`; the rest of the step's wall time is
`update_s`: rewards, advantages, the old and reference log-probabilities where needed, forward,
backward and the optimizer step. On a step that reuses its batch (`updates_per_batch` > 1) `sample_s`
is 0. Also ours: kept checkpoints written at their steps by a callback, and a step log of the sampled
batch each step trains on (reward, accuracy, response length and tokens, the share of looping tails,
the share of groups with all-equal rewards, which carry no gradient) beside TRL's loss, entropy
(mean over response tokens at the update's forward pass) and, with beta > 0, kl.
"""

import functools
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from graftlab.errors import GraftlabError
from graftlab.methods import METHODS
from graftlab.methods.spec import refuse
from graftlab.schema import schema_default
from graftlab.streams import passes
from graftlab.train import shard
from graftlab.train.settings import RunSettings

# Our per-step metrics ride in TRL's logs under this prefix, so the Trainer's log history (restored on
# resume from its checkpoint) holds them beside TRL's own.
PREFIX = "grpo/"
# TRL metrics copied into the step log under our names, where TRL logged them.
TRL_METRICS = {
    "loss": "loss",
    "grad_norm": "grad_norm",  # before clipping (the Trainer's `_clip_grad_norm` returns it)
    "entropy": "entropy",
    "kl": "kl",
    "clip_ratio/region_mean": "clipped",
}


@dataclass(frozen=True, kw_only=True)
class GrpoConfig(RunSettings):
    """Defaults are the schema's `grpo` section and top-level keys (`graftlab.schema`)."""

    lr: float
    steps: int = schema_default("grpo", "steps")  # optimizer steps
    save_steps: tuple[int, ...] = ()  # checkpoints kept; empty: the last step only
    batch_size: int = schema_default("grpo", "batch_size")  # problems per sampled batch
    generations: int = schema_default("grpo", "generations")  # G, samples per problem: one group
    updates_per_batch: int = schema_default("grpo", "updates_per_batch")  # steps a pass, each on 1/U of it
    epochs_per_batch: int = schema_default("grpo", "epochs_per_batch")  # passes over a batch: num_iterations
    max_grad_norm: float = schema_default("grpo", "max_grad_norm")  # 0: no clipping
    micro_batch_size: int | str = schema_default("grpo", "micro_batch_size")  # completions per pass
    beta: float = schema_default("grpo", "beta")  # k3 KL to the post model; 0: no reference model
    epsilon: float = schema_default("grpo", "epsilon")  # clip range of the importance ratio
    scale_rewards: bool = schema_default("grpo", "scale_rewards")  # divide advantages by the group's std
    max_new_tokens: int = schema_default("grpo", "max_new_tokens")
    temperature: float = schema_default("grpo", "temperature")

    def __post_init__(self) -> None:
        refuse("GRPO", METHODS["grpo"].spec.check(vars(self)))  # the config's checks (graftlab.methods.grpo)

    @property
    def completions(self) -> int:
        """Completions a sampled batch holds."""
        return self.batch_size * self.generations

    @property
    def share(self) -> int:
        """Completions an optimizer step trains on: what micro-batches make up."""
        return self.completions // self.updates_per_batch

    def checkpoints(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.save_steps))) or (self.steps,)


@dataclass
class _Clock:
    """The current step's timing and the sampled batch it trains on, shared by the trainer, its reward
    function and the checkpoint callback."""

    start: float | None = None  # the step's first forward pass
    end: float | None = None  # its optimizer step done, before any checkpoint is written
    sample_s: float = 0.0
    batch: dict = field(default_factory=dict)  # metrics of the batch last sampled
    batches: list = field(default_factory=list)  # rewards, advantages and lengths of every batch (tests read it)


def make_reward(tokenizer, clock: _Clock, generations: int):
    """TRL's reward function over a dataset with `answer` and `task` columns: 1.0 where the task's verifier
    accepts the whole assistant turn, else 0.0; records the sampled batch's metrics in `clock`."""
    from graftlab.tasks import get_task
    from graftlab.train.curves import repeated_rate

    def verifier(prompts, completions, completion_ids, answer, task, **_):
        # TRL's `completions` skip special tokens, `</think>` among them; grading needs the exact text.
        texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=False)
        tasks = [get_task(t) for t in task]
        rewards = [float(k.grade(k.turn(c), str(a))) for k, c, a in zip(tasks, texts, answer, strict=True)]
        # Over several processes each grades its contiguous share of the batch, and a group may span two
        # (TRL gathers the rewards in rank order before grouping): the batch's metrics are of every share.
        graded = shard.everyone([(r, len(ids), t) for r, ids, t in zip(rewards, completion_ids, texts, strict=True)])
        every, tokens = [r for r, _, _ in graded], [n for _, n, _ in graded]
        groups = [every[i : i + generations] for i in range(0, len(every), generations)]
        clock.batch = {
            "reward": sum(every) / len(every),
            "accuracy": sum(r > 0 for r in every) / len(every),
            "response_len": sum(tokens) / len(tokens),
            "response_tokens": sum(tokens),
            "repeated_rate": repeated_rate([t for _, _, t in graded]),
            "flat_groups": sum(len(set(g)) == 1 for g in groups) / len(groups),
        }
        clock.batches.append({"rewards": every, "tokens": tokens})
        return rewards

    return verifier


def _trainer_class():
    from trl import GRPOTrainer

    class _Trainer(GRPOTrainer):
        """TRL's GRPOTrainer with sampling and update timed apart and our step metrics in its logs."""

        clock: _Clock

        def training_step(self, model, inputs, num_items_in_batch):
            if self.clock.start is None:
                self.clock.start = time.perf_counter()
            return super().training_step(model, inputs, num_items_in_batch)

        def _generate(self, prompts):
            start = time.perf_counter()
            out = super()._generate(prompts)
            self.clock.sample_s += time.perf_counter() - start
            return out

        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            self.clock.batches[-1]["advantages"] = shard.everyone(out["advantages"].tolist())  # as the rewards
            return out

        def log(self, logs, start_time=None):
            if "loss" in logs and self.clock.start is not None:  # a training step's log, not the summary
                c = self.clock
                total = (c.end or time.perf_counter()) - c.start
                timing = {"sample_s": c.sample_s, "update_s": total - c.sample_s}
                logs.update({PREFIX + k: v for k, v in (c.batch | timing).items()})
                c.start, c.end, c.sample_s = None, None, 0.0
            super().log(logs, start_time)

    return _Trainer


def _checkpoint_callback(clock: _Clock, keep: set[int], save):
    """Stamps each step's end for `_Trainer.log`, then calls `save(step)` at the kept steps (the Trainer's
    own checkpoints are for resuming only)."""
    from transformers import TrainerCallback

    class KeepSteps(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            clock.end = time.perf_counter()
            if state.global_step in keep:
                save(state.global_step)

    return KeepSteps()


def grpo_dataset(tokenizer, problems: list[dict], cfg: GrpoConfig):
    """The prompts of every sampled batch in order, each chat-formatted as its task formats it: the
    problems in fresh seeded orders, one pass after another, as many as `cfg.steps` optimizer steps read
    (a batch serves `updates_per_batch` x `epochs_per_batch` steps)."""
    from datasets import Dataset

    from graftlab.tasks import get_task

    if not problems:
        raise GraftlabError("GRPO: no problems")
    rows = [
        {
            "prompt": get_task(p["task"]).chat_prompt(tokenizer, p["prompt"]),
            "answer": str(p["answer"]),
            "task": p["task"],
        }
        for p in problems
    ]
    needed = math.ceil(cfg.steps / (cfg.updates_per_batch * cfg.epochs_per_batch)) * cfg.batch_size
    return Dataset.from_list([rows[i] for i in passes(len(rows), needed, "grpo-order", cfg.seed)])


def make_trainer(post_dir, problems: list[dict], cfg: GrpoConfig, work: Path, callbacks=(), precision=None, clock=None):
    """TRL's trainer for GRPO of the model at `post_dir`, its Trainer state under `work`; `trainer.clock`
    (`clock`, or a new one) holds the step's timing and the record of every sampled batch."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from graftlab.sampling import trl_grpo_trainer
    from graftlab.train.precision import WEIGHTS_DTYPE, Precision

    tok = AutoTokenizer.from_pretrained(post_dir)
    dataset = grpo_dataset(tok, problems, cfg)
    model = AutoModelForCausalLM.from_pretrained(post_dir, dtype=WEIGHTS_DTYPE)
    clock = clock or _Clock()
    precision = precision or Precision("fp32", "none chosen")
    share = per_process(cfg)
    args = _grpo_args(
        cfg,
        work,
        precision,
        share,
        micro(cfg.micro_batch_size, share, dataset["prompt"], cfg.max_new_tokens, cfg.beta, tok, model),
        context(dataset["prompt"], cfg.max_new_tokens, tok, model),
    )
    trainer = trl_grpo_trainer(
        _trainer_class(),
        args,
        model=model,
        reward_funcs=[make_reward(tok, clock, cfg.generations)],
        train_dataset=dataset,
        processing_class=tok,
        callbacks=list(callbacks) or None,
    )
    trainer.clock = clock
    return trainer


def per_process(cfg: GrpoConfig) -> int:
    """The completions of an optimizer step each process trains on (all of them outside a launch); refused
    when they do not split evenly over the processes."""
    processes = shard.world()[1]
    if cfg.share % processes:
        raise GraftlabError(f"GRPO: a step's {cfg.share} completions do not split over {processes} processes")
    return cfg.share // processes


def micro(setting, batch: int, prompts: list[str], max_new_tokens: int, beta: float, tok, model) -> int:
    """Completions per forward and backward pass of a GRPO run (ours or the Pedagogical RL teacher's):
    `setting`, or with `auto` sized on CUDA for the longest prompt plus a full completion, beside the
    reference model TRL loads when beta > 0 (and anything already on the GPU, such as the teacher's student)."""
    from graftlab.sampling import context_bound
    from graftlab.train.precision import micro_batch

    frozen = sum(p.numel() for p in model.parameters()) if beta > 0 else 0
    return micro_batch(setting, batch, lambda: context_bound(tok, prompts, max_new_tokens), model, frozen_params=frozen)


def context(prompts: list[str], max_new_tokens: int, tok, model) -> tuple:
    """(the longest prompt plus a whole completion, as a function: it tokenizes every prompt, done only
    where asked; the model's own context): what sizes a colocated vLLM engine (`grpo_args`' `context`)."""
    from graftlab.sampling import context_bound

    return (lambda: context_bound(tok, prompts, max_new_tokens)), getattr(model.config, "max_position_embeddings", None)


def _grpo_args(cfg: GrpoConfig, work: Path, precision, share: int, micro: int, context: tuple | None = None):
    """TRL's arguments of a process training on `share` completions of every optimizer step, `micro` at a
    time. TRL samples `steps_per_generation` micro-steps' worth at once, shuffles them and deals each
    micro-step its slice: with it at U optimizer steps' accumulation, each step takes its own 1/U of the
    batch (verl's mini-batches), and `num_iterations` passes over the batch (verl's ppo_epochs)."""
    from graftlab.train.precision import accumulation, checkpointing
    from graftlab.train.trl_args import grpo_args

    on = "on" if checkpointing(cfg.gradient_checkpointing) else "off"
    accumulated = accumulation(share, micro)
    times = f" x {cfg.share // share} processes" if share < cfg.share else ""
    batch = (
        f"{cfg.completions} completions, {cfg.updates_per_batch} update(s) of {cfg.share} = {micro} x "
        f"{accumulated} accumulated{times}, {cfg.epochs_per_batch} pass(es)"
    )
    print(f"batch: {batch}; gradient checkpointing {on}", flush=True)
    return grpo_args(
        cfg,
        work,
        share,
        micro,
        precision,
        generations=cfg.generations,
        beta=cfg.beta,
        context=context,
        steps_per_generation=accumulated * cfg.updates_per_batch,
        num_iterations=cfg.epochs_per_batch,
        lr_scheduler_type="constant",
        epsilon=cfg.epsilon,
        scale_rewards="group" if cfg.scale_rewards else "none",
        loss_type="dapo",
        # The reference (beta > 0) is only read: in bf16 when the run computes in bf16, as our loops' frozen
        # teachers. TRL builds it from these (a policy passed loaded ignores them, and TRL says so once).
        model_init_kwargs={"dtype": torch.bfloat16} if cfg.beta > 0 and precision.bf16 else None,
    )


def step_log(history: list[dict]) -> list[dict]:
    """One row per optimizer step from the Trainer's log history: our metrics and TRL's, under our names."""
    rows = []
    for h in history:
        if PREFIX + "sample_s" not in h:
            continue
        row = {"step": h["step"]} | {new: h[old] for old, new in TRL_METRICS.items() if h.get(old) is not None}
        rows.append(row | {k.removeprefix(PREFIX): v for k, v in h.items() if k.startswith(PREFIX)})
    return rows


def train_grpo(
    post_dir, problems: list[dict], cfg: GrpoConfig, out_dir, inputs=None, resume=None, processes: int = 1
) -> list[dict]:
    """GRPO of the model at `post_dir` on `problems` ([{prompt, answer, task}]); writes `out_dir/step~N` for
    every kept checkpoint, `out_dir/steps.jsonl` (one line per optimizer step) and `out_dir/training.png`,
    all at once when the run ends (a failed run leaves nothing). With `resume` (a
    `graftlab.train.resume.Resume`), the Trainer saves its full state every `resume.minutes` and a rerun
    continues from the newest.

    Over several `processes` (one per GPU) TRL's trainer runs under accelerate with FSDP, as SFT does
    (`graftlab.train.shard.FSDP_CONFIG`), each process sampling and training on its share of every batch;
    it saves no resume state then (every process would have to agree when to save, and the sharded
    Trainer state cannot be tested without GPUs), as SFT over several GPUs does not."""
    from graftlab.train import resume as rs
    from graftlab.train.onpolicy import launch_run, publish_run

    if not problems:
        raise GraftlabError("GRPO: no problems")
    mark = rs.fingerprint(cfg, post=str(post_dir), problems=len(problems))
    if processes == 1:
        train = functools.partial(_train, post_dir, problems, cfg, inputs, resume)
        return publish_run(out_dir, cfg.checkpoints(), resume, mark, train)
    if resume is not None:
        print(f"resume: off over {processes} processes; an interrupted run starts again", flush=True)
    train = functools.partial(_train, post_dir, problems, cfg, inputs, None)
    launched = functools.partial(launch_run, processes, train, accelerate=shard.FSDP_CONFIG)
    return publish_run(out_dir, cfg.checkpoints(), None, mark, launched)


def _train(post_dir, problems: list[dict], cfg: GrpoConfig, inputs, resume, work: Path) -> list[dict]:
    """The training: kept checkpoints into `work`; with `resume`, the Trainer's state saved there when due
    and the end of training marked. Returns the step log."""
    from graftlab.train import diverge
    from graftlab.train import resume as rs
    from graftlab.train.onpolicy import save_checkpoint
    from graftlab.train.precision import announce, save_dtype

    torch.set_num_threads(max(1, cfg.threads // shard.world()[1]))  # the job's threads shared by its processes
    precision = announce(cfg.precision)
    dtype = save_dtype(cfg.save_dtype, post_dir)
    trainer = None

    def save(step: int) -> None:
        model = trainer.accelerator.unwrap_model(trainer.model)
        extra = {"step": step, "problems": len(problems)}
        save_checkpoint(
            model, trainer.processing_class, work / f"step~{step}", dtype, inputs or {"post": str(post_dir)}, cfg, extra
        )

    clock = _Clock()
    # Ours first: a step's end is stamped before the resume callback asks for a Trainer checkpoint.
    callbacks = [diverge.trainer_callback("GRPO"), _checkpoint_callback(clock, set(cfg.checkpoints()), save)]
    if resume is not None:
        callbacks.append(rs.trainer_callback(resume))
    trainer_dir = resume.dir if resume is not None else work / "trainer"
    trainer = make_trainer(post_dir, problems, cfg, trainer_dir, callbacks, precision, clock)
    trainer.train(resume_from_checkpoint=rs.last_checkpoint(resume) if resume is not None else None)
    log = step_log(trainer.state.log_history)
    if resume is not None:
        rs.mark_trained(resume, {"log": log})
    return log
