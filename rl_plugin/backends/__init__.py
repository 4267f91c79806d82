"""Training backends. Each implements ``rl_plugin.backends.base.TrainBackend``."""
