"""Benchmarks: datasets, metric arithmetic, offline and serving runners, peer engines."""
