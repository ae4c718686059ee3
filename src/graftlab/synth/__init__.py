"""Data synthesis: hard-problem mining and training traces (teacher; STaR and Pedagogical RL later)."""
