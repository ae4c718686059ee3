"""Training methods: SFT (and, in later issues, OPSD, SDPO, GRPO and their divergence losses)."""
