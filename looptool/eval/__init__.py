"""Evaluation: per-budget loss and timing, mechanistic analysis, the lm-evaluation-harness adapter."""
