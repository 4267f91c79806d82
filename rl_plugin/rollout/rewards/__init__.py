"""Rewards: the reward functions by name and user functions (``functions``), the one scorer of a
rollout's ``Sample``s that takes every form (``scorer.SampleScorer``: built-in, custom, slime's
``rm(args, sample)`` and group forms) and the remote reward server client (``remote_rm``)."""
