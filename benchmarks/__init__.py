"""Benchmarks: scripts that print JSON and write it to ``benchmarks/results/`` (see benchmarks/README.md)."""
