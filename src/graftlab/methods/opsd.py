"""OPSD's spec (docs/methods.md#opsd): the on-policy self-distillation baseline of the grafting paper.
Its trainer is `graftlab.train.opsd`."""

from __future__ import annotations

from graftlab.methods.spec import OnPolicySpec, at_least, holes, positive, within_unit

PLACEHOLDERS = ("{problem}", "{demonstration}")


class OpsdSpec(OnPolicySpec):
    section = "opsd"
    sweeps = ("alpha", "lr")
    models = 2  # the frozen teacher beside the student
    shards = resumes_sharded = True
    keys = ("alpha", "lr")

    def scorer_bytes(self, section: dict) -> int:
        return 2  # the frozen teacher in bf16 on a GPU (graftlab.train.onpolicy.load_pair)

    def runs(self, section: dict) -> list[dict[str, str]]:
        return [{"alpha": a, "lr": lr} for a in section["alpha"] for lr in section["lr"]]

    def own(self, section: dict) -> list[str]:
        absent = holes(section["template"], PLACEHOLDERS)
        return (
            within_unit(section, "alpha")
            + ([f"template: lacks the placeholder(s) {absent}"] if absent else [])
            + at_least(section, steps=1, batch_size=1, top_k=1)
            + positive(section, "temperature")
        )

    def flops(self, section: dict, params: float, prompt: int, demonstration: int) -> tuple[float, float]:
        P = params
        sampled = prompt + section["max_new_tokens"]
        drawn, trained = self.counts(section)
        # Per sample drawn the student generates (2P); per pass the teacher scores it with the demonstration
        # in its prompt (2P) and the student trains on it (6P), both over whole sequences.
        compute = trained * (2 * P * (sampled + demonstration) + 6 * P * sampled)
        return 2 * P * drawn * sampled, compute
