"""The one Registry helper (``rl_plugin.registry_base``): names in registration order, lazy
entries resolved on first ``get``, duplicate and unknown names refused with messages that name the
registry, the flag and the choices."""

import pytest

from rl_plugin.registry_base import Registry, RegistryError


def test_register_get_names_in_order():
    reg = Registry("widget", "--widget")
    reg.register("b", len)

    @reg.register("a")
    def a():
        return 1

    reg.register_lazy("c", "math:sqrt")
    assert reg.names() == ("b", "a", "c")
    assert reg.get("b") is len and reg.get("a") is a
    import math

    assert reg.get("c") is math.sqrt
    assert "c" in reg and "d" not in reg and len(reg) == 3 and list(reg) == ["b", "a", "c"]


def test_duplicate_name_is_refused_eager_or_lazy():
    reg = Registry("widget", "--widget")
    reg.register("a", len)
    with pytest.raises(RegistryError, match=r"widget 'a' is registered twice .*choose another name"):
        reg.register("a", max)
    with pytest.raises(RegistryError, match="registered twice"):
        reg.register_lazy("a", "math:sqrt")
    assert reg.get("a") is len  # the first registration stands


def test_unknown_name_names_the_flag_and_the_choices():
    reg = Registry("widget", "--widget")
    reg.register("a", len)
    reg.register("b", max)
    with pytest.raises(RegistryError, match=r"^--widget 'z': unknown widget; choose from a, b$"):
        reg.get("z")
    with pytest.raises(ValueError):  # RegistryError is a ValueError: existing callers keep catching it
        Registry("gadget").get("z")


def test_bad_lazy_target_is_refused():
    with pytest.raises(RegistryError, match="expected 'package.module:attr'"):
        Registry("widget").register_lazy("a", "math.sqrt")
