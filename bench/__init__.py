"""Benchmarks of the relay, run on demand (``python -m bench``), never as timed tests in CI."""
