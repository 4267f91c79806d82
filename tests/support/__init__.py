"""Helpers of the test suite and the benchmarks (no tests here), imported as ``tests.support.X``.

- ``harness``: ``run_world(fn, n, *args)``, n spawned processes in one gloo group; ``free_port``.
- ``flags``: ``exact_sgd()`` / ``EXACT_SGD``, the flags of plain SGD (update = -lr * gradient).
- ``fsdp_common``: the tiny checkpoint, one step's data and the flags of the FSDP backend tests.
- ``megatron_common``: validated flags, a seeded synthetic step batch and DP shards (Megatron).
- ``reference``: naive loop-based reference objectives, written from docs/design.md's formulas.
- ``tolerance``: tolerances of floating-point comparisons, derived from the computation.
- ``checkpointing``: saves and loads of a backend in the loop's checkpoint layout.
- ``local_ray``: a local Ray cluster for one test module.
- ``flag_rules``: the check every flag-rule table runs (refused at parse time, rule and fix named).

Fixtures built on them live in ``tests/fast/conftest.py``.
"""
