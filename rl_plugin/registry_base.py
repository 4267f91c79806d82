"""The ``Registry`` class: names -> implementations, one instance per kind of pluggable piece
(the instances, every registry of rl_plugin, are ``rl_plugin.registries``).

A registry maps a name (what a flag takes) to an object. An entry is either the object itself
(``register``) or a ``"package.module:attr"`` string resolved on first ``get`` (``register_lazy``),
so a registry can list its names without importing the (torch-heavy) modules that implement
them: the flag layer builds argparse ``choices`` from ``names()`` and stays cheap to import.

- ``register(name, obj)`` or ``@registry.register(name)``: a name registered twice raises
  ``RegistryError`` naming the registry and both entries.
- ``get(name)``: the object; an unknown name raises ``RegistryError`` naming the flag and listing
  the registered names.
- ``names()``: the names in registration order.

No dependency beyond the standard library: every layer may import it.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Dict, Optional, Tuple


class RegistryError(ValueError):
    """A name registered twice, or an unknown name; the message names the registry and the fix."""


class _Lazy:
    __slots__ = ("target",)

    def __init__(self, target: str):
        module, sep, attr = target.partition(":")
        if not (module and sep and attr):
            raise RegistryError(f"lazy registry entry {target!r}: expected 'package.module:attr'")
        self.target = target

    def load(self) -> Any:
        module, _, attr = self.target.partition(":")
        obj = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
        return obj

    def __repr__(self) -> str:
        return self.target


class Registry:
    """Names of one kind (``kind``, e.g. "policy loss"), chosen by ``flag`` (for error messages)."""

    def __init__(self, kind: str, flag: Optional[str] = None):
        self.kind, self.flag = kind, flag
        self._entries: Dict[str, Any] = {}

    def register(self, name: str, obj: Any = None) -> Any:
        """``register(name, obj)`` returns ``obj``; ``@register(name)`` decorates."""
        if obj is None:

            def deco(fn: Callable) -> Callable:
                self.register(name, fn)
                return fn

            return deco
        self._add(name, obj)
        return obj

    def register_lazy(self, name: str, target: str) -> None:
        """Register ``"package.module:attr"``, imported on the first ``get(name)``."""
        self._add(name, _Lazy(target))

    def _add(self, name: str, entry: Any) -> None:
        if not isinstance(name, str) or not name:
            raise RegistryError(f"{self.kind} registry: a name must be a non-empty string (got {name!r})")
        if name in self._entries:
            raise RegistryError(
                f"{self.kind} {name!r} is registered twice (already {self._entries[name]!r}, again {entry!r}); "
                f"choose another name, the registered ones are {list(self.names())}"
            )
        self._entries[name] = entry

    def names(self) -> Tuple[str, ...]:
        return tuple(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self):
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, name: str) -> Any:
        try:
            entry = self._entries[name]
        except (KeyError, TypeError):
            what = f"{self.flag} {name!r}" if self.flag else f"{self.kind} {name!r}"
            raise RegistryError(f"{what}: unknown {self.kind}; choose from {', '.join(self.names())}") from None
        if isinstance(entry, _Lazy):
            entry = self._entries[name] = entry.load()
        return entry

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, names={list(self.names())})"
