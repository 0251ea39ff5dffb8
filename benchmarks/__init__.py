"""Side-by-side benchmarks of collective against the transports and libraries users compare it with.

Run ``python -m benchmarks --help`` from the repository root.
"""
