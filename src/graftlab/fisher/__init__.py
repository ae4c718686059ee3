"""Retention Fisher of the post model on its own rollouts (diagonal; KFAC to come) and the masks built from it."""
