"""Analysis of evaluated runs: summary tables, Pareto frontiers, figures."""
