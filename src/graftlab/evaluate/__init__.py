"""Sampling-based evaluation: Acc@n, unbiased pass@k, per-benchmark metrics."""
