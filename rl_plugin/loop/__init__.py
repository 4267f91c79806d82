"""Pieces of the driver loop (``rl_plugin.train``): embedded default, step planning, logging,
checkpoint bookkeeping and the reward plot."""
