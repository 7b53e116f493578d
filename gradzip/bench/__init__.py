"""Benchmarks (``gradzip bench NAME``). Speed targets live here and in BENCHMARKS.md, never in tests."""
