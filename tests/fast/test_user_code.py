"""Loading a user's function named by a flag (``rl_plugin.user_code``): the three accepted forms,
the flag checker's source check (no user code runs), and the errors naming the flag, the user's
file:line and what the module does define; both error types survive pickling (Ray)."""

from __future__ import annotations

import pickle

import pytest

from rl_plugin.errors import RLArgumentError
from rl_plugin.user_code import (
    UserCodeError,
    UserFunctionNotFound,
    check_importable,
    check_source,
    load_function,
    split_spec,
    where,
)

FLAG = "--custom-rm-path"


def test_split_spec_accepts_the_three_forms():
    assert split_spec("pkg.mod:fn", FLAG) == ("pkg.mod", "fn")
    assert split_spec("pkg.mod.fn", FLAG) == ("pkg.mod", "fn")
    assert split_spec("dir/file.py:fn", FLAG) == ("dir/file.py", "fn")
    for bad in ("fn", "dir/file.py", "dir/mod:fn", "pkg.mod:"):
        with pytest.raises(ValueError, match=rf"{FLAG} '{bad}': expected package.module:function"):
            split_spec(bad, FLAG)


def test_load_from_a_file_and_a_module(tmp_path):
    f = tmp_path / "reward.py"
    f.write_text("def score(x):\n    return 2 * x\n\n\nclass Helper:\n    pass\n")
    fn = load_function(f"{f}:score", FLAG)
    assert fn(21) == 42 and where(fn) == f"{f}:1"
    assert load_function("math:sqrt", FLAG)(16.0) == 4.0 and load_function("os.path.join", FLAG)("a", "b") == "a/b"


def test_a_missing_function_names_what_the_module_defines(tmp_path):
    f = tmp_path / "reward.py"
    f.write_text("def score(x):\n    return x\n\n\nclass Helper:\n    pass\n\n\nVALUE = 3\n")
    with pytest.raises(UserFunctionNotFound) as err:
        load_function(f"{f}:scor", FLAG)
    assert (
        str(err.value)
        == f"{FLAG} '{f}:scor': cannot load the function: '{f}' has no callable 'scor'; it defines: score, Helper"
    )
    back = pickle.loads(pickle.dumps(err.value))
    assert type(back) is UserFunctionNotFound and str(back) == str(err.value) and back.flag == FLAG
    with pytest.raises(UserFunctionNotFound, match=r"no such file .*nope\.py"):
        load_function(f"{tmp_path}/nope.py:f", FLAG)
    with pytest.raises(UserFunctionNotFound, match=r"cannot import 'no_such_module_xyz'"):
        load_function("no_such_module_xyz:f", FLAG)


def test_a_module_that_raises_while_importing_is_named_at_its_line(tmp_path):
    f = tmp_path / "broken.py"
    f.write_text("import math\n\nx = 1\ny = x / 0\n\ndef f():\n    pass\n")
    with pytest.raises(UserCodeError) as err:
        load_function(f"{f}:f", FLAG)
    assert f"ZeroDivisionError: division by zero at {f}:4 (`y = x / 0`)" in str(err.value)
    assert str(err.value).endswith("Fix: correct the module at that line")
    with pytest.raises(RLArgumentError, match=rf"ZeroDivisionError: division by zero at {f}:4"):
        check_importable(f"{f}:f", FLAG)


def test_check_importable_gives_the_fix_for_a_wrong_name(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def good():\n    pass\n")
    with pytest.raises(RLArgumentError) as err:
        check_importable(f"{f}:bad", FLAG)
    assert "it defines: good" in str(err.value) and "Fix: correct the name after the ':'" in str(err.value)
    assert check_importable(f"{f}:good", FLAG) is None


def test_check_source_runs_no_user_code(tmp_path):
    f = tmp_path / "side_effect.py"
    marker = tmp_path / "ran"
    f.write_text(f"open({str(marker)!r}, 'w').close()\n\ndef f():\n    pass\n")
    assert check_source(f"{f}:f", FLAG) is None and not marker.exists()
    assert check_source(None, FLAG) is None
    syntax = tmp_path / "syntax.py"
    syntax.write_text("def f(:\n    pass\n")
    with pytest.raises(RLArgumentError, match=rf"{syntax}:1: SyntaxError: .* Fix: correct the module at {syntax}:1"):
        check_source(f"{syntax}:f", FLAG)
    with pytest.raises(RLArgumentError, match=r"the file .*absent\.py does not exist"):
        check_source(f"{tmp_path}/absent.py:f", FLAG)
    with pytest.raises(
        RLArgumentError,
        match=r"no module 'no_such_pkg_xyz\.mod' on the Python path\. Fix: .* or pass path/to/mod\.py:function",
    ):
        check_source("no_such_pkg_xyz.mod:f", FLAG)
    with pytest.raises(RLArgumentError, match=r"expected package.module:function"):
        check_source("justaname", FLAG)


def test_a_moved_module_of_rl_plugin_still_loads_by_its_old_path():
    """The built-in DAPO filter moved to ``rl_plugin.rollout.dapo.filters``; a flag written with its
    earlier path loads the same function (``MOVED_MODULES``)."""
    from rl_plugin.rollout.dapo.filters import check_reward_nonzero_std
    from rl_plugin.user_code import load_function

    for spec in (
        "rl_plugin.rollout.filters.check_reward_nonzero_std",
        "rl_plugin.rollout.filters:check_reward_nonzero_std",
    ):
        assert load_function(spec, "--dynamic-sampling-filter-path") is check_reward_nonzero_std
