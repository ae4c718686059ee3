"""The TRL arguments graftlab sets for every trainer it runs through TRL: SFT (`SFTConfig`), GRPO and the
Pedagogical RL teacher, which is GRPO with its own reward (`GRPOConfig`, through `grpo_args`). What they
share is set here once; each trainer adds only its own."""

from __future__ import annotations

from pathlib import Path


def trl_args(kind, cfg, work: Path, batch: int, micro: int, precision, **own):
    """TRL's config class `kind` for a run of `cfg` (its `RunSettings`, `lr`), its Trainer state under
    `work`: an optimizer step over `batch` examples of one process, made of micro-batches of `micro`."""
    import torch

    from graftlab.train.live import trainer_kwargs
    from graftlab.train.precision import accumulation, checkpointing, recompute_args

    recompute = checkpointing(cfg.gradient_checkpointing)
    return kind(
        output_dir=str(work),
        learning_rate=cfg.lr,
        max_grad_norm=cfg.max_grad_norm,  # 0: none (the Trainer logs the norm before clipping either way)
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=accumulation(batch, micro),
        seed=cfg.seed,
        # Every step logged, its own loss (not a running mean: `graftlab.train.sft.step_timer`), a NaN or inf
        # shown as one rather than replaced by the mean of the losses before it (`graftlab.train.diverge`).
        logging_steps=1,
        logging_nan_inf_filter=False,
        **trainer_kwargs(cfg.live),
        use_cpu=not torch.cuda.is_available(),
        dataloader_num_workers=0,
        **precision.trainer_kwargs(),
        **recompute_args(kind, recompute),
        **own,
    )


def grpo_args(
    cfg, work: Path, batch: int, micro: int, precision, *, generations: int, beta: float, context=None, **own
):
    """TRL's GRPOConfig of a GRPO run (ours, or the Pedagogical RL teacher's): groups of `generations`
    completions, a KL term `beta`, the prompts read in the order the dataset holds them (shuffle off: the
    order is fixed in advance, so a resumed run reads on where it stopped), no Trainer checkpoints of its
    own (ours are kept by step), sampling as `cfg.backend` says. `context`: (the longest prompt plus
    completion, as a function; the model's own context), which size a vLLM engine left unsized."""
    from trl import GRPOConfig

    from graftlab.sampling import grpo_vllm_kwargs

    return trl_args(
        GRPOConfig,
        cfg,
        work,
        batch,
        micro,
        precision,
        num_generations=generations,
        max_completion_length=cfg.max_new_tokens,
        max_steps=cfg.steps,
        temperature=cfg.temperature,
        beta=beta,
        shuffle_dataset=False,
        save_strategy="no",
        disable_tqdm=True,
        **grpo_vllm_kwargs(cfg.backend, *(context or ())),
        **own,
    )
