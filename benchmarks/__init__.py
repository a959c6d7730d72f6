"""The performance suite (docs/benchmarks.md), run by `make bench` / `python -m benchmarks`.

Each `benchmarks/bench_*.py` module exposes `run()` (plain or async) returning a list of
figures: dicts with at least `benchmark`, the measured value, the reference measured in the
same run, and their `ratio`. Figures are never pass/fail; they are printed for tracking.
"""
