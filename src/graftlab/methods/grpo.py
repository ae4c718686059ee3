"""GRPO's spec (docs/methods.md#grpo): TRL's trainer rewarded by the task's verifier, the second paper's
on-policy reference. Its trainer is `graftlab.train.grpo`."""

from __future__ import annotations

from graftlab.methods.spec import OnPolicySpec, at_least, positive


class GrpoSpec(OnPolicySpec):
    section = "grpo"
    shards = True  # TRL's trainer under accelerate with FSDP (graftlab.train.grpo), saving no resume state then

    def sampled(self, section: dict) -> int:
        return section["batch_size"] * section["generations"]  # completions, each step's 1/U of them

    def split(self, section: dict) -> int:
        # TRL deals each process its part of a step's completions; a group may span processes.
        return self.batch(section)

    def scorers(self, section: dict) -> int:
        return 1 if section["beta"] else 0  # TRL loads the reference only for a KL term

    def scorer_bytes(self, section: dict) -> int:
        return 2  # the reference in bf16 on a GPU (graftlab.train.grpo)

    def own(self, section: dict) -> list[str]:
        counts = at_least(section, steps=1, batch_size=1, generations=2, max_new_tokens=1)
        beta = [] if section["beta"] >= 0 else [f"beta: must be >= 0, got {section['beta']}"]
        flag = section["scale_rewards"]
        scale = [] if isinstance(flag, bool) else [f"scale_rewards: must be true or false, got {flag!r}"]
        return positive(section, "lr", "epsilon", "temperature") + counts + beta + scale

    def flops(self, section: dict, params: float, prompt: int, demonstration: int) -> tuple[float, float]:
        P, g = params, section
        sampled = prompt + g["max_new_tokens"]
        drawn, trained = self.counts(g)
        # Per sample drawn: generated (2P) and, when its batch serves more than one step, its old log-probs
        # scored (2P, once); per pass trained on (6P) and, with a KL term, scored by the reference (2P).
        old = 2 * P * drawn if g["updates_per_batch"] * g["epochs_per_batch"] > 1 else 0
        return 2 * P * drawn * sampled, (old + (6 + (2 if g["beta"] else 0)) * P * trained) * sampled
