"""The rollout side: prompt data, engines, rewards, filters, and the user-facing face of custom
generation, slime's names:

    from rl_plugin.rollout import Sample, generate_tokens

Both are resolved lazily (``__getattr__``), so importing a submodule (the manager, an engine)
imports nothing more than it did before this package had an ``__init__``.
"""

from __future__ import annotations

import importlib

_EXPORTS = {"Sample": "rl_plugin.rollout.sample", "generate_tokens": "rl_plugin.rollout.generate"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'rl_plugin.rollout' has no attribute {name!r}")
