"""rl_plugin: a Megatron-Core plugin for RL post-training of LLMs (see DESIGN in the README)."""

__version__ = "0.1.0"
