"""Evaluation: per-benchmark records graded by each benchmark's task (sampled, or greedy for knowledge),
Acc@n, unbiased pass@k and the per-benchmark metrics of `metrics.json`."""
