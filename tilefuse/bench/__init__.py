"""Benchmarks: ``harness`` (timing, ceilings), ``runner`` (CLI loop, JSON, table), one module per family."""
