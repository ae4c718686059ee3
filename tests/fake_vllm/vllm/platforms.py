"""The fake engine's platform: a GPU's (graftlab.sampling reprocesses a tied output head on the CPU backend
only; tests/vllm_cpu/ runs that path on the real one)."""

from types import SimpleNamespace

current_platform = SimpleNamespace(is_cpu=lambda: False)
