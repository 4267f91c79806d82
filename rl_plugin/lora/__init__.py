"""LoRA shared by both backends: which linears get adapters, how adapters are named and how they
start (issue 34). The backends build their adapter modules from these, so both give the same
adapters, J and gradients from the same seed.

- ``targets``: ``--target-modules`` / ``--exclude-modules`` resolved to HF projection names
  (``q_proj`` ... ``down_proj``), and the Megatron linear each lives in.
- ``init``: the initial A of one adapter, a function of (seed, adapter name, shape) only, on the
  full (unsharded) shape; B starts at zero.
- ``scaling``: the adapter's scale ``alpha / r``, computed there only.
"""
