"""Benchmark harness for twinkle-specs (see bench/README.md and docs/benchmarks.md)."""
