"""Benchmarks; run from the checkout root, e.g. `python -m bench.restart`."""
