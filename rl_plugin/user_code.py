"""Import a user's function named by a flag: ``package.module.function`` (or
``package.module:function``), for ``--custom-pg-loss-reducer-function-path``,
``--custom-tis-function-path`` and ``--dynamic-sampling-filter-path``. Every error names the flag
and the path; a bottom-layer module, so the flag checker, the loss core and the rollout side share it.
"""

from __future__ import annotations

import importlib
from typing import Callable


def load_function(path: str, flag: str) -> Callable:
    """The callable at ``path``; ``ValueError`` naming ``flag`` when it cannot be imported or is
    not callable."""
    module_name, sep, attr = path.replace(":", ".").rpartition(".")
    if not sep or not module_name:
        raise ValueError(f"{flag} {path!r}: expected 'package.module.function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{flag} {path!r}: cannot import {module_name!r}: {exc}") from exc
    fn = getattr(module, attr, None)
    if fn is None or not callable(fn):
        raise ValueError(f"{flag} {path!r}: {module_name!r} has no callable {attr!r}")
    return fn
