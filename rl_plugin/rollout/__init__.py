"""The rollout side: prompt data, engines, rewards, filters, and the names user code imports
(slime's), the list the README keeps:

    from rl_plugin.rollout import Sample, append_image, generate_tokens, get_reward_value, remote_rm

``Sample`` (a rollout sample), ``generate_tokens`` (a generation from a custom hook),
``append_image(sample, image)`` (an image in a hook's later turn, ``vl_turns``),
``get_reward_value(sample, args)`` (a reward's number) and ``remote_rm(args, sample)`` (the remote
reward model's client, for a ``--custom-rm-path`` rm). They are resolved lazily
(``__getattr__``), so importing a submodule (the manager, an engine) imports nothing more; a
module that moves changes its line in ``_EXPORTS`` only, never the users' import.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Sample": "rl_plugin.rollout.sample",
    "append_image": "rl_plugin.rollout.vl_turns",
    "generate_tokens": "rl_plugin.rollout.generate",
    "get_reward_value": "rl_plugin.rollout.rewards.functions",
    "remote_rm": "rl_plugin.rollout.rewards.remote_rm",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'rl_plugin.rollout' has no attribute {name!r}")
