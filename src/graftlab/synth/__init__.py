"""Data synthesis: hard-problem mining and training traces: teacher (`traces`), STaR (`star`), Pedagogical
RL (`pedagogical`)."""
