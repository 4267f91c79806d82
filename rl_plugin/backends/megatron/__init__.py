"""The Megatron backend: megatron-core GPTModel (via mbridge), DDP, optimizer, the shared loss core.

Import ``rl_plugin.backends.megatron.backend.MegatronBackend``; this package imports nothing
heavy at import time.
"""
