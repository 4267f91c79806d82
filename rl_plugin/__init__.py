"""rl_plugin: a Megatron-Core plugin for RL post-training of LLMs (design: docs/design.md)."""

__version__ = "0.1.0"
