"""Benchmarks and the strategy comparison (``python -m bench.compare``). Speed is measured here, never asserted in
tests."""
